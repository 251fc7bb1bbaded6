"""Target feature cache for draft training: for every token of every distilled sequence, the
tapped hidden states (aux capture) and the final normed hidden state, in fp16 memory-mapped
files, so training never reruns the target.

Layout in DIR: tokens.npy (int32 [N]), taps.npy (fp16 [N, n_taps * d]), final.npy (fp16 [N, d]),
index.json ({"offsets", "lengths", "prompt_lens", "target_layer_ids"})."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from sparkserve.executor.forward_batch import ForwardBatch, ForwardMode


@torch.inference_mode()
def capture(model, seqs: list[list[int]], layer_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the target once over each sequence (one EXTEND batch); returns per sequence
    (taps [L, n_taps*d], final normed hidden [L, d])."""
    model.set_aux_layers(layer_ids)
    total = sum(map(len, seqs))
    pool = model.make_pool(total, len(seqs))
    lens = [len(s) for s in seqs]
    slots = torch.arange(1, total + 1)
    starts = np.cumsum([0] + lens[:-1])
    kv_indices = torch.zeros(len(seqs), max(lens), dtype=torch.long)
    for i, (st, n) in enumerate(zip(starts, lens)):
        kv_indices[i, :n] = slots[st:st + n]
    fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor([t for s in seqs for t in s]),
                      torch.cat([torch.arange(n) for n in lens]), slots, lens, lens, kv_indices, pool,
                      req_rows=torch.arange(len(seqs)))
    final = model(fb.input_ids, fb.positions, fb)
    taps = torch.cat(fb.aux_hidden, dim=-1)
    return [(taps[st:st + n], final[st:st + n]) for st, n in zip(starts, lens)]


@torch.inference_mode()
def logsumexp_rows(head_weight: torch.Tensor, hidden: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """log sum exp of the target's full-vocab logits per row: with it, training scores the
    teacher on a reduced draft vocab without the full LM head at every step."""
    return torch.cat([torch.logsumexp(hidden[i:i + chunk].float() @ head_weight.T.float(), -1)
                      for i in range(0, hidden.shape[0], chunk)])


def write_lse(path: str, head_weight: torch.Tensor, chunk_tokens: int = 8192) -> None:
    """Add lse.npy (teacher log-normaliser per token, computed from final.npy) to a cache.
    Only response rows are computed (training reads the teacher at positions >= the prompt
    length; prompts are ~half the tokens of chat data and the full-vocab head dominates the
    cost); prompt rows hold NaN so that a reader of them fails loudly."""
    final = np.load(os.path.join(path, "final.npy"), mmap_mode="r")
    with open(os.path.join(path, "index.json")) as f:
        idx = json.load(f)
    rows = np.concatenate([np.arange(o + p, o + n) for o, n, p in
                           zip(idx["offsets"], idx["lengths"], idx["prompt_lens"])] + [np.empty(0, np.int64)])
    tmp = os.path.join(path, "lse.tmp.npy")
    lse = np.lib.format.open_memmap(tmp, "w+", np.float32, (final.shape[0],))
    lse[:] = np.nan
    for i in tqdm(range(0, len(rows), chunk_tokens), desc="teacher lse", unit="chunk"):
        r = rows[i:i + chunk_tokens]
        hidden = torch.from_numpy(np.asarray(final[r], dtype=np.float32))
        lse[r] = logsumexp_rows(head_weight, hidden).numpy()
    lse.flush()
    del lse
    os.replace(tmp, os.path.join(path, "lse.npy"))


def build_feature_cache(model, seqs: list[list[int]], prompt_lens: list[int], layer_ids: list[int],
                        out_dir: str, batch_tokens: int = 2048) -> None:
    os.makedirs(out_dir, exist_ok=True)
    lens = [len(s) for s in seqs]
    N, d = sum(lens), model.config.hidden_size
    tokens = np.lib.format.open_memmap(os.path.join(out_dir, "tokens.npy"), "w+", np.int32, (N,))
    taps = np.lib.format.open_memmap(os.path.join(out_dir, "taps.npy"), "w+", np.float16, (N, len(layer_ids) * d))
    final = np.lib.format.open_memmap(os.path.join(out_dir, "final.npy"), "w+", np.float16, (N, d))
    offsets = np.cumsum([0] + lens[:-1]).tolist()
    i = 0
    with tqdm(total=len(seqs), desc="feature cache", unit="seq") as bar:
        while i < len(seqs):
            j, used = i, 0
            while j < len(seqs) and (j == i or used + lens[j] <= batch_tokens):
                used += lens[j]
                j += 1
            for k, (t, f) in zip(range(i, j), capture(model, seqs[i:j], layer_ids)):
                o = offsets[k]
                tokens[o:o + lens[k]] = seqs[k]
                taps[o:o + lens[k]] = t.half().numpy()
                final[o:o + lens[k]] = f.half().numpy()
            bar.update(j - i)
            i = j
    for a in (tokens, taps, final):
        a.flush()
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump({"offsets": offsets, "lengths": lens, "prompt_lens": list(prompt_lens),
                   "target_layer_ids": list(layer_ids), "hidden_size": d}, f)


@dataclass
class FeatureCache:
    tokens: np.ndarray
    taps: np.ndarray
    final: np.ndarray
    offsets: list[int]
    lengths: list[int]
    prompt_lens: list[int]
    target_layer_ids: list[int]
    lse: np.ndarray | None = None     # teacher log-normaliser per token (write_lse), if present

    @classmethod
    def open(cls, path: str) -> "FeatureCache":
        with open(os.path.join(path, "index.json")) as f:
            idx = json.load(f)
        load = lambda n: np.load(os.path.join(path, n), mmap_mode="r")
        lse = load("lse.npy") if os.path.exists(os.path.join(path, "lse.npy")) else None
        return cls(load("tokens.npy"), load("taps.npy"), load("final.npy"), idx["offsets"],
                   idx["lengths"], idx["prompt_lens"], idx["target_layer_ids"], lse)

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        o, n = self.offsets[i], self.lengths[i]
        return (torch.from_numpy(np.asarray(self.tokens[o:o + n], dtype=np.int64)),
                torch.from_numpy(np.asarray(self.taps[o:o + n], dtype=np.float32)),
                torch.from_numpy(np.asarray(self.final[o:o + n], dtype=np.float32)),
                self.prompt_lens[i])

    def sequence_lse(self, i: int) -> torch.Tensor:
        o, n = self.offsets[i], self.lengths[i]
        return torch.from_numpy(np.array(self.lse[o:o + n], dtype=np.float32))

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each id occurs in the responses: the training targets' frequencies."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for o, n, p in zip(self.offsets, self.lengths, self.prompt_lens):
            counts += np.bincount(np.asarray(self.tokens[o + p:o + n]), minlength=vocab_size)[:vocab_size]
        return torch.from_numpy(counts)
