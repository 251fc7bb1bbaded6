"""Radix prefix cache: token sequences -> KV slots, shared between requests.

Keys are compared a page at a time, so every cached prefix covers whole pages and a page is
never shared partially. Nodes on a running request's path are locked; unlocked leaves are
evicted least-recently-used first when the allocator runs dry."""
from __future__ import annotations

import heapq
import itertools

import torch

from sparkserve.mem.allocator import PagedAllocator

_tick = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "TreeNode | None" = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None):
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key or []
        self.value = value if value is not None else torch.empty(0, dtype=torch.long)
        self.lock_ref = 0
        self.last_access = next(_tick)


class RadixCache:
    def __init__(self, allocator: PagedAllocator, disable: bool = False):
        self.allocator = allocator
        self.page = allocator.page_size
        self.disabled = disable
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def aligned(self, n: int) -> int:
        return n // self.page * self.page

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
        """Slots of the longest cached page-aligned prefix of `key`, and its last node."""
        if self.disabled:
            return torch.empty(0, dtype=torch.long), self.root
        key = key[:self.aligned(len(key))]
        node, values = self.root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._common(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node = child
            key = key[n:]
        stamp = next(_tick)
        walk = node
        while walk is not None:
            walk.last_access = stamp
            walk = walk.parent
        return (torch.cat(values) if values else torch.empty(0, dtype=torch.long)), node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        mid = TreeNode(child.parent, child.key[:n], child.value[:n])
        mid.lock_ref = child.lock_ref
        child.parent.children[self._child_key(child.key)] = mid
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        mid.children[self._child_key(child.key)] = child
        return mid

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert a page-aligned key; returns how many leading tokens were already cached
        (the caller frees its own duplicate slots for them)."""
        assert len(key) == len(value) and len(key) % self.page == 0
        node, done = self.root, 0
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                new = TreeNode(node, list(rest), value[done:].clone())
                node.children[self._child_key(rest)] = new
                self.evictable_size += len(rest)
                return done
            n = self._common(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_tick)
            node = child
            done += n
        return done

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, oldest first; returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out
