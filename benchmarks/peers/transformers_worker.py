"""HF transformers as a benchmark peer, in a process of its own that never imports sparkserve (whose
import would make torch's OpenMP threads wait passively: results_io.peer_env).

    python transformers_worker.py GGUF_PATH THREADS

Loads the GGUF's weights as fp32, prints `ready`, then for each JSON line [prompts, new_tokens] on
stdin runs one greedy `generate` (left-padded batch, EOS ignored) and prints its seconds."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    print("ready", flush=True)
    for line in sys.stdin:
        prompts, new = json.loads(line)
        width = max(map(len, prompts))
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])   # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=2)
        print(json.dumps(time.perf_counter() - t), flush=True)


if __name__ == "__main__":
    main()
