"""PagedAllocator against a model of pages: random requests grow and leave; every slot handed out
belongs to exactly one request, a request's tokens fill its last page before a new one starts,
freed pages (the pad slot 0 among their slots) come back once, and the pool ends whole."""
from __future__ import annotations

import random

import pytest
import torch

from sparkserve.mem.allocator import PagedAllocator


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
