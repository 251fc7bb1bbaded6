"""Reduced draft vocab: the draft scores only the ids the target actually emits, so its LM head
(the largest part of a small draft's cost, in training and serving) shrinks several-fold."""
from __future__ import annotations

import torch


def select_draft_vocab(counts: torch.Tensor, size: int, always: list[int] = ()) -> tuple[torch.Tensor, float]:
    """The `size` most frequent ids (plus `always`, e.g. EOS), sorted; and the fraction of
    target tokens they cover."""
    if size >= counts.numel():
        return torch.arange(counts.numel()), 1.0
    keep = set(int(i) for i in always)
    order = torch.argsort(counts, descending=True, stable=True).tolist()
    for i in order:
        if len(keep) >= size:
            break
        keep.add(i)
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    total = int(counts.sum())
    return ids, (float(counts[ids].sum()) / total if total else 1.0)
