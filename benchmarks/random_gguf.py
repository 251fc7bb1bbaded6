"""A random-weight Llama GGUF of a chosen shape, with the embedded SmolLM2's tokenizer, for speed
runs at widths the embedded model does not have: llama.cpp's K-quants need rows a multiple of 256
wide (SmolLM2's 576 are not, so its "Q4_K_M" is mostly the Q5_0 fallback), and real checkpoints
cannot be downloaded here. F16 weights (as convert_hf_to_gguf.py writes them); `decode.py --model
PATH --gguf-type Q4_K_M` then quantizes it with llama.cpp's own tool and runs both engines on it.

    python benchmarks/random_gguf.py OUT.gguf [--hidden 1024] [--intermediate 3072] [--layers 28]
                                              [--heads 16] [--kv-heads 8]

The default shape is Qwen3-0.6B's (as a plain Llama: no q/k norm), about 0.45B parameters."""
from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np


def embedded_tokenizer(w: gguf.GGUFWriter) -> int:
    """Copy the embedded SmolLM2's tokenizer and chat template into `w`; returns its vocab size."""
    from sparkserve.embedded import default_model_path
    src = gguf.GGUFReader(default_model_path())
    for field in src.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(field.name, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    return len(src.fields["tokenizer.ggml.tokens"].contents())


def write_random_llama(out: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                       seed: int = 0) -> None:
    w = gguf.GGUFWriter(out, "llama")
    vocab = embedded_tokenizer(w)
    w.add_name(f"random-llama-{hidden}x{layers}")
    w.add_context_length(8192), w.add_embedding_length(hidden), w.add_feed_forward_length(intermediate)
    w.add_block_count(layers), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def mat(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(hidden, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", mat(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", mat(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", mat(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", mat(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", mat(intermediate, hidden))
        w.add_tensor(p + "ffn_up.weight", mat(intermediate, hidden))
        w.add_tensor(p + "ffn_down.weight", mat(hidden, intermediate))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(vocab, hidden))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    a = ap.parse_args()
    write_random_llama(a.out, a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
