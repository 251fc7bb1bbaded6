"""KVCacheManager: the allocator, request slot table and radix cache behind one narrow
interface, so the scheduler only asks 'slots for these tokens' and 'this request is done'."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparkserve.mem.allocator import PagedAllocator
from sparkserve.mem.radix_cache import RadixCache
from sparkserve.mem.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from sparkserve.scheduler.req import Req


class KVCacheManager:
    def __init__(self, num_slots: int, page_size: int, max_requests: int, max_context: int,
                 disable_radix_cache: bool = False):
        self.num_slots = num_slots
        self.allocator = PagedAllocator(num_slots, page_size)
        self.radix = RadixCache(self.allocator, disable=disable_radix_cache)
        self.req_to_token = ReqToTokenPool(max_requests, max_context)

    @property
    def available_tokens(self) -> int:
        return self.allocator.free_slots + self.radix.evictable_size

    @property
    def used_tokens(self) -> int:
        """Slots held by requests or the cache (evictable included)."""
        return self.allocator.num_pages * self.allocator.page_size - self.allocator.free_slots

    def pages_needed(self, req: "Req", n: int) -> int:
        return self.allocator.pages_needed(req.kv_len, n)

    def admit(self, req: "Req") -> bool:
        """Give a waiting request a table row and its cached prefix (locked)."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.row = row
        # Keep at least one token to compute: the last prompt token's logits pick the first output.
        slots, node = self.radix.match_prefix(req.fill_ids[:-1])
        self.radix.lock(node)
        req.last_node = node
        req.kv_len = req.cached_len = len(slots)
        req.cached_tokens = max(req.cached_tokens, len(slots))
        self.req_to_token.table[row, :len(slots)] = slots
        return True

    def alloc(self, req: "Req", n: int) -> torch.Tensor | None:
        """Slots for the request's next n tokens, evicting cached prefixes if needed."""
        last = int(self.req_to_token.table[req.row, req.kv_len - 1]) if req.kv_len else 0
        slots = self.allocator.alloc(req.kv_len, n, last)
        if slots is None:
            need = self.allocator.pages_needed(req.kv_len, n) * self.allocator.page_size
            self.radix.evict(need - self.allocator.free_slots)
            slots = self.allocator.alloc(req.kv_len, n, last)
        if slots is not None:
            self.req_to_token.table[req.row, req.kv_len:req.kv_len + n] = slots
        return slots

    def truncate(self, req: "Req", alloc_end: int) -> None:
        """Free the slots of positions req.kv_len..alloc_end-1 (rejected drafts), page-wise: a
        page still holding a kept token stays with the request."""
        if alloc_end <= req.kv_len:
            return
        row = self.req_to_token.table[req.row]
        p = self.allocator.page_size
        first_free = -(-req.kv_len // p) * p          # first position of the next page
        if first_free < alloc_end:
            self.allocator.free(row[first_free:alloc_end])

    def cache_prefix(self, req: "Req") -> None:
        """After a prefill chunk: share the computed prefix with later requests now."""
        if self.radix.disabled:
            return
        n = self.radix.aligned(req.kv_len)
        if n <= req.cached_len:
            return
        row = self.req_to_token.table[req.row]
        existing = self.radix.insert(req.fill_ids[:n], row[:n].clone())
        self.allocator.free(row[req.cached_len:existing])          # our duplicates
        slots, node = self.radix.match_prefix(req.fill_ids[:n])
        row[:n] = slots
        self.radix.lock(node)
        self.radix.unlock(req.last_node)
        req.last_node, req.cached_len = node, n

    def release(self, req: "Req") -> None:
        """Finished, aborted or retracted: keep the KV in the cache (evictable), free the rest."""
        if req.row is None:
            return
        row = self.req_to_token.table[req.row]
        n = self.radix.aligned(req.kv_len) if not self.radix.disabled else 0
        start = req.cached_len
        if n > req.cached_len:
            existing = self.radix.insert(req.fill_ids[:n], row[:n].clone())
            self.allocator.free(row[req.cached_len:existing])
            start = n
        self.allocator.free(row[start:req.kv_len])
        self.radix.unlock(req.last_node)
        self.req_to_token.free(req.row)
        req.row, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0

    def flush(self) -> bool:
        """Drop every cached prefix; refused while requests hold locked nodes."""
        if self.radix.protected_size:
            return False
        self.radix.evict(self.radix.evictable_size)
        return True
