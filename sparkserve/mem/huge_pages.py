"""Weights in 2 MiB transparent huge pages (Linux).

A small batch's forward streams every weight once per step, so it runs at the memory's speed;
on 4 KiB pages that stream misses the TLB every page, and on a virtual machine each miss walks two
page tables. torch's allocator gives no say over page size, and the kernel only backs
2 MiB-aligned ranges with huge pages (where THP is `madvise`, only those advised MADV_HUGEPAGE
before they are first written). So the weights are copied once, at load, into one such buffer.
Elsewhere (another OS, THP `never`, a device other than the CPU) they stay where they are. The
KV and state pools need no copy: NumPy, which allocates them (mem/heap.py: lazy_zeros), advises
its large buffers MADV_HUGEPAGE itself."""
from __future__ import annotations

import mmap
import sys
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
# Each tensor starts on a cache line of its own, as torch's allocator places them.
ALIGN = 64


def huge_pages_available() -> bool:
    """Whether MADV_HUGEPAGE memory can get huge pages here: Linux with THP `always` or `madvise`."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_MODE_PATH) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` on private anonymous memory that starts on a 2 MiB boundary
    and is advised MADV_HUGEPAGE; its pages are taken as it is written, and given back with it."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(mm, dtype=torch.uint8)     # holds the mapping while a view lives
    offset = -buf.data_ptr() % HUGE_PAGE
    mm.madvise(mmap.MADV_HUGEPAGE, offset, size)
    return buf[offset:offset + nbytes]


def move_into_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy these CPU tensors into one huge-page buffer and point each at its copy (`set_`: every
    holder of the same tensor sees it; a tensor that shares its storage with one given should be
    given too, or it keeps the old memory). Storage shared by several tensors is copied once, and
    their views stay views. Returns the bytes moved: 0 where huge pages are not available or the
    buffer could not be had, and the tensors then stay where they are."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    if not by_storage or not huge_pages_available():
        return 0
    storages = [ts[0].untyped_storage() for ts in by_storage.values()]
    offsets, total = [], 0
    for s in storages:
        offsets.append(total)
        total += -(-s.nbytes() // ALIGN) * ALIGN
    try:
        arena = huge_page_buffer(total)
    except OSError:             # no room for the mapping, or the kernel refuses the advice
        return 0
    for s, start, ts in zip(storages, offsets, by_storage.values()):
        arena[start:start + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
        for t in ts:
            t.set_(arena.untyped_storage(), (arena.storage_offset() + start) // t.element_size()
                   + t.storage_offset(), t.shape, t.stride())
    return total
