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
        need = self.pages_needed(cur_len, n)
        if need > len(self.free_pages):
            return None
        p = self.page_size
        slots = []
        in_page = cur_len % p
        if in_page:
            take = min(p - in_page, n)
            slots.append(torch.arange(last_slot + 1, last_slot + 1 + take))
            n -= take
        for _ in range(need):
            page = self.free_pages.pop()
            take = min(p, n)
            slots.append(torch.arange(1 + page * p, 1 + page * p + take))
            n -= take
        return torch.cat(slots) if slots else torch.empty(0, dtype=torch.long)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages these slots start or cover (callers pass whole pages' slots); pad
        slot 0 (a position whose page was already given up) is skipped."""
        slots = slots[slots > 0]
        if slots.numel() == 0:
            return
        pages = torch.unique((slots - 1) // self.page_size)
        self.free_pages.extend(pages.tolist())
