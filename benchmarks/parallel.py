"""Parallel layouts on this machine: TP=2, and PP=2 one batch at a time or with every step split
into 2 or 4 micro-batches however few its tokens, with 1 torch thread per rank, against one process
with 1 and 2 threads: batch-1 decode, batch-32 throughput and a prefill of 16 prompts of 128
tokens, on a random Llama of 0.2B parameters made for the run (SmolLM2's 9 heads do not split over
2 ranks). Also the payload the driver rank puts into collectives and sends per generated token,
counted (TP: two all-reduces of the hidden state per layer, the embedding's all-reduce, the batch
broadcast, the logits' hidden rows and vocab slices; PP: the broadcast and one hidden row per
micro-batch to the next stage). Honest about 2 cores: the layouts split the same arithmetic over
processes and add communication, so at best they match threads here; they pay where a rank has
cores or a device of its own. The step overhead over half the 1-thread step is what
docs/parallel-scaling.md builds its model from. The prefill shows where micro-batches pay
(compute-bound steps); a batch-32 decode step is bound by reading the weights, which each
micro-batch reads again (so by default a step splits only into micro-batches of 64 tokens or more).

Also the expert-parallel combine on 2 gloo ranks: one all-reduce of every token's partial output
(what layers/moe.py does, attention being replicated) against an all-to-all of the partial rows
followed by an all-gather of the summed halves (what a dispatch/combine layout pays).

    python benchmarks/parallel.py [--reps 3] [--new-tokens 64]

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)); medians of --reps, layouts alternating.
Writes benchmarks/results/parallel.{md,json}."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from results_io import write_results

CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
              num_key_value_heads=8, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=True,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

LAYOUTS = {"1 process, 1 thread": dict(num_threads=1), "1 process, 2 threads": dict(num_threads=2),
           "TP=2, 1 thread per rank": dict(tp_size=2, num_threads=1),
           "PP=2, one batch at a time": dict(pp_size=2, pp_micro_batches=1, num_threads=1),
           "PP=2, 2 micro-batches": dict(pp_size=2, pp_micro_batch_min_tokens=1, num_threads=1),
           "PP=2, 4 micro-batches": dict(pp_size=2, pp_micro_batches=4, pp_micro_batch_min_tokens=1,
                                         num_threads=1)}
PREFILL = (16, 128)      # prompts x tokens, one new token: compute-bound, where micro-batches pay
IDEAL = {"TP=2, 1 thread per rank": 0.5, "PP=2, one batch at a time": 1.0}   # of the 1-thread step


def make_model(path: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG),
                                     dtype=torch.float32).save_pretrained(path)
    return path


def timed(engine, batch: int, new: int, prompt_len: int = 32) -> float:
    prompts = [[(7 * i + j) % 8000 + 5 for j in range(prompt_len)] for i in range(batch)]
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                        "ignore_eos": True})
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    from sparkserve import Engine
    from sparkserve.distributed import parallel_state as ps
    path = make_model(tempfile.mkdtemp(prefix="parallel-bench-"))
    res: dict = {k: {m: [] for m in ("decode", "batch32", "prefill", "bytes1", "bytes32")} for k in LAYOUTS}
    for _ in range(a.reps):              # layouts alternate; one parallel engine per process at a time
        for name, kw in LAYOUTS.items():
            with Engine(path, max_total_tokens=32 * 128, **kw) as eng:
                timed(eng, 1, 4)                                   # warm-up
                b0 = ps.sent_bytes()
                one = timed(eng, 1, 1)
                b1 = ps.sent_bytes()
                full = timed(eng, 1, a.new_tokens)
                b2 = ps.sent_bytes()
                res[name]["decode"].append((a.new_tokens - 1) / (full - one))
                res[name]["bytes1"].append(((b2 - b1) - (b1 - b0)) / (a.new_tokens - 1))
                res[name]["batch32"].append(32 * a.new_tokens / timed(eng, 32, a.new_tokens))
                res[name]["bytes32"].append((ps.sent_bytes() - b2) / (32 * a.new_tokens))
                res[name]["prefill"].append(PREFILL[0] * PREFILL[1] / timed(eng, PREFILL[0], 1, PREFILL[1]))
    combine = collective_costs(a.reps)
    write_results("parallel", {"config": CONFIG, "new_tokens": a.new_tokens, "results": res,
                               "ep_combine_ms": combine}, table(res, a) + combine_table(combine, a))
    return 0


ROWS = (1, 32, 256)


def _combine_rank(rank: int, port: int, reps: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    d = CONFIG["hidden_size"]
    times = {}
    for rows in ROWS:
        x = torch.randn(rows * 2, d)          # every token's partial output (even rows: splittable)

        def all_reduce():
            dist.all_reduce(x.clone())

        def all_to_all_gather():               # each rank sums half the rows, then all gather them
            recv = torch.empty_like(x)
            dist.all_to_all_single(recv, x.clone())
            half = recv.view(2, rows, d).sum(0)
            dist.all_gather_single(torch.empty(2 * rows, d), half)
        for name, fn in (("all-reduce", all_reduce), ("all-to-all + all-gather", all_to_all_gather)):
            fn()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(20 * reps):
                fn()
            times[(name, rows * 2)] = (time.perf_counter() - t) / (20 * reps) * 1e3
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def collective_costs(reps: int) -> dict:
    """Milliseconds per combine of [rows, hidden] partial outputs on 2 gloo ranks."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_combine_rank, args=(r, port, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    times = q.get()
    for p in procs:
        p.join()
    return {f"{name} | {rows}": ms for (name, rows), ms in times.items()}


