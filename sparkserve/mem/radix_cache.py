"""Radix prefix cache: token sequences -> KV slots, shared between requests.

Keys are compared a page at a time, so every cached prefix covers whole pages and a page is
never shared partially. Nodes on a running request's path are locked; unlocked nodes are
evicted least-recently-used first when the allocator runs dry.

Sliding-window models (`window=W`, every layer windowed; SGLang's SWA radix tree): a
continuation at position e reads only the keys of positions > e - W, so a cached prefix is
usable as long as the pages of its last W - 1 positions are present. Eviction may therefore
free an internal node too: it becomes a tombstone (`dead`, value all pad slot 0) that keeps
its key so deeper prefixes stay reachable, and `match_prefix` serves the longest prefix whose
trailing window is alive. A request locks only the nodes of its live window
(`lock(node, start)`), so pages that slide out of its window become evictable.

Models mixing full and windowed layers (`swa_window=W`, a SplitAllocator; SGLang's SWA radix
tree): the same rule on the windowed layers' KV. A node has two lock counts: `lock_ref` over a
request's whole path (full layers read every position) and `swa_lock_ref` over its live window
only. Eviction frees unlocked leaves (full and windowed slots), and, when windowed slots run
short, tombstones nodes whose windowed slots no window holds (`dead`: windowed slots freed,
full slots kept)."""
from __future__ import annotations

import heapq
import itertools

import torch

from sparkserve.mem.allocator import PagedAllocator, SplitAllocator

_tick = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "swa_lock_ref", "last_access",
                 "start", "dead")

    def __init__(self, parent: "TreeNode | None" = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None, start: int = 0):
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key or []
        self.value = value if value is not None else torch.empty(0, dtype=torch.long)
        self.lock_ref = 0
        self.swa_lock_ref = 0     # split pool: requests whose window covers this node
        self.last_access = next(_tick)
        self.start = start        # position of key[0] in the full sequence
        self.dead = False         # tombstone: (windowed) KV freed, key kept

    @property
    def end(self) -> int:
        return self.start + len(self.key)


