"""Target feature cache for draft training: for every token of every distilled sequence, the
tapped hidden states (aux capture) and the final normed hidden state, in fp16 memory-mapped
files, so training never reruns the target.

Layout in DIR: tokens.npy (int32 [N]), taps.npy (fp16 [N, n_taps * d]), final.npy (fp16 [N, d]),
index.json ({"offsets", "lengths", "prompt_lens", "target_layer_ids"})."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.training.int8_cache import Int8FeatureCache, is_int8_cache


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
def teacher_rows(head_weight: torch.Tensor, hidden: torch.Tensor, chunk: int = 512) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Per row of final hidden states: log sum exp of the target's full-vocab logits (with it,
    training scores the teacher on a reduced draft vocab without the full LM head at every step)
    and the target's greedy next token (the labels of prefill-labelled answers)."""
    lse, greedy = [], []
    for i in range(0, hidden.shape[0], chunk):
        logits = hidden[i:i + chunk].float() @ head_weight.T.float()
        lse.append(torch.logsumexp(logits, -1))
        greedy.append(logits.argmax(-1))
    return torch.cat(lse), torch.cat(greedy)


def write_lse(path: str, head_weight: torch.Tensor, chunk_tokens: int = 8192) -> None:
    """Add lse.npy (teacher log-normaliser per token) and greedy.npy (the target's argmax after
    each token), both computed from final.npy, to a cache. Only response rows are computed
    (training reads the teacher at positions >= the prompt length; prompts are ~half the tokens
    of chat data and the full-vocab head dominates the cost); prompt rows hold NaN / -1 so that
    a reader of them fails loudly."""
    final = np.load(os.path.join(path, "final.npy"), mmap_mode="r")
    with open(os.path.join(path, "index.json")) as f:
        idx = json.load(f)
    rows = np.concatenate([np.arange(o + p, o + n) for o, n, p in
                           zip(idx["offsets"], idx["lengths"], idx["prompt_lens"])] + [np.empty(0, np.int64)])
    tmp = {name: os.path.join(path, f"{name}.tmp.npy") for name in ("lse", "greedy")}
    lse = np.lib.format.open_memmap(tmp["lse"], "w+", np.float32, (final.shape[0],))
    greedy = np.lib.format.open_memmap(tmp["greedy"], "w+", np.int32, (final.shape[0],))
    lse[:] = np.nan
    greedy[:] = -1
    for i in tqdm(range(0, len(rows), chunk_tokens), desc="teacher lse", unit="chunk"):
        r = rows[i:i + chunk_tokens]
        hidden = torch.from_numpy(np.asarray(final[r], dtype=np.float32))
        lse_r, greedy_r = teacher_rows(head_weight, hidden)
        lse[r] = lse_r.numpy()
        greedy[r] = greedy_r.numpy()
    for name, a in (("greedy", greedy), ("lse", lse)):   # lse.npy last: it marks the pass complete
        a.flush()
        del a
        os.replace(tmp[name], os.path.join(path, f"{name}.npy"))


def build_feature_cache(model, seqs: list[list[int]], prompt_lens: list[int], layer_ids: list[int],
                        out_dir: str, batch_tokens: int = 2048) -> None:
    os.makedirs(out_dir, exist_ok=True)
    lens = [len(s) for s in seqs]
    N, d = sum(lens), model.config.hidden_size
    tokens = np.lib.format.open_memmap(os.path.join(out_dir, "tokens.npy"), "w+", np.int32, (N,))
    taps = np.lib.format.open_memmap(os.path.join(out_dir, "taps.npy"), "w+", np.float16,
                                     (N, len(layer_ids) * d))
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
    write_index(out_dir, lens, prompt_lens, layer_ids, d)


class RawFeatureLog:
    """Feature rows captured while distilling (Engine return_hidden_states), appended as raw fp16
    to DIR/taps.bin and DIR/final.bin in distill.jsonl's order, so the feature stage needs no
    second pass of the target. A sequence of L tokens gets L rows: the model never runs its last
    token (sampled, not fed back), whose row is NaN; training never reads it (the last anchor
    is L-2, whose context ends at L-3 and whose teacher rows end at L-2)."""

    def __init__(self, path: str, layer_ids: list[int], hidden_size: int, rows_done: int):
        os.makedirs(path, exist_ok=True)
        meta = {"target_layer_ids": list(layer_ids), "hidden_size": hidden_size}
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f)
        self.files = {}
        for name, width in (("taps.bin", len(layer_ids) * hidden_size), ("final.bin", hidden_size)):
            fp = os.path.join(path, name)
            open(fp, "ab").close()
            os.truncate(fp, rows_done * width * 2)     # drop rows of a batch cut off mid-write
            self.files[name] = open(fp, "ab")

    def append(self, taps: torch.Tensor, final: torch.Tensor) -> int:
        """Rows of one sequence but its last token; returns the rows written (tokens)."""
        nan = torch.full((1,), float("nan"))
        for name, x in (("taps.bin", taps), ("final.bin", final)):
            rows = torch.cat([x.half(), nan.half().expand(1, x.shape[1])])
            self.files[name].write(rows.numpy().tobytes())
        return taps.shape[0] + 1

    def flush(self) -> None:
        for f in self.files.values():
            f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    @staticmethod
    def usable(path: str, layer_ids: list[int], rows: int) -> bool:
        """The log holds `rows` rows of these taps (else: capture by prefill); rows past them
        belong to answers cut off before their distill.jsonl lines were written (a distillation
        stopped mid-batch) and are ignored."""
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
        except OSError:
            return False
        d = meta["hidden_size"]
        return (meta["target_layer_ids"] == list(layer_ids)
                and os.path.getsize(os.path.join(path, "final.bin")) >= rows * d * 2
                and os.path.getsize(os.path.join(path, "taps.bin")) >= rows * len(layer_ids) * d * 2)


