"""SGLang's `/generate`: text or token ids, one prompt or a batch, per-prompt sampling params,
logprobs and hidden states; results as text/output_ids/meta_info, streamed chunks carrying the
cumulative text (SGLang's default)."""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from sparkserve.constrained.check import check_grammar
from sparkserve.entrypoints.openai_protocol import ApiError, GenerateRequest
from sparkserve.entrypoints.serving_base import ServingBase, per_prompt, sse
from sparkserve.entrypoints.tokenizer_manager import SeqOut, Submission
from sparkserve.frontend.prepare import check_prompt, meta_info
from sparkserve.messages import GenerateReq
from sparkserve.sampling_params import SamplingParams


class ServingGenerate(ServingBase):
    def build(self, req: GenerateRequest) -> tuple[list[GenerateReq], bool]:
        """(sequences, batch?); batch: the response is a list."""
        if (req.text is None) == (req.input_ids is None):
            raise ApiError(400, "text: give exactly one of text and input_ids", "text")
        if req.text is not None:
            prompts, single = self.prompts(req.text, "text", ("text",))
        else:
            prompts, single = self.prompts(req.input_ids, "input_ids", ("ids",))
        k = len(prompts)
        sps = per_prompt(req.sampling_params, k, "sampling_params")
        ret_lp = per_prompt(req.return_logprob, k, "return_logprob")
        top_n = per_prompt(req.top_logprobs_num, k, "top_logprobs_num")
        lp_start = per_prompt(req.logprob_start_len, k, "logprob_start_len")
        hidden = per_prompt(req.return_hidden_states, k, "return_hidden_states")
        rids = per_prompt(req.rid, k, "rid") if isinstance(req.rid, list) else None
        checked = []
        for p, ids in enumerate(prompts):
            try:
                sp = dict(sps[p] or {})
                if ret_lp[p]:
                    sp["return_logprob"] = True
                if top_n[p]:
                    sp["top_logprobs_num"] = top_n[p]
                if lp_start[p] != -1:
                    sp["logprob_start_len"] = lp_start[p]
                params = SamplingParams.from_dict(sp)
                check_prompt(ids, params, self.tm.limits)
                check_grammar(params, self.tm.args.grammar_backend, self.tm.tokenizer is not None)
            except ValueError as e:
                raise ApiError.bad_request(e) from None
            checked.append((ids, params))
        base = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
        seqs = self.fan(base, checked, [bool(h) for h in hidden], rids,
                        self.dp_rank(req.routed_dp_rank, req.data_parallel_rank), self.bootstraps(req, k),
                        req.priority)
        return seqs, not (single and len(seqs) == 1)

    def result(self, s: GenerateReq, parts: list[SeqOut], with_text: bool) -> dict:
        """One sequence's result from its outputs so far (the whole of it once finished)."""
        ids = [t for o in parts for t in o.token_ids]
        last = parts[-1] if parts else None
        extra: dict[str, Any] = {"e2e_latency": last.e2e_latency if last else 0.0}
        if s.params.return_logprob:
            lps = [lp for o in parts for lp in o.logprobs]
            tops = [t for o in parts for t in o.top_logprobs]
            text_of = with_text and self.tm.tokenizer is not None
            piece = (lambda t: self.tm.token_piece(t)[0]) if text_of else (lambda t: None)
            extra["output_token_logprobs"] = [[lp, t, piece(t)] for lp, t in zip(lps, ids)]
            extra["output_top_logprobs"] = [[[v, t, piece(t)] for t, v in (top or [])] for top in tops]
            extra.update(self.input_logprobs(s, parts, piece))
        if last is not None and last.hidden_states is not None:
            extra["hidden_states"] = last.hidden_states
            if last.aux_hidden_states is not None:
                extra["aux_hidden_states"] = last.aux_hidden_states
        meta = meta_info(s.rid, last.finish_reason if last else None, len(s.input_ids),
                         last.completion_tokens if last else 0, last.cached_tokens if last else 0,
                         last.spec if last else (0, 0, 0), **extra)
        return {"text": "".join(o.text for o in parts), "output_ids": ids, "meta_info": meta}

    @staticmethod
    def input_logprobs(s: GenerateReq, parts: list[SeqOut], piece) -> dict:
        """SGLang's input_token_logprobs / input_top_logprobs: [logprob, id, text] from prompt
        position logprob_start_len on, None for position 0's logprob and alternatives."""
        lps = next((o for o in parts if o.input_logprobs is not None), None)
        if lps is None:
            return {"input_token_logprobs": [], "input_top_logprobs": []}
        ids = s.input_ids[s.params.logprob_start_len:]
        return {"input_token_logprobs": [[lp, t, piece(t)] for lp, t in zip(lps.input_logprobs, ids)],
                "input_top_logprobs": [None if top is None else [[v, t, piece(t)] for t, v in top]
                                       for top in lps.input_top_logprobs]}

    async def stream(self, seqs: list[GenerateReq], sub: Submission, batch: bool,
                     with_text: bool) -> AsyncIterator[str]:
        parts: dict[int, list[SeqOut]] = {s.index: [] for s in seqs}
        by_index = {s.index: s for s in seqs}
        async for o in self.events(sub, seqs, False):
            parts[o.index].append(o)
            if o.text or o.token_ids or o.finish_reason is not None:
                res = self.result(by_index[o.index], parts[o.index], with_text)
                if batch:
                    res["index"] = o.index
                yield sse(res)

    async def full(self, seqs: list[GenerateReq], sub: Submission, batch: bool,
                   with_text: bool) -> dict | list:
        outs = await self.collect(sub, seqs)
        results = [self.result(s, outs[s.index], with_text) for s in seqs]
        return results if batch else results[0]
