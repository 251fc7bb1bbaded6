"""A feature cache that fits the disk at 10M+ tokens: the taps as int8 with one scale per row and
tap, and the teacher as its top-k log-probs on response rows only (no final hidden rows).

Per token the fp16 cache holds n_taps * d + d halves (4.6 KB on SmolLM2 with 3 taps) plus a
float lse; this one holds n_taps * d bytes + n_taps scales on every row and k ids and
log-probs on response rows (about 2 KB). The teacher needs no LM head at training time: p_t is
the top-k probabilities scattered into the draft vocab (the mass beyond them counts as outside
the draft vocab, as the reduced-vocab loss already counts the target's other ids).

Layout in DIR: tokens.npy (int32 [N]), taps_q.npy (int8 [N, n_taps * d]), tap_scales.npy
(float32 [N, n_taps]), topk_ids.npy (int32 [M, k]), topk_logp.npy (float16 [M, k]) where M is
the response rows, sequence i's at teacher_offsets[i]; index.json ({"format": "int8-topk", ...}).

Conversion (from a distillation log or an fp16 cache) writes these files in place, chunk by
chunk, never a second fp16 copy; convert.json records the rows done after each chunk's flush,
so a stopped conversion resumes where it stopped, and index.json, written last, marks the cache
complete."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

FORMAT = "int8-topk"
TOP_K = 32


def quantize_rows(x: torch.Tensor, n_taps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row and tap: (q [R, n*d] int8, scales [R, n] float32 = absmax / 127).
    Each value is within half a step (scale / 2) of its source. A NaN row (a sequence's last,
    never-run token) keeps NaN scales, so it reads back as NaN as in the fp16 cache."""
    R = x.shape[0]
    t = x.float().view(R, n_taps, -1)
    scale = t.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).nan_to_num(1.0)
    q = torch.round(t.nan_to_num(0.0) / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(R, -1), scale


def dequantize_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    R, n = scales.shape
    return (q.reshape(R, n, -1).astype(np.float32) * scales[..., None].astype(np.float32)).reshape(R, -1)


@torch.inference_mode()
def teacher_topk(head_weight: torch.Tensor, hidden: torch.Tensor, k: int = TOP_K,
                 chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's k most likely next ids after each row of final hidden states and their
    log-probabilities over the full vocab: (ids [R, k] int32, logp [R, k] float32)."""
    ids, logp = [], []
    w = head_weight.float()
    for i in range(0, hidden.shape[0], chunk):
        lp = torch.log_softmax(hidden[i:i + chunk].float() @ w.T, -1)
        v, j = lp.topk(min(k, lp.shape[-1]), -1)
        ids.append(j.int())
        logp.append(v)
    return torch.cat(ids), torch.cat(logp)


def convert(taps_src, final_src, seqs: list[list[int]], prompt_lens: list[int], layer_ids: list[int],
            out_dir: str, head_weight: torch.Tensor, k: int = TOP_K,
            prefill_labelled: list[bool] | None = None, chunk_rows: int = 16384,
            stop_after_rows: int | None = None) -> bool:
    """Write the int8 cache of fp16 rows `taps_src` [N, n*d] and `final_src` [N, d] (memory-mapped:
    a distillation log's .bin files or an fp16 cache's .npy) into out_dir, whole sequences per
    chunk; resumes from out_dir/convert.json. `stop_after_rows` stops after the chunk that passes
    that many rows (a conversion cut off, for tests). Returns whether the cache is complete."""
    if os.path.exists(os.path.join(out_dir, "index.json")):
        return True
    os.makedirs(out_dir, exist_ok=True)
    lens = [len(s) for s in seqs]
    N, n_taps = sum(lens), len(layer_ids)
    d = final_src.shape[1]
    offsets = np.cumsum([0] + lens[:-1]).astype(np.int64)
    resp = [n - p for n, p in zip(lens, prompt_lens)]
    t_offsets = np.cumsum([0] + resp[:-1]).astype(np.int64)
    M = int(sum(resp))
    state_path = os.path.join(out_dir, "convert.json")
    layout = {"rows": N, "teacher_rows": M, "k": k, "n_taps": n_taps, "hidden_size": d}
    state = json.load(open(state_path)) if os.path.exists(state_path) else None
    if state is not None and state["layout"] != layout:
        raise ValueError(f"{out_dir} holds a conversion of other data ({state['layout']} != {layout}): "
                         "use an empty folder")
    mode = "r+" if state is not None else "w+"
    files = {"tokens": (np.int32, (N,)), "taps_q": (np.int8, (N, n_taps * d)),
             "tap_scales": (np.float32, (N, n_taps)), "topk_ids": (np.int32, (M, k)),
             "topk_logp": (np.float16, (M, k))}
    arr = {name: np.lib.format.open_memmap(os.path.join(out_dir, f"{name}.npy"), mode, dt, shape)
           for name, (dt, shape) in files.items()}
    if state is None:
        arr["tokens"][:] = np.fromiter((t for s in seqs for t in s), np.int32, N)
        arr["tokens"].flush()
        state = {"layout": layout, "seqs_done": 0}
        _write_json(state_path, state)
    i = state["seqs_done"]
    with tqdm(total=len(seqs), initial=i, desc="int8 cache", unit="seq") as bar:
        while i < len(seqs):
            j, rows = i, 0
            while j < len(seqs) and (j == i or rows + lens[j] <= chunk_rows):
                rows += lens[j]
                j += 1
            o = int(offsets[i])
            q, sc = quantize_rows(torch.from_numpy(np.array(taps_src[o:o + rows])), n_taps)
            arr["taps_q"][o:o + rows] = q.numpy()
            arr["tap_scales"][o:o + rows] = sc.numpy()
            picks = np.concatenate([np.arange(offsets[s] + prompt_lens[s], offsets[s] + lens[s])
                                    for s in range(i, j)] + [np.empty(0, np.int64)])
            if len(picks):
                ids, logp = teacher_topk(head_weight, torch.from_numpy(
                    np.asarray(final_src[picks], dtype=np.float32)), k)
                t0 = int(t_offsets[i])
                arr["topk_ids"][t0:t0 + len(picks), :ids.shape[1]] = ids.numpy()
                arr["topk_logp"][t0:t0 + len(picks), :ids.shape[1]] = logp.half().numpy()
                if ids.shape[1] < k:            # a vocab smaller than k: the rest is impossible
                    arr["topk_ids"][t0:t0 + len(picks), ids.shape[1]:] = 0
                    arr["topk_logp"][t0:t0 + len(picks), ids.shape[1]:] = -np.inf
            for a in arr.values():
                a.flush()
            bar.update(j - i)
            i = j
            state["seqs_done"] = i
            _write_json(state_path, state)       # after the rows: a recorded chunk is on disk
            if stop_after_rows is not None and int(offsets[i - 1]) + lens[i - 1] >= stop_after_rows \
                    and i < len(seqs):
                return False
    idx = {"format": FORMAT, "offsets": offsets.tolist(), "lengths": lens, "prompt_lens": list(prompt_lens),
           "teacher_offsets": t_offsets.tolist(), "top_k": k, "target_layer_ids": list(layer_ids),
           "hidden_size": d}
    if prefill_labelled is not None and any(prefill_labelled):
        idx["prefill_labelled"] = [bool(b) for b in prefill_labelled]
    _write_json(os.path.join(out_dir, "index.json"), idx)
    return True


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def convert_log(log_dir: str, seqs: list[list[int]], prompt_lens: list[int], layer_ids: list[int],
                out_dir: str, head_weight: torch.Tensor, prefill_labelled: list[bool] | None = None,
                **kw) -> bool:
    """The int8 cache of a distillation log (RawFeatureLog), read in place."""
    with open(os.path.join(log_dir, "meta.json")) as f:
        d = json.load(f)["hidden_size"]
    N = sum(map(len, seqs))
    taps = np.memmap(os.path.join(log_dir, "taps.bin"), np.float16, "r", shape=(N, len(layer_ids) * d))
    final = np.memmap(os.path.join(log_dir, "final.bin"), np.float16, "r", shape=(N, d))
    return convert(taps, final, seqs, prompt_lens, layer_ids, out_dir, head_weight,
                   prefill_labelled=prefill_labelled, **kw)


def convert_fp16_cache(src_dir: str, out_dir: str, head_weight: torch.Tensor, **kw) -> bool:
    """The int8 cache of an fp16 feature cache (feature_cache.FeatureCache's files), read in place:
    the fp16 folder can be deleted afterwards."""
    with open(os.path.join(src_dir, "index.json")) as f:
        idx = json.load(f)
    tokens = np.load(os.path.join(src_dir, "tokens.npy"), mmap_mode="r")
    seqs = [tokens[o:o + n].tolist() for o, n in zip(idx["offsets"], idx["lengths"])]
    taps = np.load(os.path.join(src_dir, "taps.npy"), mmap_mode="r")
    final = np.load(os.path.join(src_dir, "final.npy"), mmap_mode="r")
    return convert(taps, final, seqs, idx["prompt_lens"], idx["target_layer_ids"], out_dir, head_weight,
                   prefill_labelled=idx.get("prefill_labelled"), **kw)


@dataclass
class Int8FeatureCache:
    """FeatureCache's reading interface over the int8 layout: sequence() dequantises the taps (no
    final rows: the teacher is sequence_topk's); the target's greedy choice is the top-1 id."""
    tokens: np.ndarray
    taps_q: np.ndarray
    tap_scales: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray
    offsets: list[int]
    lengths: list[int]
    prompt_lens: list[int]
    teacher_offsets: list[int]
    target_layer_ids: list[int]
    prefill_labels: list[bool] | None = None
    tap_select: list[int] | None = None     # with_taps: the stored taps read, in order (None: all)
    lse = None                               # no log-normaliser needed: the teacher is normalised

    @classmethod
    def open(cls, path: str) -> "Int8FeatureCache":
        with open(os.path.join(path, "index.json")) as f:
            idx = json.load(f)
        load = lambda n: np.load(os.path.join(path, f"{n}.npy"), mmap_mode="r")
        return cls(load("tokens"), load("taps_q"), load("tap_scales"), load("topk_ids"), load("topk_logp"),
                   idx["offsets"], idx["lengths"], idx["prompt_lens"], idx["teacher_offsets"],
                   idx["target_layer_ids"], idx.get("prefill_labelled"))

    @property
    def greedy(self) -> np.ndarray:
        return self.topk_ids

    def has_teacher(self) -> bool:
        return True

    def with_taps(self, layer_ids: list[int]) -> "Int8FeatureCache":
        missing = [t for t in layer_ids if t not in self.target_layer_ids]
        if missing:
            raise ValueError(f"the feature cache holds taps {self.target_layer_ids}, not {missing}: "
                             f"capture with --target-layer-ids {','.join(map(str, layer_ids))}")
        base = self.tap_select or list(range(len(self.target_layer_ids)))
        sel = [base[self.target_layer_ids.index(t)] for t in layer_ids]
        return replace(self, target_layer_ids=list(layer_ids), tap_select=sel)

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, None, int]:
        o, n = self.offsets[i], self.lengths[i]
        q, sc = np.asarray(self.taps_q[o:o + n]), np.asarray(self.tap_scales[o:o + n])
        if self.tap_select is not None:
            q = q.reshape(n, sc.shape[1], -1)[:, self.tap_select].reshape(n, -1)
            sc = sc[:, self.tap_select]
        return (torch.from_numpy(np.asarray(self.tokens[o:o + n], dtype=np.int64)),
                torch.from_numpy(dequantize_rows(q, sc)), None, self.prompt_lens[i])

    def sequence_topk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [S, k], log-probs [S, k]) of sequence i's rows; prompt rows: id 0, log-prob -inf
        (training reads the teacher on response rows only)."""
        n, p, t = self.lengths[i], self.prompt_lens[i], self.teacher_offsets[i]
        k = self.topk_ids.shape[1]
        ids = torch.zeros(n, k, dtype=torch.long)
        logp = torch.full((n, k), float("-inf"))
        ids[p:] = torch.from_numpy(np.asarray(self.topk_ids[t:t + n - p], dtype=np.int64))
        logp[p:] = torch.from_numpy(np.asarray(self.topk_logp[t:t + n - p], dtype=np.float32))
        return ids, logp

    def sequence_greedy(self, i: int) -> torch.Tensor:
        ids, _ = self.sequence_topk(i)
        return ids[:, 0]

    def prefill_labelled(self, i: int) -> bool:
        return bool(self.prefill_labels and self.prefill_labels[i])

    def any_prefill_labelled(self) -> bool:
        return bool(self.prefill_labels and any(self.prefill_labels))

    def token_ids(self, i: int) -> tuple[np.ndarray, int]:
        o, n = self.offsets[i], self.lengths[i]
        return np.asarray(self.tokens[o:o + n], dtype=np.int64), self.prompt_lens[i]

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        from sparkserve.training.feature_cache import response_token_counts
        return response_token_counts(self, vocab_size)


def is_int8_cache(path: str) -> bool:
    try:
        with open(os.path.join(path, "index.json")) as f:
            return json.load(f).get("format") == FORMAT
    except OSError:
        return False
