"""Closed-form start for the Markov head: W2 W1[x] fitted to the response bigrams.

The Markov bias is a rank-r bigram term on the slot logits. Fitting it to the centred log
bigram probabilities of the training responses (truncated SVD) gives the draft a bigram model
on step 0, so the few steps a CPU can afford go into what the backbone adds on top."""
from __future__ import annotations

import numpy as np
import torch

from sparkserve.models.dspark_draft import DSparkDraft
from sparkserve.training.feature_cache import FeatureCache


def response_bigrams(cache: FeatureCache) -> tuple[np.ndarray, np.ndarray]:
    """(prev, next) target ids for every response token (prev may be the last prompt token)."""
    prev, nxt = [], []
    for i in range(len(cache)):
        toks, p = cache.token_ids(i)
        start = max(p, 1)
        prev.append(toks[start - 1:-1])
        nxt.append(toks[start:])
    return np.concatenate(prev), np.concatenate(nxt)


@torch.no_grad()
def fit_markov_head(draft: DSparkDraft, cache: FeatureCache, max_prev: int = 8192,
                    smoothing: float = 1.0, scale: float = 1.0) -> float:
    """Set markov_w1 / markov_w2 from the bigram statistics; returns the fraction of the
    centred log-probability energy the rank-r fit keeps."""
    cfg = draft.config
    r, vd = cfg.markov_rank, cfg.out_vocab
    prev, nxt = response_bigrams(cache)
    ids = draft.to_target_ids(torch.arange(vd)).numpy()
    t2d = np.full(cfg.vocab_size, -1, dtype=np.int64)
    t2d[ids] = np.arange(vd)
    keep = t2d[nxt] >= 0
    prev, nxt_d = prev[keep], t2d[nxt[keep]]
    uniq, pcount = np.unique(prev, return_counts=True)
    rows = uniq[np.argsort(-pcount, kind="stable")[:max_prev]]
    row_of = np.full(cfg.vocab_size, -1, dtype=np.int64)
    row_of[rows] = np.arange(len(rows))
    sel = row_of[prev] >= 0
    counts = torch.zeros(len(rows), vd)
    counts.index_put_((torch.from_numpy(row_of[prev[sel]]), torch.from_numpy(nxt_d[sel])),
                      torch.ones(int(sel.sum())), accumulate=True)
    unigram = counts.sum(0) + 1.0
    unigram /= unigram.sum()
    # `smoothing` pseudo-counts per row, spread like the unigram distribution
    logp = torch.log((counts + smoothing * unigram) / (counts.sum(1, keepdim=True) + smoothing))
    logp -= logp.mean(1, keepdim=True)            # softmax ignores a per-row shift
    q = min(r, min(logp.shape))
    # svd_lowrank draws a random projection: a fixed seed makes the start the same in every
    # run and on every rank (a run's losses then do not depend on what ran before it)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        U, S, V = torch.svd_lowrank(logp, q=q, niter=4)
    root = S.sqrt() * scale ** 0.5
    w1 = torch.zeros(cfg.vocab_size, r)
    w1[torch.from_numpy(rows), :q] = U * root
    w2 = torch.zeros(vd, r)
    w2[:, :q] = V * root
    head = draft.markov_head
    head.markov_w1.weight.copy_(w1)
    head.markov_w2.weight.copy_(w2)
    return float((S ** 2).sum() / (logp ** 2).sum())
