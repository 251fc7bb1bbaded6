"""ForwardBatch: what one model forward needs, as tensors. Built by the ModelRunner from a
scheduled batch; attention reads its padded views (built once, shared by every layer)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sparkserve.core.pool import Pool


class ForwardMode(enum.Enum):
    EXTEND = "extend"      # prefill new tokens over a cached prefix
    DECODE = "decode"      # one token per request
    VERIFY = "verify"      # target scores anchor + draft tokens
    IDLE = "idle"          # DP attention: a group with no work joins the others' MLP collectives


_RANK_LOCAL = ("kv_pool", "aux_hidden", "final_hidden", "micro_batches", "mlp_rows", "cp", "_meta")


class TokenShard(Protocol):
    """Context parallel: which of a batch's tokens this rank runs (distributed/context_parallel.py)."""
    full: ForwardBatch

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows -> the full batch's rows, in its order."""

    def mine(self, x: torch.Tensor) -> torch.Tensor:
        """The full batch's rows -> this rank's."""

    def run_in_sequence(self, layer, x: torch.Tensor, state: list[torch.Tensor]) -> torch.Tensor:
        """A recurrent layer over this rank's rows x, its request-row `state` carried across the
        ranks in sequence order."""


@dataclass
class PPProxy:
    """What a pipeline stage that is not the last one hands on: the residual stream after its
    layers and the aux taps captured so far (docs/design.md, contract 1)."""
    hidden: torch.Tensor
    aux: list[torch.Tensor]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor         # [T] flat tokens of all requests, request after request
    positions: torch.Tensor         # [T]
    out_cache_loc: torch.Tensor     # [T] KV slots the new tokens write to
    extend_lens: list[int]          # new tokens per request
    seq_lens: list[int]             # KV length per request after this forward
    # [B, max(seq_lens) - kv_start] slot of positions kv_start.., padded with 0
    kv_indices: torch.Tensor
    kv_pool: Pool
    logits_rows: torch.Tensor | None = None   # flat rows whose logits are wanted
    req_rows: torch.Tensor | None = None      # [B] request-table rows: where request_row state lives
    # Position of kv_indices[:, 0]. 0 unless every layer is sliding-window: then no query of the
    # batch sees a key before the earliest window start, so attention gathers O(W) keys, not O(seq).
    kv_start: int = 0
    # Split pool (full and windowed layers mixed): the windowed layers' own slots of the new
    # tokens and of positions swa_kv_start.. (the batch's earliest window start); None otherwise.
    swa_out_cache_loc: torch.Tensor | None = None
    swa_kv_indices: torch.Tensor | None = None
    swa_kv_start: int = 0
    aux_hidden: list[torch.Tensor] = field(default_factory=list)
    final_hidden: torch.Tensor | None = None  # [T, d] final normed hidden (ModelRunner.hidden_states)
    # Pipeline parallel: the (first request, end, part) micro-batches the stages ran this batch as;
    # a VERIFY commits each part with its own requests' kept lengths.
    micro_batches: list[tuple[int, int, ForwardBatch]] = field(default_factory=list)
    # DP attention / context parallel: (rows each rank of the MLP group brings to this forward's
    # MLPs, the rank whose rows are this rank's): layers/dp_attention.py
    mlp_rows: tuple[list[int], int] | None = None
    cp: TokenShard | None = None    # context parallel: this batch is this rank's share of `cp.full`
    _meta: dict = field(default_factory=dict)

    def wire(self) -> dict:
        """What another rank needs to run the same forward on its own pool (tensor parallel)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _RANK_LOCAL}

    @classmethod
    def idle(cls, kv_pool: Pool) -> ForwardBatch:
        """A forward of no tokens: DP attention's group without work, in step with the others."""
        none = torch.zeros(0, dtype=torch.long)
        return cls(ForwardMode.IDLE, none, none, none, [], [], torch.zeros(0, 0, dtype=torch.long), kv_pool,
                   logits_rows=none)

    def select(self, lo: int, hi: int) -> ForwardBatch:
        """Requests lo..hi-1 as a batch of their own (a pipeline micro-batch): the same pool and
        slots, the key columns cut to its longest request; no logits rows (the caller picks those
        from the whole batch)."""
        a, b = sum(self.extend_lens[:lo]), sum(self.extend_lens[:hi])
        return self._sub(slice(a, b), slice(lo, hi))

    def split_by_query_len(self, max_q: int) -> list[tuple[torch.Tensor, ForwardBatch]]:
        """The requests of at most `max_q` new tokens and the longer ones, each as a batch of
        their own with its flat token rows in this batch: attention runs the short ones with a
        per-query kernel and pads only the long ones to their longest (cached per forward)."""
        if "split" not in self._meta:
            lens = self.extend_lens
            starts = [0] + torch.tensor(lens).cumsum(0).tolist()
            groups = []
            for short in (True, False):
                reqs = [i for i, n in enumerate(lens) if (n <= max_q) == short]
                if reqs:
                    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in reqs])
                    groups.append((rows, self._sub(rows, torch.tensor(reqs))))
            self._meta["split"] = groups
        return self._meta["split"]

    def _sub(self, rows: slice | torch.Tensor, reqs: slice | torch.Tensor) -> ForwardBatch:
        """The batch of requests `reqs` whose flat token rows are `rows`."""
        seq = torch.tensor(self.seq_lens)[reqs].tolist()
        swa = {}
        if self.swa_kv_indices is not None:
            swa = dict(swa_out_cache_loc=self.swa_out_cache_loc[rows], swa_kv_start=self.swa_kv_start,
                       swa_kv_indices=self.swa_kv_indices[reqs, :max(seq) - self.swa_kv_start])
        return ForwardBatch(self.mode, self.input_ids[rows], self.positions[rows], self.out_cache_loc[rows],
                            torch.tensor(self.extend_lens)[reqs].tolist(), seq,
                            self.kv_indices[reqs, :max(seq) - self.kv_start], self.kv_pool,
                            req_rows=None if self.req_rows is None else self.req_rows[reqs],
                            kv_start=self.kv_start, **swa)

    def parts(self) -> list[tuple[int, int, ForwardBatch]]:
        """The micro-batches this batch ran as, or the batch itself as its only part."""
        return self.micro_batches or [(0, self.batch_size, self)]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def query_layout(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(q_index [B, Qmax] flat row per padded query slot, flat_index [T]); both None when
        every request has the same number of query tokens, so [T] is a view of [B, Qmax]."""
        if "q" not in self._meta:
            lens = self.extend_lens
            qmax = max(lens)
            if all(n == qmax for n in lens):
                q_index = flat = None
            else:
                starts = torch.tensor([0] + lens[:-1]).cumsum(0)
                ar = torch.arange(qmax)
                lens_t = torch.tensor(lens)
                valid = ar[None, :] < lens_t[:, None]
                q_index = torch.where(valid, starts[:, None] + ar[None, :], torch.zeros((), dtype=torch.long))
                flat = (torch.arange(len(lens))[:, None] * qmax + ar[None, :])[valid]
            self._meta["q"] = (q_index, flat)
        return self._meta["q"]

    def query_runs(self) -> tuple[torch.Tensor, list[int], list[int]]:
        """The queries as runs of consecutive positions: (request of each run, its last position
        + 1, its length), runs in row order. One per request, except in a context-parallel share,
        whose cut requests have two zigzag blocks: causal attention over a run is a request's
        that ends at its last query."""
        if "runs" not in self._meta:
            pos = self.positions
            starts = torch.tensor([0] + self.extend_lens[:-1]).cumsum(0)
            first = torch.ones(pos.shape[0], dtype=torch.bool)
            first[1:] = pos[1:] != pos[:-1] + 1
            first[starts] = True
            run_start = first.nonzero().flatten()
            lens = torch.diff(run_start, append=torch.tensor([pos.shape[0]]))
            req = torch.searchsorted(starts, run_start, right=True) - 1
            self._meta["runs"] = (req, (pos[run_start + lens - 1] + 1).tolist(), lens.tolist())
        return self._meta["runs"]

    def store(self, buf: torch.Tensor, rows: torch.Tensor, window: int | None = None) -> None:
        """Write this forward's rows of a token_page pool item (K, V, latent, index K/V) at the
        new tokens' slots; under context parallel every rank's rows are gathered first, so each
        rank keeps the whole sequence where decode reads it."""
        rows = rows.to(buf.dtype)     # a float16 / bfloat16 pool (--kv-cache-dtype) rounds once, here
        if self.cp is None:
            buf[self.kv_view(window)[0]] = rows
        else:
            buf[self.cp.full.kv_view(window)[0]] = self.cp.gather(rows)

    def kv_view(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(slots the new tokens write to, slots of the gathered positions, first gathered
        position) for a layer with this window: a split pool's windowed layers use their own."""
        if window is not None and self.swa_kv_indices is not None:
            return self.swa_out_cache_loc, self.swa_kv_indices, self.swa_kv_start
        return self.out_cache_loc, self.kv_indices, self.kv_start

    def attn_mask(self, window: int | None) -> torch.Tensor | None:
        """Bool [B, 1, Qmax, Lmax] over the key positions kv_view(window) gathers: causal over
        absolute positions, within seq_len, inside the sliding window. None when everything is
        visible (batch-1 decode, equal lengths)."""
        key = ("mask", window)
        if key not in self._meta:
            self._meta[key] = self._build_mask(window)
        return self._meta[key]

    def _build_mask(self, window: int | None) -> torch.Tensor | None:
        _, kv_indices, kv_start = self.kv_view(window)
        lmax = kv_indices.shape[1]
        all_decode = all(n == 1 for n in self.extend_lens)
        same_len = all(s == kv_start + lmax for s in self.seq_lens)
        if all_decode and same_len and (window is None or lmax <= window) and self.cp is None:
            return None
        q_index, _ = self.query_layout()
        B = len(self.seq_lens)
        qpos = self.positions.view(B, -1) if q_index is None else self.positions[q_index]
        # padded query rows reuse flat row 0's position; their outputs are dropped
        kpos = kv_start + torch.arange(lmax)
        seq = torch.tensor(self.seq_lens)
        mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < seq[:, None, None])
        if window is not None:
            mask &= qpos[:, :, None] - kpos[None, None, :] < window
        return mask.unsqueeze(1)
