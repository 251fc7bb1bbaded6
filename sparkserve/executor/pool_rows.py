"""A request's pool rows as one process would hold them, under tensor and pipeline parallel (PD
disaggregation): the driver asks every rank that mirrors its forwards for its pieces and merges
them (`gather_rows`), or cuts whole rows into every rank's pieces and hands them out
(`scatter_rows`). The ranks answer in `serve_rows`, in the order the driver's commands come,
so a transfer sees the pools as the forwards before it left them."""
from __future__ import annotations

from dataclasses import dataclass

from sparkserve.core.pool import Pool
from sparkserve.distributed import parallel_state as ps
from sparkserve.mem.transfer import (
    Layout,
    RequestPages,
    Rows,
    Shapes,
    layout,
    merge,
    piece,
    read_request,
    shapes,
    write_request,
)

COMMANDS = ("layout", "rows_out", "rows_in")


@dataclass
class RankLayout:
    tp_rank: int
    tp_size: int
    layout: Layout
    shapes: Shapes


def rank_layout(pools: list[Pool]) -> RankLayout:
    return RankLayout(ps.tp_rank(), ps.tp_size(), layout(pools), shapes(pools))


def gather_layouts(pools: list[Pool]) -> list[RankLayout]:
    """What every rank holds (the driver asks once: it does not change)."""
    ps.broadcast_object(("layout",))
    return ps.control_gather_object(rank_layout(pools))


def gather_rows(lay: list[RankLayout], pools: list[Pool], pages: RequestPages, lo: int, state: bool) -> Rows:
    ps.broadcast_object(("rows_out", pages, lo, state))
    rows = ps.control_gather_object(read_request(pools, pages, lo, state))
    return merge([(r.tp_rank, r.tp_size, part, r.layout) for r, part in zip(lay, rows)])


def scatter_rows(lay: list[RankLayout], pools: list[Pool], pages: RequestPages, rows: Rows, lo: int,
                 start: int) -> None:
    ps.broadcast_object(("rows_in", pages, lo, start))
    mine = ps.control_scatter_object([piece(rows, r.layout, r.tp_rank, r.tp_size) for r in lay])
    write_request(pools, pages, mine, lo, start)


def serve_rows(msg: tuple, pool: Pool) -> None:
    """A mirroring rank's part of one of the driver's COMMANDS."""
    if msg[0] == "layout":
        ps.control_gather_object(rank_layout([pool]))
    elif msg[0] == "rows_out":
        _, pages, lo, state = msg
        ps.control_gather_object(read_request([pool], pages, lo, state))
    else:
        _, pages, lo, start = msg
        write_request([pool], pages, ps.control_scatter_object(), lo, start)
