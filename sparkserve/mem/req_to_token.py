"""Request slot table: row per running request, column per position -> KV slot id."""
from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int):
        self.table = torch.zeros(max_requests, max_context, dtype=torch.long)
        self.free_rows = list(range(max_requests - 1, -1, -1))

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    @property
    def available(self) -> int:
        return len(self.free_rows)
