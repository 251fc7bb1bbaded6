"""sparkserve on a CUDA GPU (--device cuda: torch's kernels, fp32) against transformers' `generate`
on the same GPU, same weights, in one run: greedy decode throughput at batch 1 and batch B.

The model has SmolLM2-135M's shape with random weights, made here (no download; random weights
cost what trained ones do). Both sides run fp32 and ignore EOS, so both produce exactly
`--new-tokens` per request. Writes results/cuda.{md,json}.

    python benchmarks/cuda.py [--batch 64] [--new-tokens 128] [--prompt-len 64] [--rounds 3]"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
from results_io import write_results

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), dtype=torch.float32).save_pretrained(path)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SMOLLM2_135M["vocab_size"], (n, length), generator=g).tolist()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def sparkserve_runs(path: str, batches: list[int], args) -> dict[int, list[float]]:
    from sparkserve import Engine
    eng = Engine(path, device="cuda", max_running_requests=max(batches),
                 max_total_tokens=max(batches) * (args.prompt_len + args.new_tokens + 8),
                 disable_radix_cache=True, chunked_prefill_size=8192)
    sp = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    eng.generate(input_ids=prompts(2, args.prompt_len), sampling_params=sp)          # warm-up
    out = {}
    for b in batches:
        ps = prompts(b, args.prompt_len)
        out[b] = [b * args.new_tokens / timed(lambda: eng.generate(input_ids=ps, sampling_params=sp))
                  for _ in range(args.rounds)]
    eng.shutdown()
    return out


def transformers_runs(path: str, batches: list[int], args) -> dict[int, list[float]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    out = {}
    for b in batches:
        ids = torch.tensor(prompts(b, args.prompt_len), device="cuda")

        def gen():
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
        gen()                                                                         # warm-up
        out[b] = [b * args.new_tokens / timed(gen) for _ in range(args.rounds)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/cuda.py needs a CUDA GPU")
    batches = [1, args.batch]
    with tempfile.TemporaryDirectory() as d:
        make_model(d)
        ours = sparkserve_runs(d, batches, args)
        peer = transformers_runs(d, batches, args)
    gpu = torch.cuda.get_device_name()
    lines = [f"# sparkserve --device cuda vs transformers generate ({gpu})", "",
             f"GPU: {gpu}; torch {torch.__version__}; SmolLM2-135M shape, random weights, fp32 on both "
             f"sides; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request, greedy, EOS "
             f"ignored; median of {args.rounds} rounds (output tokens/s over the whole generate call, "
             "prefill included).",
             "", "| batch | sparkserve tok/s | transformers tok/s | ratio |", "|---|---|---|---|"]
    for b in batches:
        a, p = statistics.median(ours[b]), statistics.median(peer[b])
        lines.append(f"| {b} | {a:.0f} | {p:.0f} | {a / p:.2f}x |")
    write_results("cuda", {"gpu": gpu, "torch": torch.__version__, "args": vars(args),
                           "sparkserve": ours, "transformers": peer}, lines)


if __name__ == "__main__":
    main()
