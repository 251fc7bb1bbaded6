"""DSpark under a grammar: drafts the matcher rejects are cut before verify (only the first of
them stays: its rejection, certain under the mask, draws the residual the lossless rule asks for),
and the target rows verify reads are masked by the state each row follows, so acceptance is
against the constrained target distribution: the output is distributed exactly as constrained
plain decoding's (greedy: the same tokens).

The draft itself proposes under the grammar too (DraftMasks): each slot's draft logits are masked
by the state after the output and the slots before it, so a draft the grammar would reject (and
verify would never accept) is not proposed; the masked distribution is the one the draft samples
from and verify divides by, so the rule stays lossless."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparkserve.constrained.bitmask import allowed_ids
from sparkserve.core.req import Req

if TYPE_CHECKING:
    from sparkserve.speculative.dspark_worker import Proposal


def cut_drafts(req: Req, proposal: Proposal) -> None:
    if req.grammar is not None and proposal.verify_len:
        proposal.verify_len = req.grammar.cut_drafts(proposal.tokens[:proposal.verify_len], req.output_ids)


def verify_masks(reqs: Sequence[Req], props: dict) -> dict[int, Tensor]:
    """Per constrained request i of a VERIFY forward, the bitmask of each of its logits rows:
    anchor + verified drafts when it speculates, its one row when it decodes plainly."""
    masks = {}
    for i, req in enumerate(reqs):
        if req.grammar is None:
            continue
        p = props.get(req)
        masks[i] = req.grammar.draft_masks(p.tokens[:p.verify_len] if p else [], req.output_ids)
    return masks


class DraftMasks:
    """The constrained requests of one draft pass, each with a copy of its grammar state walked
    along its drafts as they are drafted. `target_ids` [Vd]: the target id of each draft-vocab
    id (a reduced draft vocabulary maps into the target's)."""

    def __init__(self, reqs: Sequence[Req], target_ids: Tensor):
        self.walks = {i: r.grammar.walker(r.output_ids) for i, r in enumerate(reqs) if r.grammar is not None}
        self.words = next((r.grammar.words for r in reqs if r.grammar is not None), 0)
        self.target_ids = target_ids

    @staticmethod
    def of(reqs: Sequence[Req], target_ids: Tensor) -> DraftMasks | None:
        return DraftMasks(reqs, target_ids) if any(r.grammar is not None for r in reqs) else None

    def apply(self, logits: Tensor) -> Tensor:
        """logits [B, Vd] of one slot with each constrained row's disallowed tokens at -inf (a
        copy). A row whose grammar allows none of the draft vocabulary (or whose walk ended) is
        left as it is: its draft is cut before verify as before."""
        rows = [i for i, w in self.walks.items() if w is not None]
        if not rows:
            return logits
        bits = torch.empty(len(rows), self.words, dtype=torch.int32)
        for j, i in enumerate(rows):
            v = bits[j]
            self.walks[i].unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        allowed = torch.from_numpy(allowed_ids(bits, self.words * 32))[:, self.target_ids]    # [n, Vd]
        out = logits.clone()
        for j, i in enumerate(rows):
            if allowed[j].any():
                out[i] = logits[i].masked_fill(~allowed[j].to(logits.device), float("-inf"))
            else:                   # (a reduced draft vocabulary may lack every allowed token)
                self.walks[i] = None
        return out

    def take(self, tokens: Tensor) -> None:
        """Each row drafted tokens[i] (target ids): its walk takes it (a token the grammar
        refuses, or one past its end, ends the walk)."""
        for i, w in self.walks.items():
            t = int(tokens[i])
            if w is not None and (w.is_stopped() or not w.validate_tokens([t]) or not w.consume_token(t)):
                self.walks[i] = None
