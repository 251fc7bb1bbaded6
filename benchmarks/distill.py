"""Distillation throughput on the embedded SmolLM2-135M-Instruct: the target answering ShareGPT
training prompts greedily with hidden-state capture, as `train-draft`'s distill stage does, one
batch at a time (every batch waits for its longest answer) against Engine.generate_many (the
same number of requests in flight, each finished one replaced at once). Same prompts, same
answers; response tokens/s, medians of --reps interleaved runs.

    python benchmarks/distill.py [--prompts 96] [--batch 32] [--new-tokens 128] [--reps 2]

Writes benchmarks/results/distill.{md,json}."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_io import write_results


def batch_at_a_time(engine, ids, params, batch) -> list[list[int]]:
    out = []
    for i in range(0, len(ids), batch):
        out += [r["output_ids"] for r in engine.generate(input_ids=ids[i:i + batch], sampling_params=params,
                                                         return_hidden_states=True)]
    return out


def in_flight(engine, ids, params, batch) -> list[list[int]]:
    return [r["output_ids"] for r in engine.generate_many(ids, params, max_in_flight=batch,
                                                          return_hidden_states=True)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from sparkserve import Engine
    from sparkserve.training.prompts import split_sharegpt
    engine = Engine(max_total_tokens=a.batch * (a.new_tokens + 1024), enable_return_hidden_states=True,
                    disable_radix_cache=True)
    engine.scheduler.runner.model.set_aux_layers([1, 15, 28])     # the shipped draft's taps
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=True) for m in split_sharegpt()[0]]
    ids = [p for p in ids if len(p) <= 1024][:a.prompts]
    params = {"temperature": 0, "max_new_tokens": a.new_tokens}
    ways = {"one batch at a time": batch_at_a_time, "generate_many": in_flight}
    speed, answers = {w: [] for w in ways}, {}
    for _ in range(a.reps):                                      # interleaved: noise hits both alike
        for name, fn in ways.items():
            t = time.perf_counter()
            answers[name] = fn(engine, ids, params, a.batch)
            speed[name].append(sum(map(len, answers[name])) / (time.perf_counter() - t))
    if answers["one batch at a time"] != answers["generate_many"]:
        raise SystemExit("the two ways gave different answers")
    med = {w: statistics.median(v) for w, v in speed.items()}
    n_tok = sum(map(len, answers["generate_many"]))
    lines = [f"# Distillation throughput, SmolLM2-135M-Instruct, {a.threads} threads "
             f"({time.strftime('%Y-%m-%d %H:%M')})",
             "", f"{len(ids)} ShareGPT training prompts, greedy, up to {a.new_tokens} new tokens "
             f"({n_tok} response tokens), hidden states of taps [1, 15, 28] returned; {a.batch} requests "
             f"per batch / in flight; median of {a.reps}.", "",
             "| way | response tok/s |", "|---|---|"]
    lines += [f"| {w} | {v:.1f} |" for w, v in med.items()]
    lines += ["", f"generate_many / one batch at a time: "
              f"**{med['generate_many'] / med['one batch at a time']:.2f}x**"]
    write_results("distill", {"args": vars(a), "tok_s": speed, "response_tokens": n_tok}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
