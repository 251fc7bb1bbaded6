"""KVCacheManager: the allocator, request slot table and radix cache behind one narrow
interface, so the scheduler only asks 'slots for these tokens' and 'this request is done'.

Sliding-window pools (`window=W`: every attention layer sees only keys p with q - p < W, the
mask of ForwardBatch.attn_mask). After each forward the scheduler calls `slide_window(req)`:
every page whose positions are all p <= kv_len - W can be read by no later query of the request
(decode, verify anchor + drafts and the next prefill chunk all query positions >= kv_len), so
it leaves the request and its table entries point at the pad slot 0. The committed kv_len is
used, after a verify's rejected drafts are truncated, so a page a rejected draft sat in is
never confused with one the window left. A request thus holds about W + 2 pages of KV however
long it runs.

Prefix cache rule in window mode (see RadixCache): pages the request owns alone are freed at
once; pages owned by the prefix cache (positions < cached_len, possibly shared) are never freed
by the request, only unlocked, so they stay cached and evictable. Prompts are still cached chunk
by chunk, and finished or retracted requests insert their prefix with the pages they gave up
as tombstones. A prefix is served only while the pages of its last W - 1 positions are alive,
which is all a continuation reads, so a retracted window request resumes without recomputing
its whole history."""
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
                 disable_radix_cache: bool = False, window: int | None = None):
        self.num_slots = num_slots
        self.window = window
        self.allocator = PagedAllocator(num_slots, page_size)
        self.radix = RadixCache(self.allocator, disable=disable_radix_cache, window=window)
        self.req_to_token = ReqToTokenPool(max_requests, max_context)
        self.window_freed_pages = 0     # pages requests gave back to the allocator by sliding

    @property
    def available_tokens(self) -> int:
        return self.allocator.free_slots + self.radix.evictable_size

    @property
    def used_tokens(self) -> int:
        """Slots held by requests or the cache (evictable included)."""
        return self.allocator.num_pages * self.allocator.page_size - self.allocator.free_slots

    def pages_needed(self, req: "Req", n: int) -> int:
        return self.allocator.pages_needed(req.kv_len, n)

    def live_tokens(self, req: "Req") -> int:
        """Slots the request's table still points at (whole pages)."""
        p = self.allocator.page_size
        return -(-req.kv_len // p) * p - req.window_start

    def decode_reserve(self, req: "Req", remaining: int) -> int:
        """Slots to keep free for a running request that may decode `remaining` more tokens:
        one page (retraction covers the rest) under full attention; in window mode what it
        still needs to fill its window (W + 2 pages live at most), so admissions do not
        force retractions later."""
        p = self.allocator.page_size
        if self.window is None:
            return p
        grow = min(remaining, self.window + 2 * p - self.live_tokens(req))
        return max(p, -(-grow // p) * p)

    def admit(self, req: "Req") -> bool:
        """Give a waiting request a table row and its cached prefix (locked)."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.row = row
        # Keep at least one token to compute: the last prompt token's logits pick the first output.
        slots, node = self.radix.match_prefix(req.fill_ids[:-1])
        n = len(slots)
        start = self.radix.window_start(n)
        self.radix.lock(node, start)
        req.last_node, req.lock_start, req.window_start = node, start, start
        req.kv_len = req.cached_len = n
        req.cached_tokens = max(req.cached_tokens, n)
        self.req_to_token.table[row, :start] = 0
        self.req_to_token.table[row, start:n] = slots[start:]
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
            row[first_free:alloc_end] = 0

    def slide_window(self, req: "Req") -> None:
        """Window mode, after req.kv_len grew (and rejected drafts were truncated): give up the
        pages no later query can see. Own pages go back to the allocator; cached ones are
        unlocked (they stay in the prefix cache, evictable)."""
        if self.window is None or req.row is None:
            return
        end = self.radix.window_start(req.kv_len)
        begin = req.window_start
        if end <= begin:
            return
        row = self.req_to_token.table[req.row]
        own = max(begin, req.cached_len)
        if end > own:
            self.allocator.free(row[own:end])
            self.window_freed_pages += (end - own) // self.allocator.page_size
        if req.last_node is not self.radix.root and req.lock_start < req.cached_len:
            keep = min(end, req.cached_len)
            self.radix.lock(req.last_node, keep)
            self.radix.unlock(req.last_node, req.lock_start)
            req.lock_start = keep
            if keep == req.cached_len:            # no cached page left in the window
                req.last_node, req.lock_start = self.radix.root, 0
        row[begin:end] = 0
        req.window_start = end

    def cache_prefix(self, req: "Req") -> None:
        """After a prefill chunk: share the computed prefix with later requests now."""
        if self.radix.disabled:
            return
        n = self.radix.aligned(req.kv_len)
        start = req.window_start
        if n <= req.cached_len or n <= start:
            return
        row = self.req_to_token.table[req.row]
        dups, node, slots = self.radix.insert(req.fill_ids[:n], row[:n].clone())
        self.allocator.free(dups)                 # our pages the cache already held
        row[start:n] = slots[start:]
        self.radix.lock(node, start)
        self.radix.unlock(req.last_node, req.lock_start)
        req.last_node, req.lock_start, req.cached_len = node, start, n

    def release(self, req: "Req") -> None:
        """Finished, aborted or retracted: keep the KV in the cache (evictable), free the rest."""
        if req.row is None:
            return
        row = self.req_to_token.table[req.row]
        n = self.radix.aligned(req.kv_len) if not self.radix.disabled else 0
        own = max(req.cached_len, req.window_start)     # first position whose page is ours
        if n > own:
            dups, _, _ = self.radix.insert(req.fill_ids[:n], row[:n].clone())
            self.allocator.free(dups)
            own = n
        self.allocator.free(row[own:req.kv_len])
        self.radix.unlock(req.last_node, req.lock_start)
        self.req_to_token.free(req.row)
        req.row, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0
        req.window_start = req.lock_start = 0

    def flush(self) -> bool:
        """Drop every cached prefix; refused while requests hold locked nodes."""
        if self.radix.protected_size:
            return False
        self.radix.evict(self.radix.evictable_size)
        self.radix.reset()                        # tombstones too
        return True
