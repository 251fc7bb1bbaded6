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


def read_request(pools: list[Pool], pages: RequestPages) -> list[list[torch.Tensor]]:
    """Every component's rows of the request, per pool, component, layer (copies)."""
    return [[t[pages.index(c.kind)].clone() for c in pool.components() for t in c.tensors] for pool in pools]


def write_request(pools: list[Pool], pages: RequestPages, data: list[list[torch.Tensor]], start: int) -> None:
    """Write `data` (read_request's, from the other side) for positions start.. at `pages`; its
    request_row state whole (it is the state after the whole prompt)."""
    for pool, rows in zip(pools, data):
        tensors = [(c.kind, t) for c in pool.components() for t in c.tensors]
        if len(tensors) != len(rows):
            raise ValueError(f"the sending pool has {len(rows)} layer buffers, this one {len(tensors)}: "
                             "the two sides run different models or layouts")
        for (kind, t), x in zip(tensors, rows):
            if kind == "request_row":
                t[pages.row] = x
            else:
                t[pages.index(kind)[start:]] = x[start:]
