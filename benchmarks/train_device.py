"""The draft TRAIN stage (training/train_dspark.py: train()) on each device torch sees, in one run,
same data and config: steps/s, sequences/s and tokens/s of the training loop.

The draft is the shipped SmolLM2 draft's configuration (sparkserve/drafts/smollm2-135m-instruct/
config.json: 1 layer, gamma 7, its taps, Markov rank, reduced draft vocab when it has one) on a
SmolLM2-135M-shaped target with random weights: training reads only the target's embedding and LM
head (tied, as SmolLM2's; made here), and the feature cache holds random fp16 taps and final rows.
The cache is written through the pipeline's own writers (RawFeatureLog -> feature_cache_from_log,
then write_lse: the reduced-vocab teacher's log-normaliser and greedy labels), its tokens drawn from
a Zipf law (so a reduced vocab covers most response tokens, as with chat data), prompts ~half of each
sequence; the draft vocab is picked from it as stage_train does (select_draft_vocab). Random weights
cost what trained ones do.

Each device trains a fresh draft (same seed) in a fresh output folder for --warmup untimed steps,
then --steps timed ones (--cpu-steps on CPU); a step is timed from the start of one step's batch to
the next's (forward, backward, clip, AdamW, the loop's own bookkeeping), the device synchronised at
each mark. Writes results/train_device.{md,json} (SPARKSERVE_BENCH_RESULTS=DIR elsewhere).

    python benchmarks/train_device.py [--devices cpu,cuda:0] [--steps 30] [--cpu-steps 5] [--warmup 3]
        [--seqs-per-step N] [--threads N] [--seqs 256] [--seq-len 384]"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

# as sparkserve sets before torch loads (imported first here): OpenMP threads that spin after each op
# hold the cores, and the CPU arm slows several-fold where another process shares them
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from results_io import machine_info, machine_line, write_results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAFT_CONFIG = os.path.join(REPO, "sparkserve", "drafts", "smollm2-135m-instruct", "config.json")
# SmolLM2-135M: hidden 576, vocab 49152, 30 layers (the draft config repeats these), tied embeddings
TARGET = {"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30}


def draft_config() -> dict:
    with open(DRAFT_CONFIG) as f:
        cfg = json.load(f)
    for k, v in TARGET.items():
        want = cfg["num_target_layers"] if k == "num_hidden_layers" else cfg[k]
        if want != v:
            raise SystemExit(f"{DRAFT_CONFIG}: {k} {want}, not SmolLM2-135M's {v}")
    return cfg


def target_weight(seed: int = 0) -> torch.Tensor:
    """The random target's tied embedding / LM head [vocab, hidden] (init std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(TARGET["vocab_size"], TARGET["hidden_size"], generator=g) * 0.02


def synthetic_tokens(rng: np.random.Generator, perm: np.ndarray, n: int) -> list[int]:
    """n ids, Zipf-distributed over a fixed random ranking of the vocab."""
    ranks = np.minimum(rng.zipf(1.2, n), len(perm)) - 1
    return perm[ranks].tolist()