def feature_cache_from_log(log_dir: str, seqs: list[list[int]], prompt_lens: list[int],
                           layer_ids: list[int], out_dir: str,
                           prefill_labelled: list[bool] | None = None) -> None:
    """The feature cache of a RawFeatureLog: the same files build_feature_cache writes."""
    with open(os.path.join(log_dir, "meta.json")) as f:
        d = json.load(f)["hidden_size"]
    lens = [len(s) for s in seqs]
    N = sum(lens)
    os.makedirs(out_dir, exist_ok=True)
    tokens = np.lib.format.open_memmap(os.path.join(out_dir, "tokens.npy"), "w+", np.int32, (N,))
    tokens[:] = np.fromiter((t for s in seqs for t in s), np.int32, N)
    for name, width in (("taps", len(layer_ids) * d), ("final", d)):
        src = np.memmap(os.path.join(log_dir, f"{name}.bin"), np.float16, "r", shape=(N, width))
        dst = np.lib.format.open_memmap(os.path.join(out_dir, f"{name}.npy"), "w+", np.float16, (N, width))
        for i in range(0, N, 65536):
            dst[i:i + 65536] = src[i:i + 65536]
        dst.flush()
    tokens.flush()
    write_index(out_dir, lens, prompt_lens, layer_ids, d, prefill_labelled)


