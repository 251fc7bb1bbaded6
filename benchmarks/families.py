"""Batch-1 decode per model family: sparkserve vs llama.cpp's llama-bench on the same random-weight Q8_0 GGUF,
in one run, alternating rounds.

Per family: the tiny checkpoint of tests/family_fixtures.py grown to a small real-ish shape (SHAPE:
hidden 512, 8 layers, 8 heads of 64, 4 KV heads, vocab 8192; MoE: 8 experts, top 2), random weights,
a tokenizer trained here, converted to Q8_0 by llama.cpp's own convert_hf_to_gguf.py (gguf_conformance.py's
worker and environment: LLAMA_CPP_SDIST, CONVERTER_PYTHON). sparkserve: the Engine as `sparkserve serve`
runs it (int8 activations), batch-1 greedy decode tok/s = (N - 1) / (t(N tokens) - t(1 token)).
llama.cpp: `llama-bench -p 0 -n N -r 1` (found as every benchmark finds it: peers/llamacpp.py `tool`,
LLAMA_BENCH / LLAMA_CPP_LIB_PATH, else a found or built copy) in the peers' environment. Medians of
--reps rounds (engine order flipped every round), the ratio per family and the median ratio.

    CONVERTER_PYTHON=/work/llamacpp/venv/bin/python PYTHONPATH=. \\
    python benchmarks/families.py [--threads 1] [--reps 3] [--new-tokens 64] [--only a,b]

writes benchmarks/results/families.{json,md} (families_<N>t.* with --threads N > 1). One thread by
default: on the shared 2-core machines, with other processes on the cores, llama.cpp's 2-thread pool
collapsed (llama-bench tg64 2-21 tok/s at load average 17, against ~250 on one thread)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

import gguf_conformance as conformance  # noqa: E402

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1536, vocab_size=8192, max_position_embeddings=4096)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=512)
# family -> (tests/family_fixtures.py FAMILIES name or conftest arch, tokenizer, overrides of SHAPE)
CASES: dict[str, tuple[str, str, dict]] = {
    "llama3": ("llama3", "llama-bpe", {"max_position_embeddings": 16384}),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen2", {}),
    "mistral": ("mistral", "spm", {"sliding_window": None}),
    "gemma2": ("gemma2", "gemma-spm", {"sliding_window": 128, "query_pre_attn_scalar": 64}),
    "gemma3": ("gemma3", "gemma-spm", {"sliding_window": 128, "query_pre_attn_scalar": 64,
                                       "num_hidden_layers": 6}),
    "phi3": ("phi3", "phi3-spm", dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)),
    "granite": ("granite", "refact", {}),
    "olmo2": ("olmo2", "dbrx", {}),
    "smollm3": ("smollm3", "llama-bpe", {}),
    "gpt-oss": ("gpt_oss_gguf", "gpt-4o", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                           "intermediate_size": 512, "sliding_window": 128,
                                           "layer_types": ["sliding_attention", "full_attention"] * 4}),
    "mixtral": ("mixtral", "spm", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=768)),
    "qwen3moe": ("qwen3_moe_raw", "qwen2", dict(MOE, num_experts=8, norm_topk_prob=True)),
    "deepseek2": ("deepseek_v2_qlora_gguf", "deepseek-llm", dict(
        MOE, num_key_value_heads=8, head_dim=None, n_routed_experts=8, q_lora_rank=192, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=1)),
}


def make_checkpoint(fixture: str, tokenizer: str, overrides: dict, path: str) -> str:
    """The fixture's config at SHAPE (+ overrides), transformers' random init, a tokenizer trained here."""
    import torch
    from conftest import TINY_CONFIGS
    from family_fixtures import FAMILIES
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, kw = FAMILIES[fixture] if fixture in FAMILIES else (fixture, TINY_CONFIGS[fixture])
    cfg = {**kw, **SHAPE, **overrides}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32)
    model.save_pretrained(path)
    vocab = cfg["vocab_size"]
    if tokenizer.endswith("spm"):
        conformance._write_spm_tokenizer(path, tokenizer, vocab)
    else:
        conformance._write_bpe_tokenizer(path, tokenizer, vocab)
    return path


def sparkserve_decode(path: str, prompt: list[int], n_new: int, reps: int, threads: int) -> list[float]:
    from sparkserve import Engine
    engine = Engine(path, max_total_tokens=4096, activation_quant="int8")

    def run(n: int) -> float:
        t = time.perf_counter()
        engine.generate(input_ids=[prompt], sampling_params={"temperature": 0, "max_new_tokens": n,
                                                             "ignore_eos": True})
        return time.perf_counter() - t
    try:
        run(4)
        return [(n_new - 1) / (run(n_new) - run(1)) for _ in range(reps)]
    finally:
        engine.shutdown()


def llama_bench(path: str, n_new: int, threads: int) -> float:
    from peers.llamacpp import tool
    from results_io import peer_env
    cmd = [str(tool("llama-bench")), "-m", path, "-t", str(threads), "-p", "0", "-n", str(n_new), "-r", "1",
           "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(), timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def merged_rows(name: str, rows: list[dict], a) -> tuple[list[dict], str]:
    """--only: the families measured now in place of theirs in the last full results (same threads,
    tokens and rounds; the others kept), and a sentence saying which rows came from this later run."""
    path = os.path.join(HERE, "results", f"{name}.json")
    if not os.path.exists(path):
        return rows, ""
    with open(path) as f:
        old = json.load(f)
    if (old["threads"], old["new_tokens"], old["reps"]) != (a.threads, a.new_tokens, a.reps):
        return rows, ""
    new = {r["family"]: r for r in rows}
    kept = [new.pop(r["family"], r) for r in old["rows"]]
    names = ", ".join(r["family"] for r in rows)
    return kept + list(new.values()), f" Rows {names}: a later run (--only), their own alternating rounds."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--only", help="comma-separated families (CASES keys)")
    ap.add_argument("--keep", help="keep the checkpoints and GGUFs in this directory")
    a = ap.parse_args()
    import torch
    from results_io import machine_line, write_results
    torch.set_num_threads(a.threads)
    cases = {k: v for k, v in CASES.items() if not a.only or k in a.only.split(",")}
    work = a.keep or tempfile.mkdtemp(prefix="families_")
    os.makedirs(work, exist_ok=True)
    jobs = []
    for name, (fixture, tok, over) in cases.items():
        d = os.path.join(work, name)
        if not os.path.exists(os.path.join(d, "config.json")):
            make_checkpoint(fixture, tok, over, d)
        jobs.append({"case": name, "dir": d, "out": os.path.join(work, f"{name}.q8_0.gguf"),
                     "outtype": "q8_0", "pre": "llama-bpe" if tok.endswith("spm") else tok})
    todo = [j for j in jobs if not os.path.exists(j["out"])]
    done = conformance._run_worker(conformance.CONVERTER_PYTHON, "--convert", todo, dict(os.environ), 3600)
    errors = {j["case"]: j["error"] for j in done if j["error"]}
    rows = []
    prompt = list(range(100, 132))
    for job in jobs:
        row = {"family": job["case"], "gguf_mb": None, "sparkserve": [], "llama.cpp": []}
        rows.append(row)
        if job["case"] in errors:
            row["error"] = f"convert: {errors[job['case']]}"
            continue
        row["gguf_mb"] = round(os.path.getsize(job["out"]) / 2**20, 1)
        for rep in range(a.reps):
            order = ("sparkserve", "llama.cpp") if rep % 2 == 0 else ("llama.cpp", "sparkserve")
            for engine in order:
                try:
                    if engine == "sparkserve":
                        row[engine] += sparkserve_decode(job["out"], prompt, a.new_tokens, 1, a.threads)
                    else:
                        row[engine].append(llama_bench(job["out"], a.new_tokens, a.threads))
                except Exception as e:      # noqa: BLE001  (a refusal is a result)
                    row.setdefault("error", f"{engine}: {type(e).__name__}: {str(e)[:300]}")
        med = {e: statistics.median(row[e]) for e in ("sparkserve", "llama.cpp") if row[e]}
        row["median"] = med
        if len(med) == 2:
            row["ratio"] = med["sparkserve"] / med["llama.cpp"]
        print(json.dumps(row), file=sys.stderr, flush=True)
    name = "families" if a.threads == 1 else f"families_{a.threads}t"
    rows, rerun = merged_rows(name, rows, a) if a.only else (rows, "")
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    lines = [f"# Batch-1 decode per family: sparkserve vs llama.cpp (llama-bench), {a.threads} thread(s)", "",
             machine_line(), "",
             f"Random-weight Q8_0 GGUFs made by llama.cpp's convert_hf_to_gguf.py from the families' test "
             f"fixtures grown to hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
             f"vocab {SHAPE['vocab_size']} (MoE: 8 experts, top 2); {a.new_tokens} new tokens; medians of "
             f"{a.reps} alternating rounds. sparkserve: Engine, int8 activations, (N-1)/(t(N)-t(1)); "
             f"llama.cpp: llama-bench tg{a.new_tokens}. Shared 2-core machine: ratios within one run only."
             + rerun,
             "", "| family | GGUF MB | sparkserve tok/s | llama.cpp tok/s | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        m = r.get("median", {})
        cell = lambda e: f"{m[e]:.1f}" if e in m else "-"  # noqa: E731
        ratio = f"{r['ratio']:.2f}x |" if "ratio" in r else f"- | {r.get('error', '')[:200]}"
        lines.append(f"| {r['family']} | {r['gguf_mb'] or '-'} | {cell('sparkserve')} | "
                     f"{cell('llama.cpp')} | {ratio}")
    if ratios:
        lines += ["", f"Median ratio over {len(ratios)} families: {statistics.median(ratios):.2f}x "
                      f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)."]
    write_results(name, {"machine": machine_line(), "threads": a.threads, "new_tokens": a.new_tokens,
                         "reps": a.reps, "shape": SHAPE, "rows": rows,
                         "median_ratio": statistics.median(ratios) if ratios else None}, lines)


if __name__ == "__main__":
    main()
