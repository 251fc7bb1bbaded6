"""PagedAllocator against a model of pages: random requests grow and leave; every slot handed out
belongs to exactly one request, a request's tokens fill its last page before a new one starts,
freed pages (the pad slot 0 among their slots) come back once, and the pool ends whole."""
from __future__ import annotations

import random

import pytest
import torch

from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.mem.allocator import PagedAllocator, SplitAllocator
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.sampling_params import SamplingParams


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_against_a_model(page_size):
    rng = random.Random(page_size)
    num_slots = 64
    alloc = PagedAllocator(num_slots, page_size)
    requests: list[list[int]] = []
    for _ in range(400):
        if requests and rng.random() < 0.3:
            slots = requests.pop(rng.randrange(len(requests)))
            alloc.free(torch.tensor([0, *slots]))          # a given-up page's pad slot too
        else:
            grow = rng.choice(requests) if requests and rng.random() < 0.6 else None
            held = grow if grow is not None else []
            n = rng.randint(1, 9)
            new = alloc.alloc(len(held), n, held[-1] if held else 0)
            pages_left = len(alloc.free_pages)
            if new is None:
                assert alloc.pages_needed(len(held), n) > pages_left
                continue
            new = new.tolist()
            assert len(new) == n
            if len(held) % page_size:                     # the last page is filled first
                assert new[0] == held[-1] + 1
            owned = [s for r in requests for s in r]
            assert not set(new) & set(owned) and len(set(new)) == n
            assert all(1 <= s <= num_slots for s in new)
            held.extend(new)
            if grow is None:
                requests.append(held)
            # a request's slots are whole pages but for the tail of its last one
            pages = [(s - 1) // page_size for s in held]
            assert pages == sorted(pages, key=pages.index)
            assert all(pages.count(p) == page_size for p in set(pages[:-1]) - {pages[-1]})
        used = {(s - 1) // page_size for r in requests for s in r}
        assert sorted(used | set(alloc.free_pages)) == list(range(num_slots // page_size))
        assert len(alloc.free_pages) == len(set(alloc.free_pages))
    for slots in requests:
        alloc.free(torch.tensor(slots))
    assert sorted(alloc.free_pages) == list(range(num_slots // page_size))
    assert alloc.free_slots == num_slots


def _free_swa_by_torch(alloc: SplitAllocator, slots: torch.Tensor) -> None:
    """SplitAllocator.free_swa as it was written with torch ops (the reference)."""
    p = alloc.page_size
    pages = torch.unique((slots[slots > 0] - 1) // p)
    every = (1 + pages[:, None] * p + torch.arange(p)[None, :]).flatten()
    alloc.swa.free(alloc.full_to_swa[every])
    alloc.full_to_swa[every] = 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_swa_equals_the_torch_reference(page_size):
    """Random requests grow and give up windowed pages (pad slots, partial and repeated pages
    among the slots passed): the mapping and both free lists stay equal to the reference's."""
    rng = random.Random(7 + page_size)
    pair = [SplitAllocator(96, 64, page_size) for _ in range(2)]
    held: list[list[int]] = [[] for _ in range(6)]
    for _ in range(300):
        i = rng.randrange(len(held))
        if held[i] and rng.random() < 0.4:
            k = rng.randint(1, len(held[i]))
            pick = torch.tensor([0] + rng.sample(held[i], k) + held[i][:1])
            pair[0].free_swa(pick)
            _free_swa_by_torch(pair[1], pick)
            held[i] = []                  # its windowed pages are gone: it starts again
            for a in pair:
                a.full.free(pick)
            continue
        n = rng.randint(1, 5)
        last = held[i][-1] if held[i] else 0
        got = [a.alloc(len(held[i]), n, last) for a in pair]
        assert (got[0] is None) == (got[1] is None)
        if got[0] is not None:
            assert torch.equal(got[0], got[1])
            held[i] += got[0].tolist()
        assert torch.equal(pair[0].full_to_swa, pair[1].full_to_swa)
        assert pair[0].swa.free_pages == pair[1].swa.free_pages
        assert pair[0].full.free_pages == pair[1].full.free_pages


def _running(cache: KVCacheManager, lens: list[int]) -> list[Req]:
    """Requests holding table rows whose KV (slots allocated one by one) is `lens` long."""
    reqs = []
    for k, n in enumerate(lens):
        p = SamplingParams.from_dict({"max_new_tokens": 4})
        req = Req(f"r{k}", list(range(1, n + 2)), p, RequestSamplingState(p, list(range(1, n + 2)), set()))
        req.row = cache.req_to_token.alloc()
        assert cache.alloc(req, n) is not None
        req.kv_len = n
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_decode_equals_alloc_one_by_one(split, page_size):
    """A decode step's batched allocation (one allocator call, one table write) hands out the
    slots, table entries, windowed mapping and free pages that `alloc` per request does, with
    verify blocks of several tokens, requests inside and at the end of a page, and a pool too
    short for the batch (the one-by-one fallback)."""
    lens, counts = [5, 8, 3, 12, 1, 7], [1, 3, 1, 2, 1, 4]
    short = {1: 40, 4: 48}[page_size]          # the running requests fit, their decode step does not
    for slots in (128, short):
        caches = [KVCacheManager(slots, page_size, 8, 64, swa_slots=slots if split else 0,
                                 swa_window=16 if split else None) for _ in range(2)]
        batched, single = (_running(c, lens) for c in caches)
        got = caches[0].alloc_decode(list(zip(batched, counts)))
        want = [caches[1].alloc(r, n) for r, n in zip(single, counts)]
        assert [None if s is None else s.tolist() for s in got] == \
            [None if s is None else s.tolist() for s in want]
        assert (None in got) == (slots == short)
        assert torch.equal(caches[0].req_to_token.table, caches[1].req_to_token.table)
        assert caches[0].allocator.free_pages == caches[1].allocator.free_pages
        if split:
            assert torch.equal(caches[0].full_to_swa, caches[1].full_to_swa)
            assert caches[0].allocator.swa.free_pages == caches[1].allocator.swa.free_pages
