"""Held-out acceptance of a draft from a feature cache, without running the serving loop.

On a cache distilled at temperature 0 the next token of every response position is the target's
greedy choice, so greedy verification of a block accepts slot k exactly when slots 0..k all
equal the cached tokens (with the Markov bias fed the accepted, i.e. cached, previous tokens).
The greedy tau (tokens per cycle, bonus included) is then 1 + the mean accepted prefix over
every response anchor: seconds for hundreds of prompts, against minutes through the engine."""
from __future__ import annotations

import torch

from sparkserve.models.dspark_draft import DSparkDraft
from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.train_dspark import block_forward


@torch.no_grad()
def accepted_prefix(draft: DSparkDraft, tokens: torch.Tensor, taps: torch.Tensor,
                    anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per anchor: how many drafts greedy verification accepts (the matching prefix of the
    block against the cached next tokens), and how many slots have a cached token at all."""
    G = draft.block_size
    _, logits, _, valid, tgt = block_forward(draft, tokens, taps, anchors)
    guess = draft.to_target_ids(logits.argmax(-1)).view(-1, G)
    match = (guess == tokens[tgt].view(-1, G)) & valid
    return torch.cumprod(match.long(), dim=1).sum(1), valid.sum(1)


@torch.no_grad()
def greedy_acceptance(draft: DSparkDraft, cache: FeatureCache, max_seqs: int | None = None,
                      anchors_per_chunk: int = 64) -> dict:
    """{"tau": greedy tokens per cycle over every response anchor, "slot_accept":
    P(slot k accepted | slots < k accepted), "blocks": anchors scored}. Blocks cut by the end
    of a sequence count only their existing slots, as a request at its token limit does."""
    G = draft.block_size
    was_training = draft.training
    draft.eval()
    n_all, v_all = [], []
    for i in range(len(cache) if max_seqs is None else min(max_seqs, len(cache))):
        tokens, taps, _, plen = cache.sequence(i)
        lo, hi = max(plen, 1), len(tokens) - 2
        for start in range(lo, hi + 1, anchors_per_chunk):
            n, v = accepted_prefix(draft, tokens, taps, torch.arange(start, min(start + anchors_per_chunk, hi + 1)))
            n_all.append(n)
            v_all.append(v)
    draft.train(was_training)
    n, v = (torch.cat(x) if x else torch.zeros(0, dtype=torch.long) for x in (n_all, v_all))
    k = torch.arange(G)[None, :]
    reached = ((n[:, None] >= k) & (k < v[:, None])).sum(0)
    accepted = (n[:, None] > k).sum(0)
    return {"tau": 1 + float(n.float().mean()) if len(n) else 1.0,
            "slot_accept": (accepted / reached.clamp_min(1)).tolist(), "blocks": len(n)}
