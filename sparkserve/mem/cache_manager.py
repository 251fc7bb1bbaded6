"""KVCacheManager: the allocator, request slot table and radix cache behind one narrow
interface, so the scheduler only asks 'slots for these tokens' and 'this request is done'.

Sliding-window pools (`window=W`: every attention layer sees only keys p with q - p < W, the
mask of ForwardBatch.attn_mask). After each forward the scheduler calls `slide_window(req)`
(`slide_windows(reqs)` for a decode step's batch):
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
its whole history.

Split pools (`swa_window=W`: the model mixes full and windowed layers; SGLang's SWA pool): the
windowed layers' K/V live in a second slot space (SplitAllocator), so the table and the prefix
cache keep full slots for every position and only the windowed slots slide: `slide_window`
gives up the windowed slots of the request's own pages that left the window, and unlocks the
windowed part of cached pages that did (the full part stays locked: full layers read it all).
The prefix rule above holds for the windowed slots. Memory is checked in both spaces: the full
one as for full attention, the windowed one as in window mode."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparkserve.mem.allocator import PagedAllocator, SplitAllocator
from sparkserve.mem.radix_cache import RadixCache
from sparkserve.mem.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from sparkserve.core.req import Req


class KVCacheManager:
    def __init__(self, num_slots: int, page_size: int, max_requests: int, max_context: int,
                 disable_radix_cache: bool = False, window: int | None = None,
                 swa_slots: int = 0, swa_window: int | None = None):
        self.num_slots = num_slots
        self.window = window
        self.swa_window = swa_window if swa_slots else None     # split pool
        self.swa_slots = swa_slots if self.swa_window is not None else 0
        self.allocator = (SplitAllocator(num_slots, swa_slots, page_size) if self.swa_window is not None
                          else PagedAllocator(num_slots, page_size))
        self.radix = RadixCache(self.allocator, disable=disable_radix_cache, window=window,
                                swa_window=self.swa_window)
        self.req_to_token = ReqToTokenPool(max_requests, max_context)
        self.window_freed_pages = 0     # pages requests gave back to the allocator by sliding

    @property
    def split(self) -> bool:
        return self.swa_window is not None

    @property
    def full_to_swa(self) -> torch.Tensor | None:
        """Split pool: windowed layers' slot of every full slot (for the ModelRunner)."""
        return self.allocator.full_to_swa if self.split else None

    @property
    def available_tokens(self) -> int:
        return self.allocator.free_slots + self.radix.evictable_size

    @property
    def swa_available_tokens(self) -> int:
        return self.allocator.swa_free_slots + self.radix.swa_evictable_size if self.split else 0

    def room(self, need: int, running: list[tuple["Req", int]] = (), freed: tuple[int, int] = (0, 0)) -> bool:
        """Whether `need` more slots can be had now (evicting cached prefixes) while every
        (request, tokens it may still decode) in `running` keeps its decode reserve; `freed`:
        (full, windowed) slots that would become available first (`freed_by` some requests)."""
        reserve = sum(self.decode_reserve(r, remaining) for r, remaining in running)
        if not self.split:
            return need + reserve <= self.available_tokens + freed[0]
        return (need + self.allocator.page_size * len(running) <= self.available_tokens + freed[0]
                and need + reserve <= self.swa_available_tokens + freed[1])

    def freed_by(self, reqs: list["Req"]) -> tuple[int, int]:
        """(full, windowed) slots that releasing running `reqs` would make available, before
        releasing any: the pages they own, and the cached prefixes no other request locks (their
        KV stays cached, evictable). Priority preemption asks it, so as to preempt only a set of
        requests that makes room."""
        p, full, swa = self.allocator.page_size, 0, 0
        locks: dict = {}          # node -> [their locks on it, their windowed locks on it]
        for r in reqs:
            if r.row is None:
                continue
            end = -(-r.kv_len // p) * p
            full += end - (r.cached_len if self.split else max(r.cached_len, r.window_start))
            swa += end - max(r.cached_len, r.window_start) if self.split else 0
            node, root = r.last_node, self.radix.root
            while node is not None and node is not root and (self.split or node.start >= r.lock_start):
                held = locks.setdefault(node, [0, 0])
                held[0] += 1
                held[1] += int(self.split and node.start >= r.lock_start)
                node = node.parent
        for node, (n, n_swa) in locks.items():
            if node.lock_ref == n and (self.split or not node.dead):
                full += len(node.key)
            if n_swa and node.swa_lock_ref == n_swa and not node.dead:
                swa += len(node.key)
        return full, swa

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
        one page (retraction covers the rest) under full attention; in window mode (split pool:
        in the windowed space) what it still needs to fill its window (W + 2 pages live at
        most), so admissions do not force retractions later."""
        p = self.allocator.page_size
        window = self.window if self.window is not None else self.swa_window
        if window is None:
            return p
        grow = min(remaining, window + 2 * p - self.live_tokens(req))
        return max(p, -(-grow // p) * p)

    def admit(self, req: "Req") -> bool:
        """Give a waiting request a table row and its cached prefix (locked)."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.row = row
        # Keep at least one token to compute (the last prompt token's logits pick the first
        # output), and the rows of owed prompt logprobs (Req.max_cached_prefix).
        slots, node = self.radix.match_prefix(req.fill_ids[:req.max_cached_prefix])
        n = len(slots)
        start = self.radix.window_start(n)
        self.radix.lock(node, start)                 # split: the whole path for the full layers
        req.last_node, req.lock_start, req.window_start = node, start, start
        req.kv_len = req.cached_len = n
        req.cached_tokens = max(req.cached_tokens, n)
        first = 0 if self.split else start           # split: the table keeps every full slot
        self.req_to_token.table[row, :first] = 0
        self.req_to_token.table[row, first:n] = slots[first:]
        return True

    def alloc(self, req: "Req", n: int) -> torch.Tensor | None:
        """Slots for the request's next n tokens, evicting cached prefixes if needed."""
        # the slot of the last token matters only inside its page (never read at page size 1)
        inside = req.kv_len % self.allocator.page_size
        last = int(self.req_to_token.table[req.row, req.kv_len - 1]) if inside else 0
        slots = self.allocator.alloc(req.kv_len, n, last)
        if slots is None:
            need = self.allocator.pages_needed(req.kv_len, n) * self.allocator.page_size
            self.radix.evict(need - self.allocator.free_slots,
                             need - self.allocator.swa_free_slots if self.split else 0)
            slots = self.allocator.alloc(req.kv_len, n, last)
        if slots is not None:
            self.req_to_token.table[req.row, req.kv_len:req.kv_len + n] = slots
        return slots

    def alloc_decode(self, asks: list[tuple["Req", int]]) -> list[torch.Tensor | None]:
        """`alloc(req, n)` for each (req, n) of a decode step, with one allocator call and one
        table write for all of them when free pages suffice (else one by one, evicting)."""
        p = self.allocator.page_size
        table = self.req_to_token.table
        inside = [i for i, (r, _) in enumerate(asks) if r.kv_len % p]   # none at page size 1
        last = [0] * len(asks)
        if inside:
            rows = torch.tensor([asks[i][0].row for i in inside])
            cols = torch.tensor([asks[i][0].kv_len - 1 for i in inside])
            for i, s in zip(inside, table[rows, cols].tolist()):
                last[i] = s
        flat = self.allocator.alloc_many([(r.kv_len, n, s) for (r, n), s in zip(asks, last)])
        if flat is None:
            return [self.alloc(r, n) for r, n in asks]
        width = table.shape[1]
        at = [r.row * width + r.kv_len + j for r, n in asks for j in range(n)]
        table.view(-1)[torch.tensor(at, dtype=torch.long)] = flat
        return list(flat.split([n for _, n in asks]))

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
        unlocked (they stay in the prefix cache, evictable). Split pool: the same for the
        windowed slots only; the table and the full-layer locks stay."""
        self.slide_windows([req])

    def slide_windows(self, reqs: list["Req"]) -> None:
        """`slide_window` for each of a step's requests, with one read of the table and one
        allocator call for the pages all of them give up (a window passes a page or so per
        decode step: torch ops per request cost more than the freeing)."""
        if self.window is None and not self.split:
            return
        table = self.req_to_token.table
        width, p = table.shape[1], self.allocator.page_size
        moved, own_at, passed_at = [], [], []     # (req, end); flat table indices freed; zeroed
        for req in reqs:
            if req.row is None:
                continue
            end = self.radix.window_start(req.kv_len)
            begin = req.window_start
            if end <= begin:
                continue
            base = req.row * width
            own = max(begin, req.cached_len)
            own_at.extend(range(base + own, base + end))
            self.window_freed_pages += max(0, end - own) // p
            if not self.split:
                passed_at.extend(range(base + begin, base + end))
            moved.append((req, end))
        if not moved:
            return
        if own_at:
            own_slots = table.view(-1)[torch.tensor(own_at, dtype=torch.long)]
            if self.split:
                self.allocator.free_swa(own_slots)
            else:
                self.allocator.free(own_slots)
        for req, end in moved:
            if req.last_node is not self.radix.root and req.lock_start < req.cached_len:
                keep = min(end, req.cached_len)
                self.radix.move_lock(req.last_node, req.lock_start, keep)
                req.lock_start = keep
                if keep == req.cached_len and not self.split:   # no cached page left in the window
                    req.last_node, req.lock_start = self.radix.root, 0
            req.window_start = end
        if passed_at:
            table.view(-1)[torch.tensor(passed_at, dtype=torch.long)] = 0

    def cache_prefix(self, req: "Req") -> None:
        """After a prefill chunk: share the computed prefix with later requests now."""
        if self.radix.disabled:
            return
        n = self.radix.aligned(req.kv_len)
        start = req.window_start
        if n <= req.cached_len or n <= start:
            return
        row = self.req_to_token.table[req.row]
        dups, node, slots = self.radix.insert(req.fill_ids[:n], row[:n].clone(),
                                              alive_from=start if self.split else None)
        self.allocator.free(dups)                 # our pages the cache already held
        first = 0 if self.split else start
        row[first:n] = slots[first:]
        self.radix.lock(node, start)
        self.radix.unlock(req.last_node, req.lock_start)
        req.last_node, req.lock_start, req.cached_len = node, start, n

    def release(self, req: "Req") -> None:
        """Finished, aborted or retracted: keep the KV in the cache (evictable), free the rest."""
        if req.row is None:
            return
        row = self.req_to_token.table[req.row]
        n = self.radix.aligned(req.kv_len) if not self.radix.disabled else 0
        # first position whose page is ours (split: the table keeps our full slots throughout)
        own = req.cached_len if self.split else max(req.cached_len, req.window_start)
        if n > own:
            dups, _, _ = self.radix.insert(req.fill_ids[:n], row[:n].clone(),
                                           alive_from=req.window_start if self.split else None)
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
