"""DSpark under a grammar: drafts the matcher rejects are cut before verify (only the first of
them stays: its rejection, certain under the mask, draws the residual the lossless rule asks for),
and the target rows verify reads are masked by the state each row follows, so acceptance is
against the constrained target distribution: the output is distributed exactly as constrained
plain decoding's (greedy: the same tokens)."""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from sparkserve.core.req import Req
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
