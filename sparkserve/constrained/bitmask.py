"""Token bitmasks on logits: only the constrained rows of a batch are masked (a copy: the raw
logits stay as they are for anyone else), so unconstrained rows sample exactly as without them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sparkserve.core.req import Req


def allowed_ids(bits: Tensor, vocab: int) -> np.ndarray:
    """bits [n, words] int32 (host) -> bool [n, vocab], True where the token is allowed. Bit t of
    word w is token 32w + t: the words' little-endian bytes unpack in token order."""
    packed = bits.numpy().view(np.uint8)
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(np.bool_)


def mask_rows(logits: Tensor, bits: Tensor) -> Tensor:
    """logits [n, V] with the tokens `bits` [n, words] disallow at -inf (a new tensor). On the CPU
    in numpy: a torch op here would wake its OpenMP threads between two steps of the kernels' own
    pool, which costs several times the op (measured: 10x the masking time, and the step slower)."""
    allowed = allowed_ids(bits, logits.shape[-1])
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))
    return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))


@dataclass
class GrammarMask:
    """The constrained rows of one batch and their bitmasks (host int32 [len(rows), words])."""

    rows: list[int]
    bits: Tensor

    def apply(self, logits: Tensor) -> Tensor:
        """A copy of logits [B, V] with the constrained rows masked."""
        if len(self.rows) == logits.shape[0]:           # rows are 0..B-1 in order
            return mask_rows(logits, self.bits)
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