def write_index(out_dir: str, lens: list[int], prompt_lens: list[int], layer_ids: list[int], d: int,
                prefill_labelled: list[bool] | None = None) -> None:
    """prefill_labelled: per sequence, whether its answer was not the target's own (a prefill
    over an existing answer): training labels it with the target's greedy choices."""
    idx = {"offsets": np.cumsum([0] + lens[:-1]).tolist(), "lengths": lens, "prompt_lens": list(prompt_lens),
           "target_layer_ids": list(layer_ids), "hidden_size": d}
    if prefill_labelled is not None and any(prefill_labelled):
        idx["prefill_labelled"] = [bool(b) for b in prefill_labelled]
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(idx, f)


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
    greedy: np.ndarray | None = None  # the target's argmax after each token (write_lse), if present
    prefill_labels: list[bool] | None = None   # per sequence: labelled by the target's argmax
    tap_columns: np.ndarray | None = None      # with_taps: the taps.npy columns read (None: all)

    @classmethod
    def open(cls, path: str) -> "FeatureCache | Int8FeatureCache":
        """The cache in path, in whichever layout it was written (fp16, or int8_cache's)."""
        if is_int8_cache(path):
            return Int8FeatureCache.open(path)
        with open(os.path.join(path, "index.json")) as f:
            idx = json.load(f)
        load = lambda n: np.load(os.path.join(path, n), mmap_mode="r")
        lse = load("lse.npy") if os.path.exists(os.path.join(path, "lse.npy")) else None
        has_greedy = lse is not None and os.path.exists(os.path.join(path, "greedy.npy"))
        greedy = load("greedy.npy") if has_greedy else None
        return cls(load("tokens.npy"), load("taps.npy"), load("final.npy"), idx["offsets"],
                   idx["lengths"], idx["prompt_lens"], idx["target_layer_ids"], lse, greedy,
                   idx.get("prefill_labelled"))

    def subset(self, indices: list[int]) -> "FeatureCache":
        """The cache read as if only sequences `indices` (in that order) had been written."""
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]
        return replace(self, offsets=pick(self.offsets), lengths=pick(self.lengths),
                       prompt_lens=pick(self.prompt_lens), prefill_labels=pick(self.prefill_labels))

    def with_taps(self, layer_ids: list[int]) -> "FeatureCache":
        """The cache read as if only `layer_ids` (a subset of its taps, in any order) had been
        captured: one capture with many taps serves drafts that tap fewer layers."""
        missing = [t for t in layer_ids if t not in self.target_layer_ids]
        if missing:
            raise ValueError(f"the feature cache holds taps {self.target_layer_ids}, not {missing}: "
                             f"capture with --target-layer-ids {','.join(map(str, layer_ids))}")
        d = self.final.shape[1]
        cols = np.concatenate([np.arange(d) + self.target_layer_ids.index(t) * d for t in layer_ids])
        if self.tap_columns is not None:
            cols = self.tap_columns[cols]
        return replace(self, target_layer_ids=list(layer_ids), tap_columns=cols)

    def prefill_labelled(self, i: int) -> bool:
        return bool(self.prefill_labels and self.prefill_labels[i])

    def any_prefill_labelled(self) -> bool:
        return bool(self.prefill_labels and any(self.prefill_labels))

    def has_teacher(self) -> bool:
        """Whether a reduced-vocab teacher can be read (lse.npy beside final.npy)."""
        return self.lse is not None

    def sequence_topk(self, i: int) -> None:
        """The teacher comes from final.npy and lse.npy here (int8_cache stores top-k instead)."""
        return None

    def sequence_greedy(self, i: int) -> torch.Tensor:
        o, n = self.offsets[i], self.lengths[i]
        return torch.from_numpy(np.array(self.greedy[o:o + n], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        o, n = self.offsets[i], self.lengths[i]
        return (torch.from_numpy(np.asarray(self.tokens[o:o + n], dtype=np.int64)),
                torch.from_numpy(np.asarray(self._taps(o, n), dtype=np.float32)),
                torch.from_numpy(np.asarray(self.final[o:o + n], dtype=np.float32)),
                self.prompt_lens[i])

    def _taps(self, o: int, n: int) -> np.ndarray:
        rows = self.taps[o:o + n]
        return rows if self.tap_columns is None else rows[:, self.tap_columns]

    def sequence_lse(self, i: int) -> torch.Tensor:
        o, n = self.offsets[i], self.lengths[i]
        return torch.from_numpy(np.array(self.lse[o:o + n], dtype=np.float32))

    def token_ids(self, i: int) -> tuple[np.ndarray, int]:
        """(token ids, prompt length) of sequence i, without its features."""
        o, n = self.offsets[i], self.lengths[i]
        return np.asarray(self.tokens[o:o + n], dtype=np.int64), self.prompt_lens[i]

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each id occurs in the responses: the training targets' frequencies."""
        return response_token_counts(self, vocab_size)

    @staticmethod
    def open_all(paths: list[str]) -> "FeatureCache | ConcatFeatureCache":
        caches = [FeatureCache.open(p) for p in paths]
        return caches[0] if len(caches) == 1 else ConcatFeatureCache(caches)


def response_token_counts(cache, vocab_size: int) -> torch.Tensor:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(cache)):
        toks, p = cache.token_ids(i)
        counts += np.bincount(toks[p:], minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


class ConcatFeatureCache:
    """Several feature caches (e.g. a later distillation run added to an earlier one) read as
    one: sequences are numbered through the caches in order. They must share their taps."""

    def __init__(self, caches: list):
        taps = {tuple(c.target_layer_ids) for c in caches}
        if len(taps) != 1:
            raise ValueError(f"feature caches captured different target layers: {sorted(taps)}")
        self.caches = caches
        self.target_layer_ids = caches[0].target_layer_ids
        self.lse = caches[0].lse if all(c.lse is not None for c in caches) else None
        labelled = [c for c in caches if c.any_prefill_labelled()]
        self.greedy = caches[0].greedy if all(c.greedy is not None for c in labelled) else None
        self.starts = np.cumsum([0] + [len(c) for c in caches]).tolist()

    def with_taps(self, layer_ids: list[int]) -> "ConcatFeatureCache":
        return ConcatFeatureCache([c.with_taps(layer_ids) for c in self.caches])

    def __len__(self) -> int:
        return self.starts[-1]

    def _find(self, i: int) -> tuple[FeatureCache, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.caches[k], i - self.starts[k]

    def sequence(self, i: int):
        c, j = self._find(i)
        return c.sequence(j)

    def sequence_lse(self, i: int) -> torch.Tensor:
        c, j = self._find(i)
        return c.sequence_lse(j)

    def sequence_topk(self, i: int):
        c, j = self._find(i)
        return c.sequence_topk(j)

    def has_teacher(self) -> bool:
        return all(c.has_teacher() for c in self.caches)

    def token_ids(self, i: int) -> tuple[np.ndarray, int]:
        c, j = self._find(i)
        return c.token_ids(j)

    def prefill_labelled(self, i: int) -> bool:
        c, j = self._find(i)
        return c.prefill_labelled(j)

    def any_prefill_labelled(self) -> bool:
        return any(c.any_prefill_labelled() for c in self.caches)

    def sequence_greedy(self, i: int) -> torch.Tensor:
        c, j = self._find(i)
        return c.sequence_greedy(j)

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        return response_token_counts(self, vocab_size)
