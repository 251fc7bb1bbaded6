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


def move_to_vocab(old, new, target_head: torch.Tensor) -> None:
    """Copy draft `old` into `new`, a draft of the same shape with another reduced vocab (more
    data picks a better one). Weights over the vocab keep the rows of ids `old` knew. A new id's
    LM-head row is the target's row plus the drift `old`'s trained rows show from the target's
    (a least-squares linear fit, zero for a frozen head); its Markov bias row starts at zero."""
    def ids(d):
        return d.to_target_ids(torch.arange(d.config.out_vocab))
    old_ids, new_ids = ids(old), ids(new)
    by_vocab = ("lm_head.weight", "markov_head.markov_w2.weight", "d2t")
    shared = tuple(f"{m}." for m in old.shared_with_target)    # the target's modules: nothing to copy
    new.load_state_dict({k: v for k, v in old.state_dict().items()
                         if k not in by_vocab and not k.startswith(shared)}, strict=False)
    t_old, t_new = target_head[old_ids].float(), target_head[new_ids].float()
    drift = torch.linalg.lstsq(t_old, old.lm_head.weight.detach().float() - t_old).solution
    head = t_new + t_new @ drift
    w2 = torch.zeros_like(new.markov_head.markov_w2.weight)
    pos = torch.full((target_head.shape[0],), -1, dtype=torch.long)
    pos[old_ids] = torch.arange(len(old_ids))
    known = pos[new_ids] >= 0
    head[known] = old.lm_head.weight.detach().float()[pos[new_ids][known]]
    w2[known] = old.markov_head.markov_w2.weight.detach()[pos[new_ids][known]]
    with torch.no_grad():
        new.lm_head.weight.copy_(head)
        new.markov_head.markov_w2.weight.copy_(w2)