def combine_table(combine: dict, a) -> list[str]:
    lines = ["", "## Expert-parallel combine on 2 gloo ranks (ms per combine, hidden 1024, fp32)", "",
             "| tokens | all-reduce | all-to-all + all-gather |", "|---|---|---|"]
    for rows in ROWS:
        r = rows * 2
        ar, a2a = combine[f"all-reduce | {r}"], combine[f"all-to-all + all-gather | {r}"]
        lines.append(f"| {r} | {ar:.2f} | {a2a:.2f} |")
    return lines


def table(res: dict, a) -> list[str]:
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    base, single = med["1 process, 2 threads"], med["1 process, 1 thread"]
    pp1 = med["PP=2, one batch at a time"]
    lines = ["# Parallel layouts on 2 cores, random Llama (hidden 1024, 12 layers, 16 heads, fp32)", "",
             f"{a.new_tokens} new tokens, greedy, prompts of 32 tokens, medians of {a.reps}; ratios against "
             "one process with 2 threads (and batch-32 against PP=2 one batch at a time); sent = payload "
             "the driver rank puts into collectives and sends per generated token (batch 1 decode / "
             "batch 32 incl. prefill); step overhead = decode step - its ideal (TP=2: half the 1-thread "
             "step; PP=2 one batch at a time: the 1-thread step, as the stages run in turn)", "",
             "| layout | batch-1 decode tok/s | vs 2 threads | batch-32 tok/s | vs 2 threads | vs PP=2 one "
             f"batch | prefill tok/s ({PREFILL[0]} x {PREFILL[1]}) | vs PP=2 one batch | sent per token "
             "b1 / b32 | step overhead (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in med.items():
        ideal = IDEAL.get(name)
        over = f"{(1 / m['decode'] - ideal / single['decode']) * 1e3:.1f}" if ideal else ""
        sent = f"{m['bytes1'] / 1024:.1f} / {m['bytes32'] / 1024:.1f} KiB" if m["bytes1"] else ""
        vs_pp = f"{m['batch32'] / pp1['batch32']:.2f}x" if name.startswith("PP") else ""
        vs_pp_prefill = f"{m['prefill'] / pp1['prefill']:.2f}x" if name.startswith("PP") else ""
        lines.append(f"| {name} | {m['decode']:.1f} | {m['decode'] / base['decode']:.2f}x | "
                     f"{m['batch32']:.1f} | {m['batch32'] / base['batch32']:.2f}x | {vs_pp} | "
                     f"{m['prefill']:.0f} | {vs_pp_prefill} | {sent} | "
                     f"{over} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
