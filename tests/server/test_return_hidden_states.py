"""return_hidden_states: the hidden rows the engine computes while it generates (prefill chunks,
decode steps, retracted and recomputed requests, DSpark verify cycles) equal the rows one fresh
prefill of the whole sequence gives (feature_cache.capture, itself checked against
transformers in test_training) — so draft data can be captured while it is distilled."""
import json

import pytest
import torch
from conftest import assert_no_kv_leak
from dspark_fixtures import dspark_single_thread, make_random_draft  # noqa: F401

from sparkserve import Engine
from sparkserve.args import ServerArgs
from sparkserve.training.feature_cache import capture

TAPS = [-1, 1]
GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}


def _prompts(n: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _check_against_prefill(eng, prompts, outs) -> None:
    model = eng.scheduler.runner.model
    for p, o in zip(prompts, outs):
        seq = p + o["output_ids"]
        final, taps = o["meta_info"]["hidden_states"], o["meta_info"]["aux_hidden_states"]
        assert final.shape[0] == taps.shape[0] == len(seq) - 1
        want_taps, want_final = capture(model, [seq], TAPS)[0]
        torch.testing.assert_close(final, want_final[:-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps, want_taps[:-1], atol=1e-4, rtol=1e-4)
    model.set_aux_layers(TAPS)           # capture() leaves its own taps set; keep ours


def _engine(path, **kw):
    eng = Engine(path, enable_return_hidden_states=True, disable_radix_cache=True, **kw)
    eng.scheduler.runner.model.set_aux_layers(TAPS)
    return eng


def test_hidden_states_of_chunked_prefill_and_decode(llama_dir):
    eng = _engine(llama_dir, max_total_tokens=4096, chunked_prefill_size=16)
    prompts = _prompts(6)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_hidden_states=True)
    _check_against_prefill(eng, prompts, outs)
    plain = eng.generate(input_ids=prompts[:1], sampling_params=GREEDY)
    assert "hidden_states" not in plain[0]["meta_info"]


def test_hidden_states_survive_retraction(llama_dir):
    eng = _engine(llama_dir, max_total_tokens=160, page_size=1)
    prompts = _prompts(8)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_hidden_states=True)
    assert eng.scheduler.num_retractions > 0
    _check_against_prefill(eng, prompts, outs)


def test_hidden_states_of_dspark_verify_cycles(llama_dir, tmp_path):
    """Only the committed rows of a verify (anchor + accepted drafts) are kept."""
    draft = make_random_draft(llama_dir, str(tmp_path / "draft"), target_layer_ids=TAPS)
    eng = _engine(llama_dir, max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=draft, speculative_dspark_verify_mode="full")
    prompts = _prompts(4)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_hidden_states=True)
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    _check_against_prefill(eng, prompts, outs)


def test_hidden_states_flags_are_checked(llama_dir):
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        ServerArgs(model_path=llama_dir, enable_return_hidden_states=True).validate()
    eng = Engine(llama_dir, max_total_tokens=1024)
    with pytest.raises(ValueError, match="enable_return_hidden_states"):
        eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_hidden_states=True)


def test_generate_many_keeps_order_and_the_batch_full(llama_dir):
    """A long stream through generate_many: results in input order, equal to one generate() call
    on the whole list (tokens and hidden rows), never more than max_in_flight requests in the
    scheduler, and a finished request replaced before the long one at the head is done."""
    eng = _engine(llama_dir, max_total_tokens=4096)
    prompts = _prompts(9)
    params = [{**GREEDY, "max_new_tokens": n} for n in (24, 2, 3, 2, 5, 2, 3, 4, 2)]
    want = eng.generate(input_ids=prompts, sampling_params=params, return_hidden_states=True)
    sched, steps = eng.scheduler, []
    step = sched.step

    def counted_step():
        steps.append(len(sched.waiting) + len(sched.running) + (sched.chunked is not None))
        step()
    sched.step = counted_step
    got = list(eng.generate_many(prompts, params, max_in_flight=3, return_hidden_states=True))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g["meta_info"]["aux_hidden_states"], w["meta_info"]["aux_hidden_states"])
    # the 8 short answers pass through beside the 24-token one at the head, 3 at a time
    # (a batch-at-a-time loop would drop to 1 in flight after the first short answers)
    assert max(steps) == 3 and steps[:12] == [3] * 12
    assert not sched.has_work()
    assert_no_kv_leak(sched.cache)


def test_generate_many_rejects_bad_input_without_leaking(llama_dir):
    eng = _engine(llama_dir, max_total_tokens=4096)
    with pytest.raises(ValueError, match="max_in_flight"):
        eng.generate_many([[5, 6]], GREEDY, max_in_flight=0)
    with pytest.raises(ValueError, match="sampling_params: 1 values for 2 prompts"):
        eng.generate_many([[5, 6], [7, 8]], [GREEDY])
    with pytest.raises(ValueError, match="empty"):
        list(eng.generate_many([[5, 6, 7], [8, 9], []], GREEDY, max_in_flight=2))
    it = eng.generate_many(_prompts(5), GREEDY, max_in_flight=2)
    next(it)
    it.close()                       # the consumer stops early: nothing stays in the scheduler
    assert not eng.scheduler.has_work()
    assert_no_kv_leak(eng.scheduler.cache)


