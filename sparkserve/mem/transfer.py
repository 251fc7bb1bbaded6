"""A request's prompt state read out of one scheduler's pools and written into another's: the core
of prefill/decode disaggregation. It walks `components()` (docs/design.md, contract 3), so every
pool kind moves, now or when a model adds one: token_page rows by the request's slots,
window_page rows by its windowed slots (a split pool's own slot space) or its slots, request_row
rows (recurrent state) by its request row. A position that left a sliding window has slot 0 (the
padding dummy): its rows travel as padding and the receiving side gives them up again.

Rows are keyed by (pool index, component, layer id), so the two sides may hold different layer
sets (pipeline stages) or different pieces of each item (tensor parallel: `Split`): `merge`
rebuilds the rows one process would hold from every rank's pieces, `piece` cuts a rank's out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sparkserve.core.pool import Pool, Split
from sparkserve.mem.kv_quant import format_of

RowKey = tuple[int, str, int]          # (pool index, component name, layer id)
Rows = dict[RowKey, torch.Tensor]      # [positions or 1 request row, *item]
Layout = dict[RowKey, tuple[str, Split | None]]   # what a rank holds: kind and cut of each buffer
Shapes = dict[RowKey, tuple[str, tuple[int, ...]]]  # kind and whole item shape of every buffer


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


@dataclass
class RequestRows:
    """One request's prompt state on one side of a transfer: this rank's pools and pages (for
    backends that move memory directly), and reads and writes of the rows one process would hold
    (every rank's pieces merged; the scheduler's runner does that under tensor or pipeline
    parallel)."""
    pools: list[Pool]
    pages: RequestPages
    read: Callable[[int, bool], Rows]           # (lo, with request-row state) -> rows of positions lo..
    write: Callable[[Rows, int, int], None]     # (rows of positions lo.., lo, start): skip before start
    shapes: Shapes                              # this side's whole layout, checked against the other's


def _buffers(pools: list[Pool]):
    for p, pool in enumerate(pools):
        for c in pool.components():
            for layer, t in zip(c.layers, c.tensors):
                yield (p, c.name, layer), c, t


def layout(pools: list[Pool]) -> Layout:
    return {key: (c.kind, c.split) for key, c, _ in _buffers(pools)}


def shapes(pools: list[Pool]) -> Shapes:
    """Kind and whole item shape of every buffer here (a cut dimension times its parts)."""
    out: Shapes = {}
    for key, c, t in _buffers(pools):
        item = list(t.shape[1:])
        if c.split is not None:
            item[c.split.dim] *= c.split.parts
        out[key] = (c.kind, tuple(item))
    return out


def check_shapes(sent: Shapes, held: Shapes) -> None:
    """The buffers a side sends fit the ones the other holds; it may send more only from pools
    past the model's (a DSpark draft on the sending side only). Quantized KV pools first: their
    elements and scales move as they are, so both sides must hold the same format."""
    formats = [_kv_format(s) for s in (sent, held)]
    if formats[0] != formats[1]:
        raise ValueError(f"the KV caches differ: --kv-cache-dtype {formats[0]} on the prefill side, "
                         f"{formats[1]} on the decode side; a quantized pool's rows and scales move as "
                         "they are, so both sides need the same --kv-cache-dtype")
    for key in sorted(held.keys() | {k for k in sent if k[0] == 0}):
        if sent.get(key) != held.get(key):
            raise ValueError(f"{_name(key)} is {sent.get(key, 'missing')} on the prefill side, "
                             f"{held.get(key, 'missing')} here: the two sides run different models")


def _kv_format(s: Shapes) -> str:
    """The model's pool's quantized KV format (its scale components say it), or the float types'."""
    found = {f for key in s if key[0] == 0 and (f := format_of(key[1])) is not None}
    return ", ".join(sorted(found)) or "float32 / float16 / bfloat16"