def write_cache(path: str, n_seqs: int, seq_len: int, taps: list[int], head: torch.Tensor,
                seed: int = 0) -> dict:
    """A feature cache in `path` by the pipeline's writers: per sequence (length seq_len +-1/6,
    prompt 40-60% of it) random tokens, taps and final rows logged as distillation logs them
    (RawFeatureLog: the last token's row NaN), the cache made from the log, then lse.npy /
    greedy.npy from the target head (write_lse). Returns what was written."""
    from sparkserve.training.feature_cache import RawFeatureLog, feature_cache_from_log, write_lse
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    V, d = head.shape
    perm = rng.permutation(V)
    lo, hi = max(8, seq_len * 5 // 6), max(9, seq_len * 7 // 6)
    lens = rng.integers(lo, hi + 1, n_seqs).tolist()
    plens = [int(rng.integers(int(n * 0.4), int(n * 0.6) + 1)) for n in lens]
    seqs = [synthetic_tokens(rng, perm, n) for n in lens]
    log_dir, out = os.path.join(path, "features.log"), os.path.join(path, "features")
    n_taps = len(taps)
    log = RawFeatureLog(log_dir, taps, d, 0)
    for n in lens:
        log.append(torch.randn(n - 1, n_taps * d, generator=g), torch.randn(n - 1, d, generator=g))
    log.close()
    feature_cache_from_log(log_dir, seqs, plens, taps, out)
    t1 = time.perf_counter()
    write_lse(out, head)
    t2 = time.perf_counter()
    return {"dir": out, "seqs": n_seqs, "tokens": sum(lens), "response_tokens": sum(lens) - sum(plens),
            "mean_len": sum(lens) / n_seqs, "mean_prompt": sum(plens) / n_seqs,
            "write_s": round(t1 - t0, 2), "lse_s": round(t2 - t1, 2)}


def make_draft(dcfg: dict, head: torch.Tensor, vocab: torch.Tensor | None):
    """init_dspark_draft as stage_train calls it with a target: random weights, the target's
    embedding and its LM-head rows of the draft vocab."""
    from sparkserve.models.dspark_draft import init_dspark_draft
    draft = init_dspark_draft(dcfg, None, vocab=vocab)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(head)
        draft.lm_head.weight.copy_(head[draft.to_target_ids(torch.arange(draft.config.out_vocab))])
    return draft


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_device(device: torch.device, dcfg: dict, head: torch.Tensor, vocab, cache, steps: int, warmup: int,
               seqs_per_step: int) -> dict:
    """train() for warmup + steps + 1 steps in a fresh folder; each step's start is marked (the
    last step only closes the last timed one; its end writes the checkpoint, not timed)."""
    from sparkserve.training import train_dspark
    from sparkserve.training.config import TrainConfig
    from sparkserve.training.ranks import Ranks
    total = warmup + steps + 1
    cfg = TrainConfig(steps=total, seqs_per_step=seqs_per_step, save_every=10**9, val_every=0,
                      log_every=10**9)
    marks: list[tuple[float, int]] = []
    inner = train_dspark._step_sums

    def timed_step_sums(draft, cache_, order, first, mine, cfg_, teacher, dev):
        sync(device)
        toks = sum(cache_.lengths[int(order[(first + j) % len(cache_)])] for j in mine)
        marks.append((time.perf_counter(), toks))
        return inner(draft, cache_, order, first, mine, cfg_, teacher, dev)

    draft = make_draft(dcfg, head, vocab)
    if device.type == "cuda":
        torch.cuda.init()                # the peak counters exist once CUDA is initialised
        torch.cuda.reset_peak_memory_stats(device)
    train_dspark._step_sums = timed_step_sums
    try:
        with tempfile.TemporaryDirectory(prefix=f"train_device_{device.type}_") as out:
            metrics = train_dspark.train(draft, cache, out, cfg, log_every=10**9, target_head=head,
                                         ranks=Ranks(device=device), device=device)
    finally:
        train_dspark._step_sums = inner
    times = [b[0] - a[0] for a, b in zip(marks, marks[1:])][warmup:warmup + steps]
    toks = [a[1] for a in marks][warmup:warmup + steps]
    med = statistics.median(times)
    res = {"steps": steps, "warmup": warmup, "step_s": times, "step_tokens": toks,
           "median_step_s": med, "steps_per_s": 1 / med, "seqs_per_s": seqs_per_step / med,
           "tokens_per_s": statistics.median(t / s for t, s in zip(toks, times)),
           "last_loss": metrics.get("loss"), "last_tau_est": metrics.get("tau_est")}
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del draft
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def default_devices() -> str:
    return ",".join(["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=None,
                    help="comma-separated torch devices (default: cpu and every CUDA device torch sees)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps on each non-CPU device")
    ap.add_argument("--cpu-steps", type=int, default=5, help="timed steps on CPU")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first, on every device")
    ap.add_argument("--seqs-per-step", type=int, default=None, help="default: TrainConfig's")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (default: torch's own)")
    ap.add_argument("--seqs", type=int, default=256, help="sequences in the synthetic feature cache")
    ap.add_argument("--seq-len", type=int, default=384, help="mean sequence length (+-1/6; prompt ~half)")
    ap.add_argument("--name", default="train_device", help="results file name")
    args = ap.parse_args()
    if min(args.steps, args.cpu_steps, args.seqs) < 1 or args.warmup < 0:
        ap.error("--steps, --cpu-steps and --seqs must be >= 1, --warmup >= 0")
    from sparkserve.training.config import TrainConfig
    from sparkserve.training.draft_vocab import select_draft_vocab
    from sparkserve.training.feature_cache import FeatureCache
    devices = [torch.device(d) for d in (args.devices or default_devices()).split(",") if d]
    devices = [torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d for d in devices]
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        raise SystemExit(f"--devices {args.devices}: torch {torch.__version__} sees no CUDA device")
    seqs_per_step = args.seqs_per_step or TrainConfig().seqs_per_step
    default_threads = torch.get_num_threads()
    cpu_threads = args.threads or default_threads
    dcfg = draft_config()
    taps = dcfg["target_layer_ids"]
    head = target_weight()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="train_device_cache_") as root:
        info = write_cache(root, args.seqs, args.seq_len, taps, head)
        cache = FeatureCache.open(info["dir"]).with_taps(taps)
        vocab = None
        if dcfg.get("draft_vocab_size"):
            counts = cache.response_token_counts(dcfg["vocab_size"])
            vocab, coverage = select_draft_vocab(counts, dcfg["draft_vocab_size"])
            info["draft_vocab_coverage"] = coverage
        print(f"feature cache: {info['seqs']} seqs, {info['tokens']} tokens, written in {info['write_s']} s "
              f"+ lse {info['lse_s']} s")
        results = {}
        for dev in devices:
            cpu = dev.type == "cpu"
            torch.set_num_threads(cpu_threads if cpu else default_threads)
            r = run_device(dev, dcfg, head, vocab, cache, args.cpu_steps if cpu else args.steps, args.warmup,
                           seqs_per_step)
            r["name"] = (f"{torch.get_num_threads()} threads" if cpu else torch.cuda.get_device_name(dev))
            results[str(dev)] = r
            print(f"{dev}: {r['steps_per_s']:.2f} steps/s, {r['seqs_per_s']:.1f} seqs/s, "
                  f"{r['tokens_per_s']:.0f} tokens/s (loss {r['last_loss']:.3f})")
        torch.set_num_threads(default_threads)
    wall = time.perf_counter() - t0
    gpus = sorted({r["name"] for d, r in results.items() if not d.startswith("cpu")})
    reduced = f"reduced vocab {dcfg['draft_vocab_size']}" if vocab is not None else "full vocab"
    cov = f" (covers {info['draft_vocab_coverage']:.0%} of response tokens)" if vocab is not None else ""
    cfg = TrainConfig()
    arms = ["CPU" if d == "cpu" else r["name"] for d, r in results.items()]
    lines = [f"# Draft training (train_dspark.train) per device: {', '.join(arms)}",
             "", machine_line(), "",
             f"GPU: {', '.join(gpus) or 'none'}; torch {torch.__version__}; fp32 (TF32 matmuls "
             f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}).",
             "",
             f"Draft: the shipped SmolLM2 draft's config ({dcfg['num_hidden_layers']} layer, gamma "
             f"{dcfg['block_size']}, taps {taps}, Markov rank {dcfg['markov_rank']}, {reduced}{cov}) on a "
             f"SmolLM2-135M-shaped target (hidden {TARGET['hidden_size']}, vocab {TARGET['vocab_size']}, "
             f"{TARGET['num_hidden_layers']} layers), random weights. Data: a synthetic feature cache of "
             f"{info['seqs']} sequences, {info['mean_len']:.0f} tokens on average ({info['mean_prompt']:.0f} "
             f"prompt), random fp16 taps and final rows, teacher lse from the target head. TrainConfig "
             f"defaults: {seqs_per_step} sequences per step, {cfg.anchors_per_seq} anchors per sequence.",
             "",
             f"Per device: a fresh draft, {args.warmup} warm-up step(s) untimed, then {args.steps} timed "
             f"steps ({args.cpu_steps} on CPU). Rates are per step: steps/s is 1 / the median step time, "
             f"seqs/s {seqs_per_step} / the median step time, tokens/s the median over steps of the step's "
             f"sequence tokens (feature rows read) / its time; ratio: steps/s over CPU's.",
             "", "| device | steps/s | seqs/s | tokens/s | ratio to cpu |", "|---|---|---|---|---|"]
    base = results.get("cpu", {}).get("steps_per_s")
    for d, r in results.items():
        ratio = f"{r['steps_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {d} ({r['name']}) | {r['steps_per_s']:.2f} | {r['seqs_per_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {ratio} |")
    lines += ["", f"Whole run {wall:.0f} s (cache written in {info['write_s']} s, lse {info['lse_s']} s)."]
    data = {"machine": machine_info(), "torch": torch.__version__, "gpus": gpus, "args": vars(args),
            "draft_config": dcfg, "seqs_per_step": seqs_per_step, "cpu_threads": cpu_threads,
            "cache": {k: v for k, v in info.items() if k != "dir"}, "wall_s": wall, "devices": results}
    write_results(args.name, data, lines)


if __name__ == "__main__":
    main()
