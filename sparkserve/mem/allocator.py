"""Paged slot allocator. Slots 1..num_slots are grouped into pages of `page_size`; a request
owns whole pages, so freeing and prefix sharing work page by page (slot 0 is the pad slot)."""
from __future__ import annotations

import torch


class PagedAllocator:
    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots < page_size:
            raise ValueError(f"KV pool of {num_slots} slots is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() gives page 0 first

    @property
    def free_slots(self) -> int:
        return len(self.free_pages) * self.page_size

    def pages_needed(self, cur_len: int, n: int) -> int:
        p = self.page_size
        return -(-(cur_len + n) // p) - (-(-cur_len // p))

    def alloc(self, cur_len: int, n: int, last_slot: int) -> torch.Tensor | None:
        """Slots for tokens cur_len..cur_len+n-1 of a request whose token cur_len-1 sits in
        `last_slot`: first the rest of that page, then fresh pages. None if out of pages."""
        if self.pages_needed(cur_len, n) > len(self.free_pages):
            return None
        return torch.tensor(self.take(cur_len, n, last_slot), dtype=torch.long)

    def alloc_many(self, asks: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """`alloc` for each (cur_len, n, last_slot), in order, as one flat tensor; None, taking
        nothing, unless the pages for all of them are free."""
        if sum(self.pages_needed(c, n) for c, n, _ in asks) > len(self.free_pages):
            return None
        return torch.tensor([s for c, n, last in asks for s in self.take(c, n, last)], dtype=torch.long)

    def take(self, cur_len: int, n: int, last_slot: int) -> list[int]:
        """`alloc`'s slots as Python ints (the caller checked the pages are free): a torch call
        per page would cost more than the page's bookkeeping at small pages."""
        need = self.pages_needed(cur_len, n)
        p = self.page_size
        slots: list[int] = []
        in_page = cur_len % p
        if in_page:
            take = min(p - in_page, n)
            slots.extend(range(last_slot + 1, last_slot + 1 + take))
            n -= take
        for _ in range(need):
            page = self.free_pages.pop()
            take = min(p, n)
            slots.extend(range(1 + page * p, 1 + page * p + take))
            n -= take
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages these slots start or cover (callers pass whole pages' slots); pad
        slot 0 (a position whose page was already given up) is skipped."""
        self.free_pages.extend(self.pages_of(slots))

    def pages_of(self, slots: torch.Tensor) -> list[int]:
        """The pages (ascending) these slots lie in; pad slot 0 lies in none."""
        p = self.page_size
        return sorted({(s - 1) // p for s in slots.tolist() if s > 0})


class SplitAllocator:
    """Two slot spaces for models that mix full-attention and sliding-window layers (SGLang's
    SWA pool): full layers index K/V by the full slots the request table and the prefix cache
    hold; windowed layers by `full_to_swa[slot]`, a slot of a second, smaller space. Both
    spaces are allocated together, page for page; the windowed one alone can be given up early
    (`free_swa`, when a page leaves the window) and then maps to the pad slot 0."""

    def __init__(self, num_slots: int, swa_slots: int, page_size: int = 1):
        self.full = PagedAllocator(num_slots, page_size)
        self.swa = PagedAllocator(swa_slots, page_size)
        self.page_size = page_size
        self.full_to_swa = torch.zeros(num_slots + 1, dtype=torch.long)

    # the full space stands for the allocator in accounting (pool size, usage)
    @property
    def num_pages(self) -> int:
        return self.full.num_pages

    @property
    def free_pages(self) -> list[int]:
        return self.full.free_pages

    @property
    def free_slots(self) -> int:
        return self.full.free_slots

    @property
    def swa_free_slots(self) -> int:
        return self.swa.free_slots

    def pages_needed(self, cur_len: int, n: int) -> int:
        return self.full.pages_needed(cur_len, n)

    def alloc(self, cur_len: int, n: int, last_slot: int) -> torch.Tensor | None:
        """Full slots for the tokens (as PagedAllocator.alloc), each mapped to a windowed slot;
        None, taking nothing, unless both spaces have the pages."""
        return self.alloc_many([(cur_len, n, last_slot)])

    def alloc_many(self, asks: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """`alloc` for each (cur_len, n, last_slot), in order, as one flat tensor (one mapping
        write for all); None, taking nothing, unless both spaces have the pages for all."""
        need = sum(self.pages_needed(c, n) for c, n, _ in asks)
        if need > len(self.full.free_pages) or need > len(self.swa.free_pages):
            return None
        full: list[int] = []
        swa: list[int] = []
        p = self.page_size
        for cur_len, n, last_slot in asks:
            # the last token's windowed slot matters only inside its page (never read at page size 1)
            last_swa = int(self.full_to_swa[last_slot]) if cur_len % p else 0
            assert cur_len % p == 0 or last_swa > 0, "the last token's windowed page was given up"
            full += self.full.take(cur_len, n, last_slot)
            swa += self.swa.take(cur_len, n, last_swa)
        slots = torch.tensor(full, dtype=torch.long)
        self.full_to_swa[slots] = torch.tensor(swa, dtype=torch.long)
        return slots

    def free_swa(self, slots: torch.Tensor) -> None:
        """Give up the windowed slots of these full slots' pages (the full slots stay). The pages
        are found with Python ints: a window slides by a page or so per decode step, where a
        torch op per step of the page arithmetic cost more than the freeing."""
        p = self.page_size
        pages = self.full.pages_of(slots)
        if not pages:
            return
        every = torch.tensor([1 + page * p + i for page in pages for i in range(p)], dtype=torch.long)
        self.swa.free(self.full_to_swa[every])
        self.full_to_swa[every] = 0

    def free(self, slots: torch.Tensor) -> None:
        """Free the full pages these slots start or cover, and their windowed slots if alive."""
        self.free_swa(slots)
        self.full.free(slots)