def test_prefill_only_hidden_states(llama_dir):
    """max_new_tokens 0 with return_hidden_states runs the prompt and returns every row of it
    (how draft-training data is captured from a fixed dataset), and frees its KV."""
    eng = _engine(llama_dir, max_total_tokens=4096)
    prompts = _prompts(3)
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_hidden_states=True)
    model = eng.scheduler.runner.model
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        want_taps, want_final = capture(model, [p], TAPS)[0]
        torch.testing.assert_close(o["meta_info"]["hidden_states"], want_final, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(o["meta_info"]["aux_hidden_states"], want_taps, atol=1e-4, rtol=1e-4)
    model.set_aux_layers(TAPS)
    assert not eng.scheduler.has_work()
    assert_no_kv_leak(eng.scheduler.cache)


def test_ngram_takes_hidden_state_layers(llama_dir):
    """--hidden-state-layers with NGRAM (which taps nothing of its own): the rows of its verify
    cycles and plain steps equal a fresh prefill's, its greedy tokens plain decoding's; with
    DSpark (whose target taps the draft's layers) the flag is still refused."""
    kw = dict(enable_return_hidden_states=True, disable_radix_cache=True, max_total_tokens=4096)
    with pytest.raises(ValueError, match="--hidden-state-layers with --speculative-algorithm DSPARK"):
        ServerArgs(llama_dir, hidden_state_layers=TAPS, speculative_algorithm="DSPARK",
                   speculative_draft_model_path=llama_dir, **kw).validate()
    prompts = [p * 3 for p in _prompts(4)]          # repeated text: NGRAM finds drafts to verify
    params = {**GREEDY, "max_new_tokens": 32}
    want = Engine(llama_dir, max_total_tokens=4096).generate(input_ids=prompts, sampling_params=params)
    eng = Engine(llama_dir, hidden_state_layers=TAPS, speculative_algorithm="NGRAM",
                 speculative_dspark_verify_mode="full", **kw)
    assert eng.scheduler.runner.model.aux_layer_ids == TAPS
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_hidden_states=True)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    _check_against_prefill(eng, prompts, outs)


def test_http_generate_returns_hidden_states(llama_dir, tmp_path):
    """SGLang's /generate with return_hidden_states on a DSpark server (its target taps the
    draft's layers): rows [position][hidden] equal a fresh prefill capture, for a batch, a
    stream (on its last chunk) and a prefill-only request; /v1/completions gives the last row
    run; a bad per-prompt list is a 400."""
    import httpx
    from server_harness import ServerProcess
    taps = [0, 1]
    draft = make_random_draft(llama_dir, str(tmp_path / "draft"), target_layer_ids=taps)
    server = ServerProcess("--model-path", llama_dir, "--max-total-tokens", "4096",
                           "--enable-return-hidden-states",
                           "--disable-radix-cache", "--speculative-algorithm", "DSPARK",
                           "--speculative-draft-model-path", draft,
                           "--speculative-dspark-verify-mode", "full")
    try:
        info = httpx.get(server.url + "/server_info", timeout=10).json()     # what runs, resolved
        assert info["speculative_draft_model_path"] == draft
        assert (info["speculative_dspark_verify_mode"], info["speculative_dspark_block_size"]) == ("full", 4)
        assert not [k for k in info if k.startswith(("speculative_ngram", "speculative_num_draft"))]
        eng = Engine(llama_dir, max_total_tokens=1024)
        model = eng.scheduler.runner.model
        prompts = _prompts(3)

        def check(seq, meta, rows=None):         # the last output token never runs
            rows = len(seq) - 1 if rows is None else rows
            want_taps, want_final = capture(model, [seq], taps)[0]
            torch.testing.assert_close(torch.tensor(meta["hidden_states"]), want_final[:rows], atol=1e-4,
                                       rtol=1e-4)
            torch.testing.assert_close(torch.tensor(meta["aux_hidden_states"]), want_taps[:rows], atol=1e-4,
                                       rtol=1e-4)

        body = {"input_ids": prompts[:2], "sampling_params": GREEDY, "return_hidden_states": [True, False]}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        first, second = r.json()
        assert first["meta_info"]["spec_verify_ct"] > 0
        assert len(first["output_ids"]) == GREEDY["max_new_tokens"]
        check(prompts[0] + first["output_ids"], first["meta_info"])
        assert "hidden_states" not in second["meta_info"]

        with httpx.stream("POST", server.url + "/generate", timeout=120,
                          json={"input_ids": prompts[2], "sampling_params": GREEDY, "stream": True,
                                "return_hidden_states": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert all("hidden_states" not in c["meta_info"] for c in chunks[:-1])
        check(prompts[2] + chunks[-1]["output_ids"], chunks[-1]["meta_info"])

        r = httpx.post(server.url + "/generate", timeout=120, json={
            "input_ids": prompts[1], "sampling_params": {"max_new_tokens": 0}, "return_hidden_states": True})
        assert r.status_code == 200 and r.json()["output_ids"] == []
        check(prompts[1], r.json()["meta_info"], len(prompts[1]))

        # OpenAI completions (SGLang's extra field): the last row run, on the finished choice
        seq = prompts[0] + first["output_ids"]
        want_last = capture(model, [seq], taps)[0][1][len(seq) - 2]
        oai = {"prompt": prompts[0], "max_tokens": GREEDY["max_new_tokens"], "temperature": 0,
               "ignore_eos": True,
               "return_hidden_states": True}
        r = httpx.post(server.url + "/v1/completions", json=oai, timeout=120)
        assert r.status_code == 200, r.text
        torch.testing.assert_close(torch.tensor(r.json()["choices"][0]["hidden_states"]), want_last,
                                   atol=1e-4, rtol=1e-4)
        with httpx.stream("POST", server.url + "/v1/completions", json={**oai, "stream": True},
                          timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        ends = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
        assert len(ends) == 1
        assert all("hidden_states" not in c["choices"][0] for c in chunks if c["choices"][0] not in ends)
        torch.testing.assert_close(torch.tensor(ends[0]["hidden_states"]), want_last, atol=1e-4, rtol=1e-4)

        r = httpx.post(server.url + "/generate", json={**body, "return_hidden_states": [True]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
        server.remove_log()