def check_rows(rows: Rows, held: Shapes, lo: int, positions: int) -> None:
    """Rows from the other side fit this side's reservation of `positions` positions before they
    touch a pool: each buffer's item shape is the one held here (buffers not held here only from
    pools past the model's, which write_request leaves), token rows within positions lo..,
    request-row state one row."""
    for key, x in rows.items():
        kind, item = held.get(key, (None, None))
        if kind is None and key[0] == 0:
            raise ValueError(f"rows sent for {_name(key)}, which this side does not hold: the two sides "
                             "run different models")
        if item is not None and tuple(x.shape[1:]) != item:
            raise ValueError(f"rows of {list(x.shape[1:])} sent for {_name(key)}, which holds {list(item)}: "
                             "the two sides run different models or layouts")
        if kind == "request_row" and x.shape[0] != 1:
            raise ValueError(f"{x.shape[0]} request rows sent for {_name(key)}")
        if kind != "request_row" and lo + x.shape[0] > positions:
            raise ValueError(f"rows for positions {lo}..{lo + x.shape[0]} sent for {_name(key)}, where "
                             f"{positions} are reserved")


def read_request(pools: list[Pool], pages: RequestPages, lo: int = 0, state: bool = True) -> Rows:
    """Every buffer's rows of the request for positions lo..len(pages.slots) (copies);
    request_row state only when `state` (it is whole only once the prompt has run: a transfer
    sends it last)."""
    out: Rows = {}
    for key, c, t in _buffers(pools):
        if c.kind == "request_row":
            if state:
                out[key] = t[pages.row:pages.row + 1].clone()
        else:
            out[key] = t[pages.index(c.kind)[lo:]]
    return out


def write_request(pools: list[Pool], pages: RequestPages, data: Rows, lo: int, start: int = 0) -> None:
    """Write `data` (read_request's rows for positions lo.., from the other side) at `pages`,
    skipping positions before `start` (held already: a cached prefix); request_row state whole
    when it is there. Every token buffer here must be in `data` (buffers sent that this side
    does not hold are left: a DSpark draft on the sending side only)."""
    for key, c, t in _buffers(pools):
        x = data.get(key)
        if x is None:
            if c.kind == "request_row":
                continue
            raise ValueError(f"no rows sent for {_name(key)}: the two sides run different models or layouts")
        if x.shape[1:] != t.shape[1:]:
            raise ValueError(f"rows of {tuple(x.shape[1:])} sent for {_name(key)}, which holds "
                             f"{tuple(t.shape[1:])}: the two sides run different models or layouts")
        if c.kind == "request_row":
            t[pages.row] = x[0]
            continue
        first = max(lo, start)
        idx = pages.index(c.kind)[first:lo + len(x)]
        t[idx] = x[first - lo:first - lo + len(idx)].to(t.dtype)


def _name(key: RowKey) -> str:
    return f"pool {key[0]} {key[1]} of layer {key[2]}"


def _owner(rank: int, ranks: int, split: Split) -> int:
    return rank * split.parts // ranks


def merge(shards: list[tuple[int, int, Rows, Layout]]) -> Rows:
    """The rows one process would hold, from every rank's (tp rank, tp size, rows, layout):
    layers from every pipeline stage, items whole from their pieces (each piece once)."""
    pieces: dict[RowKey, dict[int, torch.Tensor]] = {}
    cuts: dict[RowKey, Split | None] = {}
    for rank, ranks, rows, lay in shards:
        for key, x in rows.items():
            split = lay[key][1]
            cuts[key] = split
            part = 0 if split is None else _owner(rank, ranks, split)
            pieces.setdefault(key, {}).setdefault(part, x)
    out: Rows = {}
    for key, parts in pieces.items():
        split = cuts[key]
        if split is None or split.parts == 1:
            out[key] = parts[0]
            continue
        d = split.dim + 1
        blocks = [parts[p].chunk(split.groups, d) for p in range(split.parts)]
        out[key] = torch.cat([torch.cat([b[g] for b in blocks], d) for g in range(split.groups)], d)
    return out


def piece(rows: Rows, lay: Layout, rank: int, ranks: int) -> Rows:
    """The rows a rank of this layout holds, cut out of whole rows (merge's inverse)."""
    out: Rows = {}
    for key, (_, split) in lay.items():
        if key not in rows:
            continue
        x = rows[key]
        if split is not None and split.parts > 1:
            d, part = split.dim + 1, _owner(rank, ranks, split)
            x = torch.cat([b.chunk(split.parts, d)[part] for b in x.chunk(split.groups, d)], d)
        out[key] = x
    return out
