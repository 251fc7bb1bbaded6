"""PD disaggregation over the tcp backend, scheduler to scheduler: a prefill scheduler and a decode
scheduler (scheduler/disaggregated.py) paired by room ids, stepped in one thread, the state moving
over a real localhost ZMQ connection chunk by chunk. Seeded sampling, hidden states and DSpark on
the decode side equal one colocated engine's; the timeouts, cancels and aborts of either side fail
the request with a clear error and free every slot on both sides. (Colocated equality per model,
a decode side that goes away and a model mismatch run for every backend: test_pd_backends.py.)"""
from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import assert_no_kv_leak
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from server_harness import free_port

from sparkserve import Engine
from sparkserve.core.finish_reason import FINISH_ABORT
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.disaggregation.backend import decode_transfer, prefill_transfer
from sparkserve.frontend.prepare import params_list
from sparkserve.messages import Bootstrap, GenerateReq
from sparkserve.scheduler.disaggregated import DecodeScheduler, PrefillScheduler
from sparkserve.scheduler.req_outputs import req_from_message

KW = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=1024)
SP = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "return_logprob": True}
PROMPTS = [list(range(5, 45)), [7, 3, 9] * 4, list(range(5, 35)) + [1, 2]]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dirs):
    from test_swa_pool import save_tiny
    root = tmp_path_factory.mktemp("pdtcp")
    return {"llama": tiny_dirs["llama"],
            "windowed": save_tiny(str(root / "w8"), "mistral", sliding_window=8),
            "kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "minimax": with_index_value(make_minimax(str(root / "minimax")))}


class Pair:
    """A prefill and a decode scheduler on their own engines, joined by a transfer backend."""

    def __init__(self, path: str, timeout: float = 30.0, backend: str = "tcp", **kw):
        self.prefill_engine, self.decode_engine = Engine(path, **KW, **kw), Engine(path, **KW, **kw)
        self.port = free_port()
        self.prefill = PrefillScheduler(self.prefill_engine.scheduler, prefill_transfer(backend, self.port),
                                        timeout)
        self.decode = DecodeScheduler(self.decode_engine.scheduler, decode_transfer(backend), timeout)

    def submit(self, ids: list[int], sp: dict, to_prefill: bool = True, to_decode: bool = True):
        boot = Bootstrap("127.0.0.1", self.port, random.getrandbits(63))
        params = params_list(sp, 1)[0]
        msg = GenerateReq(f"r{boot.room}", list(ids), params)
        rp = req_from_message(msg, self.prefill.eos_ids)
        rd = req_from_message(msg, self.decode.eos_ids)
        if to_decode:
            self.decode.add_paired(rd, boot)
        if to_prefill:
            self.prefill.add_paired(rp, boot)
        return rp, rd

    def run(self, reqs, until: float = 60.0) -> None:
        end = time.monotonic() + until
        while not all(r.finished for r in reqs):
            assert time.monotonic() < end, "the pair hung"
            for side in (self.prefill, self.decode):
                if side.has_work():
                    side.step()

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def _same(req, want: dict) -> None:
    assert req.output_ids == want["output_ids"]
    ref = torch.tensor([x[0] for x in want["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(torch.tensor(req.output_logprobs), ref, atol=1e-4, rtol=0)


def test_seeded_sampling_and_hidden_states_go_over(models):
    """Seeded sampled tokens and return_hidden_states rows equal one colocated engine's: the RNG
    state and the prompt's hidden rows travel with the first token."""
    path = models["llama"]
    sp = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}
    kw = dict(disable_radix_cache=True, enable_return_hidden_states=True)
    want = Engine(path, **KW, **kw).generate(input_ids=PROMPTS[0], sampling_params=sp,
                                             return_hidden_states=True)
    pair = Pair(path, **kw)
    try:
        params = params_list(sp, 1)[0]
        boot = Bootstrap("127.0.0.1", pair.port, 5)
        msg = GenerateReq("h", list(PROMPTS[0]), params, return_hidden_states=True)
        rp, rd = req_from_message(msg, pair.prefill.eos_ids), req_from_message(msg, pair.decode.eos_ids)
        pair.prefill.add_paired(rp, boot)
        pair.decode.add_paired(rd, boot)
        pair.run([rd])
        assert rd.output_ids == want["output_ids"]
        final, _ = rd.pop_hidden_states()
        ref = torch.as_tensor(want["meta_info"]["hidden_states"])
        torch.testing.assert_close(final, ref, atol=1e-4, rtol=0)
    finally:
        pair.close()


@pytest.mark.parametrize("arch", ["llama", "windowed", "kimi", "minimax"])
def test_dspark_pair_drafts_from_the_first_step(arch, models, tmp_path):
    """The draft's KV of the prompt goes over with the rest: the decode side drafts from its first
    step, with the verifies and accepted drafts of a colocated DSpark engine."""
    from dspark_fixtures import make_oracle_draft
    from parallel_fixtures import bigram_of

    from sparkserve.config import ModelConfig
    path = models[arch]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    plain = Engine(path, **KW).generate(input_ids=PROMPTS, sampling_params=sp)
    vocab = ModelConfig.from_hf_dir(path).vocab_size
    draft = make_oracle_draft(path, str(tmp_path / "d"),
                              bigram_of(PROMPTS, [o["output_ids"] for o in plain], vocab), block_size=4)
    kw = dict(speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
              speculative_dspark_verify_mode="full")
    colocated = Engine(path, **KW, **kw).generate(input_ids=PROMPTS, sampling_params=sp)
    pair = Pair(path, **kw)
    try:
        reqs = [pair.submit(ids, sp)[1] for ids in PROMPTS]
        pair.run(reqs)
        assert [r.output_ids for r in reqs] == [o["output_ids"] for o in plain]
        spec = ("spec_verify_ct", "spec_accept_token_num")
        assert ([[r.spec_verify_ct, r.spec_accept_token_num] for r in reqs]
                == [[c["meta_info"][k] for k in spec] for c in colocated])
        assert sum(r.spec_accept_token_num for r in reqs) > 0
    finally:
        pair.close()


# ---- faults: each request gets a clear error, both sides free every slot, the next request works ----

def _idle(pair: Pair) -> None:
    for side in (pair.prefill, pair.decode):
        for _ in range(3):
            side.step()
        assert not side.has_work()
    assert_no_kv_leak(pair.prefill_engine.scheduler.cache)
    assert_no_kv_leak(pair.decode_engine.scheduler.cache)


def _works_after(pair: Pair, models) -> None:
    want = Engine(models["llama"], **KW).generate(input_ids=PROMPTS[1], sampling_params=SP)
    _, rd = pair.submit(PROMPTS[1], SP)
    pair.run([rd])
    _same(rd, want)
    _idle(pair)


def _aborted(req, status: int, words: str) -> None:
    assert isinstance(req.finished_reason, FINISH_ABORT), req.finished_reason
    reason = req.finished_reason
    assert reason.status_code == status and words in reason.message, reason


def test_client_leaves_decode_mid_transfer(models):
    pair = Pair(models["llama"])
    try:
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.decode.step()
        pair.prefill.step()          # reservation in, first chunk out
        assert pair.decode.abort(rd.rid)
        end = time.monotonic() + 10
        while rp in pair.prefill.active:      # until the cancel is in (has_work reads the socket)
            assert time.monotonic() < end
            pair.prefill.has_work()
            time.sleep(0.01)
        pair.run([rp], until=10)
        _aborted(rp, 502, "decode server gave up")
        _idle(pair)
        _works_after(pair, models)
    finally:
        pair.close()


def test_prefill_request_aborted_mid_transfer(models):
    pair = Pair(models["llama"])
    try:
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.decode.step()
        pair.prefill.step()
        assert pair.prefill.abort(rp.rid)
        pair.run([rd], until=10)
        _aborted(rd, 502, "aborted")
        _idle(pair)
        _works_after(pair, models)
    finally:
        pair.close()


def test_prefill_aborted_before_the_reservation(models):
    """The prefill request is aborted before the decode side's reservation comes: the decode side
    hears so at once (not after its timeout) and frees its reservation."""
    pair = Pair(models["llama"], timeout=30.0)
    try:
        rp, rd = pair.submit(PROMPTS[0], SP, to_decode=False)
        assert pair.prefill.abort(rp.rid)
        boot = Bootstrap("127.0.0.1", pair.port, int(rd.rid[1:]))
        pair.decode.add_paired(rd, boot)
        start = time.monotonic()
        pair.run([rd], until=10)
        assert time.monotonic() - start < 5
        _aborted(rd, 502, "aborted")
        pair.decode.step()
        assert not pair.decode.has_work()        # (the prefill side remembers the room until its timeout)
        assert_no_kv_leak(pair.prefill_engine.scheduler.cache)
        assert_no_kv_leak(pair.decode_engine.scheduler.cache)
    finally:
        pair.close()


def test_no_reservation_times_out_on_prefill(models):
    """The decode server never reserves (it is down): the prefill request fails after the timeout."""
    pair = Pair(models["llama"], timeout=1.0)
    try:
        rp, _ = pair.submit(PROMPTS[0], SP, to_decode=False)
        pair.run([rp], until=10)
        _aborted(rp, 504, "no decode server reserved")
        assert pair.prefill_engine.scheduler.forward_count[ForwardMode.EXTEND] == 0
        _idle(pair)
    finally:
        pair.close()


def test_prefill_never_gets_the_request(models):
    """The prefill server never gets the request: it tells the decode server after its timeout (its
    heartbeats keep the decode side waiting until then)."""
    pair = Pair(models["llama"], timeout=2.5)
    try:
        _, rd = pair.submit(PROMPTS[0], SP, to_prefill=False)
        pair.run([rd], until=10)
        _aborted(rd, 502, "got no request")
        _idle(pair)
        _works_after(pair, models)
    finally:
        pair.close()


def test_prefill_server_gone(models):
    """The prefill server stops answering mid-transfer: the decode side gives up after its timeout."""
    pair = Pair(models["llama"], timeout=1.0)
    try:
        _, rd = pair.submit(PROMPTS[0], SP)
        pair.decode.step()
        pair.prefill.step()
        pair.prefill.transfer.close()         # dead: no more rows, no heartbeats
        end = time.monotonic() + 10
        while not rd.finished:
            assert time.monotonic() < end
            pair.decode.step()
        _aborted(rd, 504, "did not answer")
        pair.decode.step()
        assert not pair.decode.has_work()
        assert_no_kv_leak(pair.decode_engine.scheduler.cache)
    finally:
        pair.decode.close()
        pair.prefill.inner.close()

def test_reservations_without_requests_are_bounded(models, monkeypatch):
    """A peer that reserves room after room with no request behind them (a bug, or someone on the
    bootstrap port) cannot make the prefill side hold them without bound: past the cap each is
    refused at once; the ones held still pair with their requests."""
    monkeypatch.setattr("sparkserve.scheduler.disaggregated.MAX_UNCLAIMED_RESERVATIONS", 2)
    pair = Pair(models["llama"])
    try:
        held = [pair.submit(PROMPTS[0], SP, to_prefill=False)[1] for _ in range(2)]
        _, extra = pair.submit(PROMPTS[0], SP, to_prefill=False)
        pair.run([extra], until=10)
        _aborted(extra, 502, "holds 2 reservations whose requests have not come")
        assert len(pair.prefill.reserved) == 2
        assert not any(r.finished for r in held)
    finally:
        pair.close()
