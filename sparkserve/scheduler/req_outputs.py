"""Requests in and outputs out of a scheduler, as messages: a Req from a GenerateReq, the
ReqOutput a Req produced since its last one (OutputTracker keeps what was sent), and the reverse,
a ReqOutput applied to a caller's Req (DP attention: rank 0 holds a copy of each request another
group runs, kept up to date from that group's outputs)."""
from __future__ import annotations

import torch

from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.messages import GenerateReq, ReqOutput


def req_from_message(msg: GenerateReq, eos_ids: set[int]) -> Req:
    sampling = RequestSamplingState(msg.params, msg.input_ids, eos_ids)
    return Req(msg.rid, list(msg.input_ids), msg.params, sampling,
               hidden_parts=[] if msg.return_hidden_states else None, routed_dp_rank=msg.routed_dp_rank,
               priority=msg.priority)


def message_from_req(req: Req) -> GenerateReq:
    return GenerateReq(req.rid, list(req.input_ids), req.params,
                       return_hidden_states=req.hidden_parts is not None, priority=req.priority)


def req_output(req: Req, sent: int) -> ReqOutput:
    """What `req` produced since its first `sent` output tokens went out; its hidden rows once
    it finished (the only copy: the rows are large)."""
    out = ReqOutput(req.rid, req.output_ids[sent:], req.finished_reason, len(req.input_ids),
                    len(req.output_ids), req.cached_tokens, req.output_logprobs[sent:],
                    req.output_top_logprobs[sent:], req.spec_verify_ct, req.spec_draft_token_num,
                    req.spec_accept_token_num)
    if sent == 0 and req.wants_input_logprobs and (req.output_ids or req.finished):
        out.input_logprobs, out.input_top_logprobs = list(req.input_logprobs), list(req.input_top_logprobs)
    rows = req.pop_hidden_states() if req.finished else None
    if rows is not None:
        out.hidden_states = rows[0].tolist()
        out.aux_hidden_states = None if rows[1] is None else rows[1].tolist()
    return out


def apply_output(req: Req, out: ReqOutput) -> None:
    """Bring `req` to where the scheduler that runs it is, from that scheduler's output."""
    req.output_ids += out.new_token_ids
    req.output_logprobs += out.new_logprobs
    req.output_top_logprobs += out.new_top_logprobs
    req.cached_tokens = out.cached_tokens
    req.spec_verify_ct, req.spec_draft_token_num = out.spec_verify_ct, out.spec_draft_token_num
    req.spec_accept_token_num = out.spec_accept_token_num
    req.finished_reason = out.finished_reason
    if out.input_logprobs is not None:
        req.input_logprobs, req.input_top_logprobs = out.input_logprobs, out.input_top_logprobs
    if out.hidden_states is not None and req.hidden_parts is not None:
        final = torch.tensor(out.hidden_states)
        taps = None if out.aux_hidden_states is None else torch.tensor(out.aux_hidden_states)
        req.hidden_parts = [(torch.arange(final.shape[0]), final, taps)]


class OutputTracker:
    """The requests a scheduler holds for someone who wants their outputs as messages, with
    how many output tokens each has had."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[Req, int]] = {}

    def hold(self, req: Req) -> None:
        self.sent[req.rid] = (req, 0)

    def drop(self, rid: str) -> tuple[Req, int] | None:
        return self.sent.pop(rid, None)

    def rids(self) -> list[str]:
        return list(self.sent)

    def output(self, req: Req) -> ReqOutput:
        _, sent = self.sent.pop(req.rid) if req.finished else self.sent[req.rid]
        if not req.finished:
            self.sent[req.rid] = (req, len(req.output_ids))
        return req_output(req, sent)
