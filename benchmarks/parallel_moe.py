"""MoE under DP attention (benchmarks/parallel.py --only moe-a2a): a batch-32 decode step and a
16 x 128-token prefill on a random Qwen3-MoE made for the run (hidden 512, 4 layers, 16 experts of
width 512, top-2), with every rank its own attention group (--tp-size N --dp-size N), N = 2 and 4,
1 torch thread per rank, three ways of meeting the experts:

- TP MoE (--ep-size 1): every rank holds 1/N of every expert's width; each layer all-gathers every
  group's rows, runs all of them through its slices and all-reduces;
- EP, all-reduce (--ep-size N, --moe-a2a-backend none): every rank holds E/N whole experts; the
  same all-gather, its experts' rows, the same all-reduce;
- EP, all-to-all (--ep-size N --moe-a2a-backend a2a): each rank routes only its own rows and
  sends them to the ranks owning their experts (one all-gather of per-expert counts, a dispatch
  and a combine all-to-all); no row is gathered everywhere and no layer-wide all-reduce runs.

Step times are medians over --reps, layouts alternating; the driver's payload per decode token and
whether the layouts' greedy tokens agree are reported too. Honest about the machine: the ranks
share its cores with each other (and, on this project's machine, with other jobs), so what shows is
the collectives' count and size, not the arithmetic a rank of its own would save."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

MOE_CONFIG = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, num_experts=16, num_experts_per_tok=2,
                  norm_topk_prob=True, vocab_size=8192, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  mlp_only_layers=[], decoder_sparse_step=1)
BATCH, PREFILL = 32, (16, 128)


def moe_layouts(n: int) -> dict[str, dict]:
    dp = dict(tp_size=n, dp_size=n, enable_dp_attention=True, num_threads=1)
    return {f"TP MoE, {n} ranks": dp, f"EP {n}, all-reduce": dict(dp, ep_size=n),
            f"EP {n}, all-to-all": dict(dp, ep_size=n, moe_a2a_backend="a2a")}


def make_moe(path: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **MOE_CONFIG),
                                     dtype=torch.float32).save_pretrained(path)
    return path


def _generate(engine, batch: int, new: int, prompt_len: int, salt: int) -> tuple[float, list[list[int]]]:
    prompts = [[(7 * i + j + 1000 * salt) % 8000 + 5 for j in range(prompt_len)] for i in range(batch)]
    t = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                              "ignore_eos": True})
    return time.perf_counter() - t, [o["output_ids"] for o in out]


def moe_a2a(_path: str, a) -> tuple[dict, list[str]]:
    from sparkserve import Engine
    from sparkserve.distributed import parallel_state as ps
    path = make_moe(tempfile.mkdtemp(prefix="moe-bench-"))
    sizes = [n for n in (2, 4) if n <= a.moe_max_ranks]
    layouts = {k: v for n in sizes for k, v in moe_layouts(n).items()}
    res = {k: {m: [] for m in ("step_ms", "prefill_s", "bytes")} for k in layouts}
    ids: dict[str, list] = {}
    n, load, start = a.new_tokens, [os.getloadavg()[0]], time.perf_counter()
    for _ in range(a.reps):
        for name, kw in layouts.items():
            with Engine(path, max_total_tokens=64 * 256, chunked_prefill_size=512, **kw) as eng:
                _generate(eng, 4, 4, 16, 0)                                      # warm-up
                b0 = ps.sent_bytes()
                one, _ = _generate(eng, BATCH, 1, 32, 1)
                b1 = ps.sent_bytes()
                full, out = _generate(eng, BATCH, n, 32, 2)
                b2 = ps.sent_bytes()
                pre, _ = _generate(eng, PREFILL[0], 1, PREFILL[1], 3)
            r = res[name]
            r["step_ms"].append(1000 * (full - one) / (n - 1))
            r["bytes"].append(((b2 - b1) - (b1 - b0)) / (BATCH * (n - 1)))
            r["prefill_s"].append(pre)
            ids[name] = out
            load.append(os.getloadavg()[0])
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    same = {k: ids[k] == ids[next(iter(layouts))] for k in layouts}
    return ({"moe_a2a": {"config": MOE_CONFIG, "new_tokens": n, "batch": BATCH, "prefill": PREFILL,
                         "results": res, "medians": med, "same_tokens": same, "load": load}},
            _table(res, med, same, sizes, load, time.perf_counter() - start, a))


def _table(res: dict, med: dict, same: dict, sizes: list[int], load: list[float], wall: float,
           a) -> list[str]:
    lines = ["", "## MoE under DP attention: TP MoE vs expert parallel with all-reduce vs all-to-all", "",
             f"Random Qwen3-MoE (hidden 512, 4 layers, 16 experts of width 512, top-2), every rank its own "
             f"attention group, 1 torch thread per rank; batch-{BATCH} decode ({a.new_tokens} tokens) and "
             f"{PREFILL[0]} x {PREFILL[1]}-token prefill; medians of {a.reps} rounds, layouts alternating, "
             f"{wall:.0f} s in all. Load average over the run {min(load):.1f} .. {max(load):.1f} on "
             f"{os.cpu_count()} cores shared with other jobs: the ranks split the same cores, so the "
             "figures show the collectives, not a rank's own arithmetic.", "",
             "| layout | decode step, ms (range) | vs TP MoE | prefill (s) | vs TP MoE | "
             "driver bytes / token | same tokens |", "|---|---|---|---|---|---|---|"]
    for n in sizes:
        base = med[f"TP MoE, {n} ranks"]
        for name in moe_layouts(n):
            m = med[name]
            lo, hi = min(res[name]["step_ms"]), max(res[name]["step_ms"])
            lines.append(f"| {name} | {m['step_ms']:.1f} ({lo:.0f}-{hi:.0f}) | "
                         f"{m['step_ms'] / base['step_ms']:.2f}x | "
                         f"{m['prefill_s']:.2f} | {m['prefill_s'] / base['prefill_s']:.2f}x | "
                         f"{m['bytes'] / 1024:.1f} KiB | {'yes' if same[name] else 'no'} |")
    return lines