class RadixCache:
    def __init__(self, allocator: "PagedAllocator | SplitAllocator", disable: bool = False,
                 window: int | None = None, swa_window: int | None = None):
        self.allocator = allocator
        self.page = allocator.page_size
        self.disabled = disable
        self.window = window            # every layer windowed: a tombstone holds no KV at all
        self.swa_window = swa_window    # split pool: a tombstone keeps its full slots
        self.split = swa_window is not None
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.evictable_size = 0         # full slots of unlocked nodes
        self.protected_size = 0
        self.swa_evictable_size = 0     # split pool: windowed slots no window holds
        self.swa_protected_size = 0

    def _account(self, node: TreeNode, sign: int) -> None:
        """Add (+1) or remove (-1) a node's slots to the evictable or protected totals."""
        n = sign * len(node.key)
        if self.split or not node.dead:
            if node.lock_ref:
                self.protected_size += n
            else:
                self.evictable_size += n
        if self.split and not node.dead:
            if node.swa_lock_ref:
                self.swa_protected_size += n
            else:
                self.swa_evictable_size += n

    def aligned(self, n: int) -> int:
        return n // self.page * self.page

    def window_start(self, n: int) -> int:
        """First page-aligned position that a (windowed layer's) query at position >= n can
        still see (0 for full attention): every position of every page before it is p <= n - W."""
        w = self.window if self.window is not None else self.swa_window
        if w is None:
            return 0
        return self.aligned(max(0, n - w + 1))

    def _child_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[:self.page])

    def _common(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return self.aligned(n)

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Slots of the longest cached page-aligned prefix of `key` whose trailing window is
        alive (window mode: pad slot 0 for tombstoned positions before it), and its last node."""
        if self.disabled:
            return torch.empty(0, dtype=torch.long), self.root
        key = key[:self.aligned(len(key))]
        node, path = self.root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._common(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            node = child
            key = key[n:]
        usable, alive_from = 0, 0
        for i, n in enumerate(path):
            if n.dead:
                alive_from = n.end
            elif alive_from <= self.window_start(n.end):
                usable = i + 1
        path = path[:usable]
        node = path[-1] if path else self.root
        stamp = next(_tick)
        walk = node
        while walk is not None:
            walk.last_access = stamp
            walk = walk.parent
        return (torch.cat([n.value for n in path]) if path else torch.empty(0, dtype=torch.long)), node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        mid = TreeNode(child.parent, child.key[:n], child.value[:n], child.start)
        mid.lock_ref, mid.swa_lock_ref = child.lock_ref, child.swa_lock_ref
        mid.dead, mid.last_access = child.dead, child.last_access
        child.parent.children[self._child_key(child.key)] = mid
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        child.start += n
        mid.children[self._child_key(child.key)] = child
        return mid

    def _split_at(self, node: TreeNode, pos: int) -> None:
        """Make `pos` a node boundary on the path from the root to `node`."""
        while node is not self.root and node.end > pos:
            if node.start < pos:
                self._split(node, pos - node.start)
                return
            node = node.parent

    def insert(self, key: list[int], value: torch.Tensor, alive_from: int | None = None
               ) -> tuple[torch.Tensor, TreeNode, torch.Tensor]:
        """Insert a page-aligned key. Window mode: `value` may start with pad slots (0) where the
        caller gave its pages up; split pool: `alive_from` says from which position the caller's
        own slots still have windowed KV. The positions before become tombstones unless already
        cached. Returns (the caller's slots that duplicate cached ones: the caller frees them,
        the node ending at len(key), the cache's slots for the whole key)."""
        assert len(key) == len(value) and len(key) % self.page == 0
        if alive_from is None:
            live = torch.nonzero(value).flatten()
            z = int(live[0]) if live.numel() else len(key)   # value[:z] are pad slots, the rest live
            assert z % self.page == 0 and bool((value[z:] != 0).all()), "pad slots only as a prefix"
        else:
            z = min(alive_from, len(key))
            assert z % self.page == 0 and bool((value != 0).all())
        node, done = self.root, 0
        dups: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                if done < z:     # positions without (windowed) KV: a tombstone before our live pages
                    dead = TreeNode(node, key[done:z], value[done:z].clone(), done)
                    dead.dead = True
                    node.children[self._child_key(rest)] = dead
                    self._account(dead, +1)      # split: the cache now holds our full slots
                    out.append(dead.value)
                    node, done, rest = dead, z, key[z:]
                    if not rest:
                        break
                new = TreeNode(node, list(rest), value[done:].clone(), done)
                node.children[self._child_key(rest)] = new
                self._account(new, +1)
                out.append(new.value)
                node, done = new, len(key)
                break
            n = self._common(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            if child.start < z < child.end:
                child = self._split(child, z - child.start)
            seg = value[done:child.end]
            mine = seg != child.value            # positions where the caller holds its own slots
            if done >= z and child.dead:         # revive a tombstone with our KV
                self._account(child, -1)
                if self.split:                   # our windowed slots move to the cache's full slots
                    assert bool(mine.all()), "reviving a tombstone with its own slots"
                    f2s = self.allocator.full_to_swa
                    f2s[child.value] = f2s[seg]
                    f2s[seg] = 0
                    dups.append(seg)
                else:                            # the cache now owns our pages
                    child.value = seg.clone()
                child.dead = False
                self._account(child, +1)
            elif done >= z or self.split:        # split, before z: our full slots without windowed KV
                dups.append(seg[mine])
            out.append(child.value)
            child.last_access = next(_tick)
            node = child
            done = child.end
        freed = torch.cat(dups) if dups else torch.empty(0, dtype=torch.long)
        return freed, node, (torch.cat(out) if out else torch.empty(0, dtype=torch.long))

    def lock(self, node: TreeNode, start: int = 0) -> None:
        """Protect the nodes from `start` (made a node boundary) to `node` from eviction. Split
        pool: the whole path for the full layers, from `start` for the windowed ones."""
        if start:
            self._split_at(node, start)
        self._add_locks(node, start, +1)

    def unlock(self, node: TreeNode, start: int = 0) -> None:
        """Undo `lock(node, start)` (splits since then are covered: halves inherit locks)."""
        self._add_locks(node, start, -1)

    def move_lock(self, node: TreeNode, old: int, new: int) -> None:
        """`lock(node, new)` then `unlock(node, old)` for old <= new (a window sliding over a cached
        prefix, every step), touching only the nodes whose locks change: those starting in [old, new)
        give up their windowed lock (split pool) or their lock (window mode). The walk stops below
        `old`, so a step costs the nodes the window passed, not the whole path to the root, which
        per-step splits make as long as the cached prefix."""
        assert old <= new
        if new:
            self._split_at(node, new)
        while node is not self.root and node.start >= old:
            if node.start < new:
                self._account(node, -1)
                if self.split:
                    node.swa_lock_ref -= 1
                else:
                    node.lock_ref -= 1
                assert node.lock_ref >= 0 and node.swa_lock_ref >= 0
                self._account(node, +1)
            node = node.parent

    def _add_locks(self, node: TreeNode, start: int, sign: int) -> None:
        while node is not self.root and (self.split or node.start >= start):
            swa = self.split and node.start >= start
            assert not (node.dead and (swa or not self.split)), "locking a tombstone"
            self._account(node, -1)
            node.lock_ref += sign
            node.swa_lock_ref += sign if swa else 0
            assert node.lock_ref >= 0 and node.swa_lock_ref >= 0
            self._account(node, +1)
            node = node.parent

    def evict(self, num_tokens: int, swa_tokens: int = 0) -> int:
        """Free at least `num_tokens` slots (and, split pool, `swa_tokens` windowed slots) from
        unlocked nodes, oldest first; returns the slots freed. Full attention and split pools
        free leaves only (a prefix needs all its full pages); window mode also tombstones
        internal nodes, and a split pool short of windowed slots tombstones any node's
        windowed part that no window holds."""
        window = self.window is not None
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if n.lock_ref == 0 and not (window and n.dead) and (window or not n.children)]
        heapq.heapify(heap)
        freed = swa_freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            if (window and node.dead) or node.lock_ref:
                continue
            self.allocator.free(node.value)         # split: its windowed slots too
            self._account(node, -1)
            freed += len(node.key)
            swa_freed += len(node.key) if self.split and not node.dead else 0
            if node.children:                       # window mode: keep the key as a tombstone
                node.value, node.dead = torch.zeros_like(node.value), True
                continue
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            while window and parent is not self.root and not parent.children and parent.dead:
                grand = parent.parent
                del grand.children[self._child_key(parent.key)]
                parent = grand
            if not window and parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if self.split and swa_freed < swa_tokens:
            nodes = sorted((n for n in self._nodes() if not n.dead and n.swa_lock_ref == 0),
                           key=lambda n: n.last_access)
            for node in nodes:
                if swa_freed >= swa_tokens:
                    break
                self.allocator.free_swa(node.value)
                self._account(node, -1)
                node.dead = True
                self._account(node, +1)
                swa_freed += len(node.key)
        return freed

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
