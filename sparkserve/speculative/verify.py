"""Accept rules for speculative verification (lossless).

Greedy: accept the longest prefix of drafts equal to the target's argmax; the bonus token is
the target's argmax at the first mismatch (or after the last draft).
Sampling: standard rejection sampling — accept draft d_k with probability min(1, p_k(d)/q_k(d));
on the first rejection resample from norm(max(p_k - q_k, 0)); if all pass, draw the bonus from
p_{L+1}. p and q are the *processed* distributions (temperature, top-k/p, min-p) of target and
draft, so the output has exactly the target's sampling distribution."""
from __future__ import annotations

import torch

from sparkserve.executor.sampler import processed_probs, sample_from_probs
from sparkserve.sampling_params import SamplingParams


def accept(req, drafts: list[int], q_probs: torch.Tensor | None,
           target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Verify one request's drafts: (number accepted, committed tokens = accepted + bonus)."""
    if req.params.is_greedy:
        n, bonus = accept_greedy(drafts, target_logits)
    else:
        n, bonus = accept_sampling(drafts, q_probs[:len(drafts)], target_logits, req.params,
                                   req.sampling.generator(target_logits.device))
    return n, drafts[:n] + [bonus]


def raw_logprobs(rows: torch.Tensor, toks: list[int], params: SamplingParams) -> tuple[list[float], list]:
    """Logprobs of committed tokens under the raw target distribution (as plain decoding reports)."""
    if not params.return_logprob:
        return [], []
    lsm = torch.log_softmax(rows.float(), dim=-1)
    lps = lsm[torch.arange(len(toks)), torch.tensor(toks)].tolist()
    k = params.top_logprobs_num
    tops = []
    for r in range(len(toks)):
        if k:
            v, ids = lsm[r].topk(k)
            tops.append(list(zip(ids.tolist(), v.tolist())))
        else:
            tops.append([])
    return lps, tops


def accept_greedy(drafts: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """drafts d_1..d_L, target_logits [L+1, V] (row k scores the token after d_k / the anchor).
    Returns (number accepted, bonus token)."""
    best = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampling(drafts: list[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator) -> tuple[int, int]:
    """draft_probs [L, V]: q_k the drafts were sampled from; target_logits [L+1, V]."""
    p = processed_probs(target_logits, params)                     # [L+1, V]
    L = len(drafts)
    if L:
        idx = torch.tensor(drafts)
        rows = torch.arange(L)
        ratio = p[rows, idx] / draft_probs[rows, idx].clamp_min(1e-30)
        u = torch.rand(L, generator=generator, dtype=ratio.dtype)
        for k in range(L):
            if u[k] >= ratio[k]:                                    # reject d_k
                resid = (p[k] - draft_probs[k]).clamp_min(0)
                total = resid.sum()
                dist = resid / total if total > 0 else p[k]
                return k, int(sample_from_probs(dist[None], generator)[0])
    return L, int(sample_from_probs(p[L:L + 1], generator)[0])
