"""Token bitmasks on logits: only the constrained rows of a batch are masked (a copy: the raw
logits stay as they are for anyone else), so unconstrained rows sample exactly as without them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparkserve.core.req import Req

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_ids(bits: Tensor, vocab: int, device: torch.device) -> Tensor:
    """bits [n, words] int32 -> bool [n, vocab], True where the token is allowed."""
    b = bits.to(device)
    expanded = (b[:, :, None] >> _SHIFTS.to(device)) & 1
    return expanded.view(b.shape[0], -1)[:, :vocab].bool()


def mask_rows(logits: Tensor, bits: Tensor) -> Tensor:
    """logits [n, V] with the tokens `bits` [n, words] disallow at -inf (a new tensor)."""
    return logits.masked_fill(~allowed_ids(bits, logits.shape[-1], logits.device), float("-inf"))


@dataclass
class GrammarMask:
    """The constrained rows of one batch and their bitmasks (host int32 [len(rows), words])."""

    rows: list[int]
    bits: Tensor

    def apply(self, logits: Tensor) -> Tensor:
        """A copy of logits [B, V] with the constrained rows masked."""
        out = logits.clone()
        idx = torch.tensor(self.rows, device=logits.device)
        out[idx] = mask_rows(logits[idx], self.bits)
        return out


def batch_mask(reqs: Sequence[Req]) -> GrammarMask | None:
    """The mask of the requests' next tokens (row i: reqs[i]); None when none is constrained."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return None
    bits = torch.empty(len(rows), reqs[rows[0]].grammar.words, dtype=torch.int32)
    for j, i in enumerate(rows):
        reqs[i].grammar.fill(bits, j, reqs[i].output_ids)
    return GrammarMask(rows, bits)
