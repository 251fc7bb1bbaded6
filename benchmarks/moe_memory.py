"""What a quantized MoE GGUF costs in memory, and its batch-1 decode speed, with its experts held as
the file's blocks (served with int8 activations, the default) or as fp32 (--activation-quant none):
a random Qwen3-MoE-shaped model (Q4_0 or Q8_0, written here with gguf-py), each mode loaded in a
fresh process, resident memory (RSS) after load and after a few decode steps. The fp32 column is
what every MoE cost before experts stayed quantized; bytes per expert weight tell how a real one
(Qwen3-30B-A3B: 48 layers x 128 experts x 3 x 2048 x 768) would fit.

    python benchmarks/moe_memory.py [--layers 8] [--experts 32] [--hidden 1024] [--moe-intermediate 512]
                                    [--qtype Q4_0|Q8_0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_gguf import embedded_tokenizer
from results_io import machine_line, write_results  # noqa: E402

QWEN3_30B_EXPERT_WEIGHTS = 48 * 128 * 3 * 2048 * 768


def write_random_moe(out: str, layers: int, experts: int, hidden: int, inter: int, qtype: str) -> int:
    """A Qwen3-MoE-shaped GGUF (top-4 of `experts`, q/k norm); returns its expert weight count."""
    q = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(out, "qwen3moe")
    vocab = embedded_tokenizer(w)
    heads, kv, head_dim = hidden // 64, max(1, hidden // 256), 64
    w.add_context_length(4096), w.add_embedding_length(hidden), w.add_feed_forward_length(inter)
    w.add_block_count(layers), w.add_head_count(heads), w.add_head_count_kv(kv), w.add_key_length(head_dim)
    w.add_value_length(head_dim), w.add_rope_freq_base(1e6), w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts), w.add_expert_used_count(4), w.add_expert_feed_forward_length(inter)
    rng = np.random.default_rng(0)

    def mat(*shape: int) -> np.ndarray:
        return gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32) * 0.02, q)

    def add(name: str, *shape: int) -> None:
        w.add_tensor(name, mat(*shape), raw_dtype=q)

    ones = np.ones(hidden, dtype=np.float32)
    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones), w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, np.float32))
        add(p + "attn_q.weight", heads * head_dim, hidden)
        add(p + "attn_k.weight", kv * head_dim, hidden)
        add(p + "attn_v.weight", kv * head_dim, hidden)
        add(p + "attn_output.weight", hidden, heads * head_dim)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((experts, hidden), dtype=np.float32))
        add(p + "ffn_gate_exps.weight", experts, inter, hidden)
        add(p + "ffn_up_exps.weight", experts, inter, hidden)
        add(p + "ffn_down_exps.weight", experts, hidden, inter)
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", vocab, hidden)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return layers * experts * 3 * hidden * inter


PROBE = r"""
import json, sys, time
from sparkserve import Engine
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
eng = Engine(sys.argv[1], activation_quant=sys.argv[2], max_total_tokens=512, num_threads=2)
loaded = rss()
sp = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
eng.generate(input_ids=list(range(10, 26)), sampling_params=sp)
t = time.perf_counter()
eng.generate(input_ids=list(range(30, 46)), sampling_params=sp)
took = time.perf_counter() - t
print(json.dumps({"loaded": loaded, "after": rss(), "tok_s": 32 / took}))
"""


def probe(path: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, path, mode], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q8_0"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "moe.gguf")
        n = write_random_moe(path, a.layers, a.experts, a.hidden, a.moe_intermediate, a.qtype)
        size = os.path.getsize(path)
        rows = {mode: probe(path, mode) for mode in ("int8", "none")}
    gib = 2 ** 30
    lines = [f"# Quantized MoE experts: memory and decode ({a.qtype})", "", machine_line(), "",
             f"Random Qwen3-MoE shape: {a.layers} layers x {a.experts} experts (top-4), hidden {a.hidden}, "
             f"expert width {a.moe_intermediate}: {n / 1e6:.0f}M expert weights; file {size / gib:.2f} GiB.",
             "",
             "| experts held as | RSS after load | RSS after decode | decode tok/s (batch 1) |",
             "|---|---|---|---|"]
    labels = {"int8": "the file's blocks (--activation-quant int8)", "none": "fp32 (--activation-quant none)"}
    for mode, label in labels.items():
        r = rows[mode]
        lines.append(f"| {label} | {r['loaded'] / gib:.2f} GiB | {r['after'] / gib:.2f} GiB | "
                     f"{r['tok_s']:.1f} |")
    saved = (rows["none"]["after"] - rows["int8"]["after"]) / n
    block, nbytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, a.qtype)]
    big = QWEN3_30B_EXPERT_WEIGHTS
    lines += ["", f"The fp32 run (every weight fp32) holds {saved:.2f} more bytes per expert weight; at that "
              f"rate Qwen3-30B-A3B's {big / 1e9:.1f}B expert weights take {big * saved / gib:.0f} GiB more "
              f"in fp32 than as {a.qtype} blocks ({big * nbytes / block / gib:.1f} GiB)."]
    write_results(f"moe_memory_{a.qtype.lower()}", {"args": vars(a), "expert_weights": n, "file_bytes": size,
                                                   "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
