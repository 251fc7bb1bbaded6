"""Batch-1 decode tok/s of a random-weight Gemma 3 GGUF (Q8_0, the embedded SmolLM2's tokenizer)
with the native forward step (models/llama_native.py) on and off, in one engine, alternating: what
running Gemma 3's sandwich norms, GeGLU and local rope in the C++ step buys over the Python layer
path. Shapes: Gemma 3 270M's (hidden 640) and 1B's (hidden 1152), head_dim 256, one KV head, a
512-token window on 5 of every 6 layers.

    python benchmarks/native_gemma3.py [--reps 5] [--new-tokens 64] [--threads 2] [--shapes 270m,1b]

decode tok/s = (N - 1) / (t(N tokens) - t(1 token)) on one prompt, greedy, --activation-quant int8;
medians of --reps rounds (on and off alternate, order flipped every round, so machine noise hits
both alike), and the median of the rounds' on/off ratios (each round's pair ran back to back: the
figure that survives other processes' load best). Writes benchmarks/results/native_gemma3.{md,json}."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

# isort: split
import gguf
import numpy as np
import torch
from random_gguf import embedded_tokenizer
from results_io import machine_info, machine_line, sparkserve_kernels, write_results

# name -> (hidden, intermediate, layers, heads, kv heads); head_dim 256 throughout
SHAPES = {"270m": (640, 2048, 18, 4, 1), "1b": (1152, 6912, 26, 4, 1)}
HEAD_DIM, WINDOW, PATTERN = 256, 512, 6


def write_random_gemma3(out: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                        seed: int = 0) -> None:
    """A Gemma 3 GGUF as convert_hf_to_gguf.py writes one (norms stored as 1 + w), Q8_0 matrices."""
    w = gguf.GGUFWriter(out, "gemma3")
    vocab = embedded_tokenizer(w)
    w.add_name(f"random-gemma3-{hidden}x{layers}")
    w.add_context_length(8192), w.add_embedding_length(hidden), w.add_feed_forward_length(intermediate)
    w.add_block_count(layers), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_key_length(HEAD_DIM), w.add_value_length(HEAD_DIM), w.add_sliding_window(WINDOW)
    w.add_rope_freq_base(1e6), w.add_layer_norm_rms_eps(1e-6), w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add_mat(name: str, n: int, k: int) -> None:
        m = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        w.add_tensor(name, gguf.quants.quantize(m, q8), raw_shape=(n, k // 32 * 34), raw_dtype=q8)

    def add_norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    add_mat("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add_norm(p + norm + ".weight", hidden)
        add_norm(p + "attn_q_norm.weight", HEAD_DIM), add_norm(p + "attn_k_norm.weight", HEAD_DIM)
        add_mat(p + "attn_q.weight", heads * HEAD_DIM, hidden)
        add_mat(p + "attn_k.weight", kv_heads * HEAD_DIM, hidden)
        add_mat(p + "attn_v.weight", kv_heads * HEAD_DIM, hidden)
        add_mat(p + "attn_output.weight", hidden, heads * HEAD_DIM)
        add_mat(p + "ffn_gate.weight", intermediate, hidden)
        add_mat(p + "ffn_up.weight", intermediate, hidden)
        add_mat(p + "ffn_down.weight", hidden, intermediate)
    add_norm("output_norm.weight", hidden)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def decode_rates(path: str, reps: int, new: int) -> dict[str, list[float]]:
    """Per native on / off: batch-1 decode tok/s of each round."""
    from sparkserve import Engine
    engine = Engine(path, max_total_tokens=4096, activation_quant="int8")
    model = engine.scheduler.runner.model
    prompt = [engine.tokenizer.encode("Write a short story about a robot who learns to paint.")]

    def seconds(n: int) -> float:
        t = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n,
                                                           "ignore_eos": True})
        return time.perf_counter() - t

    rates: dict[str, list[float]] = {"native": [], "python": []}
    for on in (True, False):                     # warm-up: builds the step, first-touch of the pool
        model.enable_native_step(on)
        seconds(4)
    for r in range(reps):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            model.enable_native_step(on)
            t1, tn = seconds(1), seconds(new)
            rates["native" if on else "python"].append((new - 1) / (tn - t1))
    assert model.native._step is not None, "the native step did not build for Gemma 3"
    engine.shutdown()
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows, data = [], {"machine": machine_info(), "threads": a.threads, "new_tokens": a.new_tokens,
                      "reps": a.reps, "kernels": sparkserve_kernels(), "shapes": {},
                      "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.shapes.split(","):
            path = os.path.join(tmp, f"gemma3-{name}.gguf")
            write_random_gemma3(path, *SHAPES[name])
            rates = decode_rates(path, a.reps, a.new_tokens)
            on, off = statistics.median(rates["native"]), statistics.median(rates["python"])
            ratio = statistics.median(n / p for n, p in zip(rates["native"], rates["python"]))
            data["shapes"][name] = {"shape": SHAPES[name], "rates": rates, "native": on, "python": off,
                                    "ratio": ratio}
            rounds = " ".join(f"{n / p:.2f}" for n, p in zip(rates["native"], rates["python"]))
            rows.append(f"| {name} {SHAPES[name]} | {on:.1f} | {off:.1f} | {ratio:.2f}x | {rounds} |")
            print(rows[-1], flush=True)
    lines = ["# Gemma 3 batch-1 decode: native step on vs off", "",
             f"{machine_line(data['machine'])}; {a.threads} threads; kernels: {data['kernels']}", "",
             f"Random-weight Gemma 3 GGUFs (Q8_0, int8 activations), batch-1 greedy decode of {a.new_tokens} "
             f"tokens, median tok/s of {a.reps} alternating rounds. Shape: (hidden, intermediate, layers, "
             "heads, kv heads), head_dim 256.", "",
             "| shape | native step tok/s | Python layers tok/s | median ratio | each round's ratio |",
             "|---|---|---|---|---|", *rows]
    write_results("native_gemma3", data, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
