"""PD disaggregation in one process: a request's prompt run on one engine, its state (every rank's
pieces, merged) moved into another engine, which decodes it."""
from __future__ import annotations

import torch

from sparkserve import Engine
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.frontend.prepare import params_list


def disaggregated(prefill: Engine, decode: Engine, ids: list[int], sp: dict) -> dict:
    """Run `ids` on `prefill` up to its first token, move its state, finish it on `decode`."""
    params = params_list(sp, 1)[0]
    [src] = prefill._submit(ids, params)
    while not src.output_ids:
        prefill.scheduler.step()
    data = prefill.scheduler.request_rows(src, len(ids)).read(0, True)     # every rank's pieces, merged
    prefill.scheduler.abort(src.rid)                        # the prefill side frees it at once
    dst = Req(src.rid, list(ids), params, RequestSamplingState(params, ids, decode.scheduler.eos_ids),
              output_ids=list(src.output_ids), output_logprobs=list(src.output_logprobs),
              output_top_logprobs=list(src.output_top_logprobs))
    dst.sampling.resume_rng(src.sampling.rng_state())   # seeded sampling goes on
    assert decode.scheduler.add_prebuilt(dst, data)
    if decode.scheduler.spec is not None:       # the draft's KV rows arrived where decode reads them
        here = decode.scheduler.request_rows(dst, len(ids)).read(0, True)
        draft = [key for key in data if key[0] == 1]
        assert draft
        for key in draft:
            torch.testing.assert_close(here[key], data[key], rtol=0, atol=0)
    return decode._run_to_completion([[dst]])[0]
