"""KVCacheManager.slide_windows (a decode step's requests slide their windows with one table read
and one allocator call) and slide_window (one request) leave the cache as the per-request rule
written plainly below (`_slide_reference`, the code they replace) does: the
positions each request's table keeps, its window and lock starts, every radix node's locks and the
evictable / protected totals, how many pages each slot space has free and the pages given up, step by
step, in window mode and on a split pool, pages of 1 and 4, with requests over a cached prefix
(their windows pass it: move_lock) and without. Freed pages may come back in another order (one
sorted free instead of one per request), so slot numbers are compared through what they mean."""
from __future__ import annotations

import pytest

from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.sampling_params import SamplingParams

WINDOW = 12


def _cache(split: bool, page: int) -> KVCacheManager:
    if split:
        return KVCacheManager(512, page, 8, 256, swa_slots=512, swa_window=WINDOW)
    return KVCacheManager(512, page, 8, 256, window=WINDOW)


def _start(cache: KVCacheManager, prompts: list[list[int]]) -> list[Req]:
    """Requests admitted (a later one reads the earlier ones' cached prompt), prefilled, cached."""
    reqs = []
    for k, prompt in enumerate(prompts):
        p = SamplingParams.from_dict({"max_new_tokens": 64})
        req = Req(f"r{k}", list(prompt), p, RequestSamplingState(p, list(prompt), set()))
        assert cache.admit(req)
        n = len(prompt) - req.kv_len
        assert cache.alloc(req, n) is not None
        req.kv_len += n
        cache.cache_prefix(req)
        cache.slide_window(req)
        reqs.append(req)
    return reqs


def _slide_reference(cache: KVCacheManager, req: Req) -> None:
    """One request's slide, a torch slice at a time: own pages freed, cached ones unlocked."""
    end = cache.radix.window_start(req.kv_len)
    begin = req.window_start
    if end <= begin:
        return
    row = cache.req_to_token.table[req.row]
    own = max(begin, req.cached_len)
    if end > own:
        (cache.allocator.free_swa if cache.split else cache.allocator.free)(row[own:end])
        cache.window_freed_pages += (end - own) // cache.allocator.page_size
    if req.last_node is not cache.radix.root and req.lock_start < req.cached_len:
        keep = min(end, req.cached_len)
        cache.radix.lock(req.last_node, keep)
        cache.radix.unlock(req.last_node, req.lock_start)
        req.lock_start = keep
        if keep == req.cached_len and not cache.split:
            req.last_node, req.lock_start = cache.radix.root, 0
    if not cache.split:
        row[begin:end] = 0
    req.window_start = end


def _state(cache: KVCacheManager, reqs: list[Req]) -> list:
    radix, alloc = cache.radix, cache.allocator
    nodes = sorted((n.start, n.end, n.lock_ref, n.swa_lock_ref, n.dead) for n in radix._nodes())
    table = cache.req_to_token.table
    kept = [(table[r.row, :r.kv_len] > 0).tolist() for r in reqs]
    f2s = cache.full_to_swa
    windowed = [(f2s[table[r.row, :r.kv_len]] > 0).tolist() for r in reqs] if cache.split else []
    return [nodes, radix.evictable_size, radix.protected_size, radix.swa_evictable_size,
            radix.swa_protected_size, [(r.window_start, r.lock_start, r.last_node.end) for r in reqs],
            kept, windowed, len(alloc.free_pages), cache.window_freed_pages,
            len(alloc.swa.free_pages) if cache.split else None]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("split", [False, True])
def test_slide_windows_equals_slide_window_one_by_one(split, page):
    shared = [(5 * i) % 40 + 1 for i in range(40)]
    prompts = [shared, shared + [7, 9, 11, 13], [(3 * i) % 30 + 2 for i in range(9)], shared[:24] + [1] * 8]
    caches = [_cache(split, page) for _ in range(3)]
    ways = [lambda c, rs: c.slide_windows(rs), lambda c, rs: [c.slide_window(r) for r in rs],
            lambda c, rs: [_slide_reference(c, r) for r in rs]]
    runs = [(c, _start(c, prompts)) for c in caches]
    want = _state(*runs[2])
    assert _state(*runs[0]) == want and _state(*runs[1]) == want
    assert any(r.cached_len > r.window_start for r in runs[0][1]), "some window starts inside a cached prefix"
    for step in range(48):
        for (cache, reqs), slide in zip(runs, ways):
            got = cache.alloc_decode([(r, 1) for r in reqs])
            assert all(s is not None for s in got)
            for r in reqs:
                r.kv_len += 1
            slide(cache, reqs)
        want = _state(*runs[2])
        assert _state(*runs[0]) == want and _state(*runs[1]) == want, step
    assert all(r.lock_start == r.cached_len or r.last_node is caches[0].radix.root for r in runs[0][1])
    assert caches[0].window_freed_pages > 0
