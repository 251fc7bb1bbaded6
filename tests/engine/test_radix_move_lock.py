"""RadixCache.move_lock (a sliding window's per-step move of its lock over a cached prefix) leaves
the tree exactly as the `lock(node, new)` + `unlock(node, old)` pair it replaces: every node's
locks, the evictable / protected totals, in window mode and on a split pool, over cached prefixes
of several nodes, window by window with pages of 1 and 4."""
from __future__ import annotations

import pytest
import torch

from sparkserve.mem.allocator import PagedAllocator, SplitAllocator
from sparkserve.mem.radix_cache import RadixCache


def _cache(split: bool, page: int) -> tuple[RadixCache, object]:
    if split:
        alloc = SplitAllocator(512, 512, page)
        return RadixCache(alloc, swa_window=16), alloc
    alloc = PagedAllocator(512, page)
    return RadixCache(alloc, window=16), alloc


def _cached_prefix(split: bool, page: int) -> tuple[RadixCache, object, list[int]]:
    """A 96-token prompt cached as three inserts (so its path holds several nodes), then matched."""
    radix, alloc = _cache(split, page)
    key = [(7 * i) % 50 + 1 for i in range(96)]
    for n in (32, 64, 96):
        slots = alloc.alloc(0, n, 0)
        freed, _, _ = radix.insert(key[:n], slots, **({"alive_from": 0} if split else {}))
        alloc.free(freed)
    return radix, alloc, key


def _state(radix: RadixCache) -> list:
    nodes = sorted(((n.start, n.end, n.lock_ref, n.swa_lock_ref) for n in radix._nodes()))
    return [nodes, radix.evictable_size, radix.protected_size, radix.swa_evictable_size,
            radix.swa_protected_size]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("split", [False, True])
def test_move_lock_equals_lock_then_unlock(split, page):
    moved, _, key = _cached_prefix(split, page)
    paired, _, _ = _cached_prefix(split, page)
    ends = []
    for radix in (moved, paired):
        _, node = radix.match_prefix(key)
        assert node.end == 96
        radix.lock(node, 0)
        ends.append(node)
    old = 0
    for new in list(range(page, 96, page)) + [96]:     # the window's start, page by page
        moved.move_lock(ends[0], old, new)
        paired.lock(ends[1], new)
        paired.unlock(ends[1], old)
        old = new
        assert _state(moved) == _state(paired), new
    assert moved.swa_protected_size == 0 if split else moved.protected_size == 0
    assert _state(moved)[1 if not split else 3] > 0      # the passed prefix stays cached, evictable
    assert torch.equal(torch.tensor(_state(moved)[0]), torch.tensor(_state(paired)[0]))
