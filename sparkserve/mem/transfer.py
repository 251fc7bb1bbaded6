"""A request's prompt state read out of one scheduler's pools and written into another's: the core
of prefill/decode disaggregation. It walks `components()` (docs/design.md, contract 3), so every
pool kind moves, now or when a model adds one: token_page rows by the request's slots,
window_page rows by its windowed slots (a split pool's own slot space) or its slots, request_row
rows (recurrent state) by its request row. A position that left a sliding window has slot 0 (the
padding dummy): its rows travel as padding and the receiving side gives them up again."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkserve.core.pool import Pool


@dataclass
class RequestPages:
    """Where positions 0..n-1 of one request live in a scheduler's pools."""
    slots: torch.Tensor                # [n] full slot space
    swa_slots: torch.Tensor | None     # [n] a split pool's windowed slot space, else None
    row: int                           # request-table row: request_row state

    def index(self, kind: str) -> torch.Tensor | int:
        if kind == "request_row":
            return self.row
        if kind == "window_page" and self.swa_slots is not None:
            return self.swa_slots
        return self.slots


Rows = list[list[torch.Tensor | None]]   # per pool, per component buffer (layer); None: not sent


def read_request(pools: list[Pool], pages: RequestPages, lo: int = 0, state: bool = True) -> Rows:
    """Every component's rows of the request for positions lo..len(pages.slots), per pool,
    component, layer (copies); request_row state only when `state` (it is whole only once the
    prompt has run: a transfer sends it last)."""
    def rows(kind: str, t: torch.Tensor) -> torch.Tensor | None:
        if kind == "request_row":
            return t[pages.row].clone() if state else None
        return t[pages.index(kind)[lo:]]
    return [[rows(c.kind, t) for c in pool.components() for t in c.tensors] for pool in pools]


def write_request(pools: list[Pool], pages: RequestPages, data: Rows, lo: int, start: int = 0) -> None:
    """Write `data` (read_request's rows for positions lo.., from the other side) at `pages`,
    skipping positions before `start` (held already: a cached prefix); request_row state whole."""
    if len(pools) != len(data):
        raise ValueError(f"the sending side has {len(data)} pools, this one {len(pools)}: a DSpark draft "
                         "on one side only?")
    for pool, rows in zip(pools, data):
        tensors = [(c.kind, t) for c in pool.components() for t in c.tensors]
        if len(tensors) != len(rows):
            raise ValueError(f"the sending pool has {len(rows)} layer buffers, this one {len(tensors)}: "
                             "the two sides run different models or layouts")
        for (kind, t), x in zip(tensors, rows):
            if x is None:
                continue
            if x.shape[x.dim() - t.dim() + 1:] != t.shape[1:]:
                raise ValueError(f"rows of shape {tuple(x.shape)} sent for a buffer of rows "
                                 f"{tuple(t.shape[1:])}: the two sides run different models or layouts")
            if kind == "request_row":
                t[pages.row] = x
                continue
            first = max(lo, start)
            idx = pages.index(kind)[first:lo + len(x)]
            t[idx] = x[first - lo:first - lo + len(idx)].to(t.dtype)
