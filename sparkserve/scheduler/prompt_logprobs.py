"""Prompt logprobs (SGLang's logprob_start_len, OpenAI's echo): each prefill chunk's rows whose
logits give an owed prompt token's logprob, from the forward's final hidden rows. The logits are
computed LOGPROB_BLOCK rows at a time and only the token's log-softmax value and the top-N are
kept: a long prompt's [tokens, vocab] logits never exist whole."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from sparkserve.core.req import Req

LOGPROB_BLOCK = 128


def collect_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            final_hidden: torch.Tensor, chunks: Iterable[tuple[Req, int, int]]) -> None:
    """chunks: (request, its chunk's first flat row in the forward, the chunk's tokens), each
    request's kv_len still the chunk's first position. The row at position r gives the logprob of
    prompt token r + 1; the request's owed positions run from Req.logprob_next (the prefix cache
    served none of their rows: Req.max_cached_prefix)."""
    for req, row0, n in chunks:
        if not req.wants_input_logprobs:
            continue
        ids = req.input_ids
        if req.logprob_next == 0:             # position 0 has nothing before it
            req.input_logprobs.append(None)
            req.input_top_logprobs.append(None)
        first = max(req.kv_len, req.logprob_next - 1)
        end = min(req.kv_len + n, len(ids) - 1)
        k = req.params.top_logprobs_num
        for lo in range(first, end, LOGPROB_BLOCK):
            hi = min(end, lo + LOGPROB_BLOCK)
            hidden = final_hidden[row0 + lo - req.kv_len:row0 + hi - req.kv_len]
            logp = compute_logits(hidden).float().log_softmax(-1)
            targets = torch.tensor(ids[lo + 1:hi + 1], device=logp.device)
            req.input_logprobs += logp.gather(1, targets[:, None])[:, 0].tolist()
            if k:
                vals, idx = logp.topk(k, dim=-1)
                req.input_top_logprobs += [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                req.input_top_logprobs += [[] for _ in range(hi - lo)]
