"""Batch-1 decode, prefill of a 512-token prompt and batch-32 throughput on the embedded
SmolLM2-135M-Instruct: sparkserve next to the real llama.cpp (`llama-bench`, built from source by
peers/llamacpp.py, same Q4_1 GGUF) and HF transformers (fp32, same GGUF weights), in one run, same
threads, same machine: the project's machines differ, so only same-run ratios mean something.

    python benchmarks/decode.py [--threads 2] [--reps 3] [--new-tokens 128] [--prompt-tokens 512]
                                [--skip-transformers] [--skip-llamacpp] [--isa native|avx2|avx512]
                                [--model PATH] [--gguf-type Q4_K_M]

- batch-1 decode tok/s = (N - 1) / (t(N tokens) - t(1 token)): prefill cancels out; next to
  llama-bench tg128 (`-p 0 -n 128`).
- prefill-512: time to first token of a 512-token prompt with max_new_tokens=1 (a fresh random
  prompt each time, so the prefix cache cannot help), as tok/s = 512 / TTFT; next to llama-bench
  pp512 (`-p 512 -n 0`).
- batch-32: output tok/s of 32 prompts x N tokens (sparkserve and transformers only).
- sparkserve + DSpark (the shipped draft, adaptive verify): batch-1 decode as above, on the same
  prompt (its speed depends on the text: how many drafts the target accepts); --skip-dspark omits it.
llama.cpp and transformers (peers/transformers_worker.py) run in processes of their own, with the
peers' environment (results_io.peer_env). Medians of --reps rounds; within a round the engines
alternate (order flipped every round) so machine noise hits them alike; llama-bench runs one
rep per round (`-r 1`, plus its warm-up).
Writes benchmarks/results/decode.{md,json} with the CPU model, SIMD flags, threads and which
sparkserve kernels ran (results_io.sparkserve_kernels) in the header. The first run builds
llama.cpp (~5 min on 2 cores). --isa avx2 holds every engine to AVX2 (results_io.ISA_ENV, a llama.cpp
built without AVX-512/VNNI) and writes decode_avx2.{md,json}: an AVX2-only machine's ratios; --isa
avx512 the same for AVX-512 without VNNI (decode_avx512.*). --gguf-type T runs every engine on the
model re-quantized to T by llama.cpp's llama-quantize (peers/llamacpp.py `quantized`): the types
people download (Q4_0, Q4_K_M, Q6_K, ..), which sparkserve holds as Q4_1 / Q8_0 for its int8
kernels (loader/gguf_int8.py); writes decode_<type>.{md,json}. --model runs another GGUF instead of
the embedded model (random_gguf.py writes one of a chosen width), without the DSpark row (the
shipped draft is the embedded model's) and into decode_<model file>.{md,json}."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import torch
from results_io import (
    ISA_ENV,
    cap_isa,
    isa_build,
    machine_info,
    machine_line,
    peer_env,
    results_name,
    sparkserve_kernels,
    write_results,
)

PROMPT = "Write a short story about a robot who learns to paint."
LLAMA = "llama.cpp"
DSPARK = "sparkserve + DSpark"


def gguf_tensor_types(path: str) -> dict[str, int]:
    """How many tensors of each GGUF type the file holds, most common first."""
    from collections import Counter

    import gguf
    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors).most_common())


def random_prompt(n: int, seed: int) -> list[int]:
    """n ordinary token ids (no special tokens), different from the first token on for each seed."""
    rng = random.Random(seed)
    return [1000 + (seed * 7919) % 30000] + [rng.randrange(1000, 40000) for _ in range(n - 1)]


class Sparkserve:
    """The engine as `sparkserve serve` runs it; with `dspark`, DSpark speculative decoding with the
    shipped draft and adaptive verify (timed at batch 1 only: the issue's goal for it)."""

    def __init__(self, model: str, dspark: bool = False):
        from sparkserve import Engine
        spec = {"speculative_algorithm": "DSPARK", "speculative_dspark_verify_mode": "adaptive"}
        self.name = DSPARK if dspark else "sparkserve"
        self.engine = Engine(model, max_total_tokens=32 * 512, activation_quant="int8",
                             **(spec if dspark else {}))
        self.tok = self.engine.tokenizer

    def prompts(self, n: int) -> list[list[int]]:
        return [self.tok.encode(self.tok.apply_chat_template(
            [{"role": "user", "content": f"{PROMPT} Story number {i}."}]), add_special_tokens=True)
            for i in range(n)]

    def run(self, prompts: list[list[int]], new: int) -> float:
        """Seconds of one greedy generate call."""
        t = time.perf_counter()
        self.engine.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": new, "ignore_eos": True})
        return time.perf_counter() - t


class Transformers:
    """transformers in a process of its own, started with the peers' environment (results_io.
    peer_env): in this one its OpenMP threads would wait passively, as sparkserve's import asks."""
    name = "transformers"

    def __init__(self, model: str, threads: int):
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "transformers_worker.py")
        self.proc = subprocess.Popen([sys.executable, worker, model, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=peer_env())
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the transformers worker did not start (exit {self.proc.wait()})")

    def run(self, prompts: list[list[int]], new: int) -> float:
        self.proc.stdin.write(json.dumps([prompts, new]) + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())


class LlamaBench:
    """llama.cpp's own benchmark tool on the same GGUF: tg (`-p 0 -n N`) and pp (`-p P -n 0`)."""
    name = LLAMA

    def __init__(self, model: str, threads: int, isa: str):
        from peers.llamacpp import describe, tool
        self.bin = str(tool("llama-bench", isa))
        self.info = {"llama-bench": describe(tool("llama-bench", isa), isa)}
        self.model = model
        self.threads = threads

    def tok_s(self, prompt: int, gen: int) -> float:
        """One llama-bench rep (after its warm-up): tokens/s of pp<prompt> or tg<gen>."""
        cmd = [self.bin, "-m", self.model, "-t", str(self.threads), "-p", str(prompt), "-n", str(gen),
               "-r", "1", "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=peer_env())
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        rows = json.loads(r.stdout)
        return float(rows[0]["avg_ts"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true", help="no transformers column")
    ap.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp column (no build)")
    ap.add_argument("--skip-dspark", action="store_true", help="no DSpark row")
    ap.add_argument("--isa", default="native", choices=sorted(ISA_ENV),
                    help="what every engine may use of the CPU (avx2: an AVX2-only machine; avx512: no VNNI)")
    ap.add_argument("--model", help="a GGUF file instead of the embedded model")
    ap.add_argument("--gguf-type", help="the model re-quantized to this llama-quantize type (Q4_K_M, ...)")
    a = ap.parse_args()
    cap_isa(a.isa)
    torch.set_num_threads(a.threads)
    n_new, n_pp, batch = a.new_tokens, a.prompt_tokens, a.batch
    from sparkserve.embedded import default_model_path
    model = a.model or default_model_path()
    if a.gguf_type:
        from peers.llamacpp import quantized
        model = str(quantized(model, a.gguf_type, a.isa))
    llama = None if a.skip_llamacpp else LlamaBench(model, a.threads, a.isa)   # built first: needs the cores
    ours = Sparkserve(model)
    engines = [ours] + ([] if a.skip_transformers else [Transformers(model, a.threads)])
    spec = [] if a.skip_dspark or a.model else [Sparkserve(model, dspark=True)]
    p1, pb = ours.prompts(1), ours.prompts(batch)
    seed = iter(range(1, 1 << 30))
    for e in engines + spec:               # warm-up
        e.run(p1, 4)
        e.run([random_prompt(n_pp, next(seed))], 1)
    names = [e.name for e in engines + spec] + ([LLAMA] if llama else [])
    b1 = {n: [] for n in names}
    pp = {n: [] for n in names}
    ttft = {e.name: [] for e in engines}
    bb = {e.name: [] for e in engines}

    def decode(e):
        t1 = e.run(p1, 1)
        tn = e.run(p1, n_new)
        b1[e.name].append((n_new - 1) / (tn - t1))

    def prefill(e):
        prompt = [random_prompt(n_pp, next(seed))]
        t = e.run(prompt, 1)
        ttft[e.name].append(t)
        pp[e.name].append(n_pp / t)

    def batched(e):
        bb[e.name].append(batch * n_new / e.run(pb, n_new))

    for rep in range(a.reps):
        steps = []
        for fn, llama_fn in ((decode, lambda: b1[LLAMA].append(llama.tok_s(0, n_new))),
                             (prefill, lambda: pp[LLAMA].append(llama.tok_s(n_pp, 0))),
                             (batched, None)):
            group = [(e.name, lambda e=e, fn=fn: fn(e)) for e in engines + (spec if fn is decode else [])]
            if llama and llama_fn:
                group.append((LLAMA, llama_fn))
            steps += group if rep % 2 == 0 else group[::-1]
        for name, step in steps:
            step()
        print(f"round {rep + 1}/{a.reps}: " + ", ".join(
            f"{n} b1 {b1[n][-1]:.1f}" + (f" pp {pp[n][-1]:.0f}" if pp[n] else "") for n in names),
            file=sys.stderr, flush=True)

    med = lambda d: {k: statistics.median(v) for k, v in d.items() if v}   # noqa: E731
    m1, mpp, mttft, mb = med(b1), med(pp), med(ttft), med(bb)
    ratio = lambda m, peer, ours="sparkserve": m[ours] / m[peer] if peer in m and ours in m else None  # noqa: E731
    machine = machine_info(a.isa)
    kernels = sparkserve_kernels()
    res = {"threads": a.threads, "new_tokens": n_new, "prompt_tokens": n_pp, "batch": batch, "reps": a.reps,
           "machine": machine, "sparkserve_kernels": kernels,
           "llamacpp_build": {k: v for k, v in (llama.info if llama else {}).items() if k != "cpu_flags"},
           "batch1_decode_tok_s": b1, f"prefill{n_pp}_tok_s": pp, f"prefill{n_pp}_ttft_s": ttft,
           f"batch{batch}_tok_s": bb,
           "ratio_batch1_vs_llamacpp": ratio(m1, LLAMA),
           f"ratio_prefill{n_pp}_vs_llamacpp": ratio(mpp, LLAMA),
           "ratio_batch1": ratio(m1, "transformers"), f"ratio_batch{batch}": ratio(mb, "transformers"),
           "ratio_dspark_batch1_vs_llamacpp": ratio(m1, LLAMA, DSPARK),
           "ratio_dspark_batch1_vs_plain": ratio(m1, "sparkserve", DSPARK),
           "model": os.path.basename(model), "gguf_tensor_types": gguf_tensor_types(model),
           "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__}
    lb = res["llamacpp_build"]
    types = ", ".join(f"{t} x {n}" for t, n in res["gguf_tensor_types"].items())
    title = os.path.basename(a.model) if a.model else f"SmolLM2-135M-Instruct {a.gguf_type or 'Q4_1'}"
    lines = [f"# Decode and prefill speed, {title}, {a.threads} threads ({res['date']})", "",
             f"{machine_line(machine)}; sparkserve kernels: {kernels}; torch {torch.__version__}",
             f"model: {res['model']} (tensors: {types})",
             *([f"llama.cpp {lb.get('llama_cpp_commit')} (llama-cpp-python {lb.get('llama_cpp_python')} "
                f"sdist), built from source with {isa_build(a.isa)}, {lb.get('compiler', '?')}"]
               if llama else []),
             "", f"| engine | batch-1 decode tok/s | prefill-{n_pp} tok/s (TTFT ms) | "
             f"batch-{batch} output tok/s |", "|---|---|---|---|"]
    for n in names:
        label = {LLAMA: f"{LLAMA} (llama-bench tg{n_new} / pp{n_pp})",
                 DSPARK: f"{DSPARK} (shipped draft, adaptive verify)"}.get(n, n)
        t = f" ({1000 * mttft[n]:.0f})" if n in mttft else ""
        lines.append(f"| {label} | {m1[n]:.1f} | {f'{mpp[n]:.0f}' if n in mpp else '-'}{t} | "
                     f"{f'{mb[n]:.1f}' if n in mb else '-'} |")
    lines.append("")
    if llama:
        lines.append(f"sparkserve / llama.cpp: **{res['ratio_batch1_vs_llamacpp']:.2f}x** batch-1 decode, "
                     f"**{res[f'ratio_prefill{n_pp}_vs_llamacpp']:.2f}x** prefill-{n_pp}.")
    if DSPARK in m1:
        vs_llama = (f"**{res['ratio_dspark_batch1_vs_llamacpp']:.2f}x** llama.cpp's batch-1 decode, "
                    if llama else "")
        lines.append(f"sparkserve + DSpark (adaptive): {vs_llama}"
                     f"{res['ratio_dspark_batch1_vs_plain']:.2f}x sparkserve's plain decoding.")
    if "transformers" in m1:
        lines.append(f"sparkserve / transformers: **{res['ratio_batch1']:.2f}x** at batch 1, "
                     f"**{res[f'ratio_batch{batch}']:.2f}x** at batch {batch}.")
    lines += ["", f"Medians of {a.reps} rounds, engines alternating. {n_new} new tokens per request, greedy, "
              "EOS ignored. sparkserve and llama.cpp run the same GGUF; transformers runs fp32 weights "
              f"dequantized from it. Prefill-{n_pp}: sparkserve/transformers time a {n_pp}-token random "
              "prompt with max_new_tokens=1 (TTFT, includes one sampled token); llama.cpp is llama-bench "
              f"pp{n_pp}. Batch-1 decode = (N-1)/(t(N)-t(1)); llama.cpp is llama-bench tg{n_new}. "
              "On a shared machine, trust the ratios more than the absolute numbers."]
    model_part = f"_{os.path.basename(a.model).removesuffix('.gguf')}" if a.model else ""
    name = results_name("decode", a.isa) + model_part + (f"_{a.gguf_type.lower()}" if a.gguf_type else "")
    write_results(name, res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
