"""DSpark greedy decoding is token-identical to plain decoding.

Tiny random llama and qwen3 targets; two drafts each: a random one (pattern of a real untrained
draft: nearly every draft is rejected) and a "fitted" one whose Markov head is the bigram table
of the target's own greedy outputs (so verifies accept 0..gamma drafts, with real multi-token
commits and rejections mid-block). One mixed batch per run: prompt lengths 1..40, max_new_tokens
1 and 2, a stop_token_ids request that stops mid-generation, and a repetition_penalty request
(which decodes without speculation inside the same VERIFY forwards). Then the memory paths:
chunked prefill, prefix-cache hits, page_size 4, a KV pool small enough to force retraction —
each checked against plain decoding and for KV leaks afterwards. Last, the embedded SmolLM2 with
a draft that shares its embedding and LM head."""
from __future__ import annotations

import json

import pytest
import torch
from dspark_fixtures import (
    GreedyBatch,
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    install_context_check,
    load_hf,
    make_oracle_draft,
    make_random_draft,
)

GAMMA = 4
LENGTHS = (1, 5, 17, 40, 9, 3)
MAX_NEW = (20, 1, 2, 25, 16, 18)
STOP_REQ, PENALTY_REQ = 3, 4


class Setup(GreedyBatch):
    """One target: its plain engine, the mixed batch, plain outputs, drafts."""

    def __init__(self, root, arch: str):
        super().__init__(root, arch, LENGTHS, MAX_NEW, STOP_REQ, PENALTY_REQ)
        self.hf = load_hf(self.target)
        self.drafts = {"random": make_random_draft(self.target, str(root / f"{arch}_random"),
                                                   block_size=GAMMA)}
        bigram = [0] * 256
        for p, o in zip(self.prompts, self.base):
            seq = p[-1:] + o
            for a, b in zip(seq, seq[1:]):
                bigram[a] = b
        self.drafts["fitted"] = make_oracle_draft(self.target, str(root / f"{arch}_fitted"), bigram,
                                                  block_size=GAMMA)
        # A steep step-cost table: adaptive verify admits only slots with high survival.
        self.sps = str(root / f"{arch}_sps.json")
        with open(self.sps, "w") as f:
            json.dump({"tokens": [1, 64], "seconds": [1.0, 1.0 + 63 * 0.25], "draft_seconds": 0.0}, f)


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_greedy")
    return {arch: Setup(root, arch) for arch in ("llama", "qwen3")}


def spec_engine(s: Setup, draft: str = "fitted", mode: str = "full", context_check: bool = True, **kw):
    if mode == "adaptive":
        kw.setdefault("speculative_dspark_sps_table_path", s.sps)
    if mode == "adaptive_measured":
        mode = "adaptive"
    eng = engine(s.target, s.drafts[draft], mode, **kw)
    assert eng.scheduler.spec is not None and eng.scheduler.spec.planner.mode == mode
    eng.plan_log = []
    planner = eng.scheduler.spec.planner
    orig = planner.plan

    def recording_plan(confidences, caps, plain_tokens=0):
        lens = orig(confidences, caps, plain_tokens)
        eng.plan_log.extend(zip(caps, lens))
        return lens
    planner.plan = recording_plan
    # After every step, the draft's context KV must equal a fresh prefill's (prompt rows, committed
    # drafts and bonus tokens, prefix-cache hits, recomputed retracted requests alike).
    eng.context_stats = install_context_check(eng, s.hf) if context_check else None
    return eng


def check_run(s: Setup, eng, prompts=None, params=None, ref=None) -> list[list[int]]:
    out = generate_ids(eng, prompts or s.prompts, params or s.params)
    assert out == (ref or s.ref)
    assert_no_kv_leak(eng)
    if eng.context_stats is not None:
        assert eng.context_stats["rows"] > 0
    return out


@pytest.mark.parametrize("draft", ["random", "fitted"])
@pytest.mark.parametrize("mode", ["full", "threshold", "adaptive"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_plain(setups, arch, mode, draft):
    s = setups[arch]
    eng = spec_engine(s, draft, mode)
    check_run(s, eng)
    sched = eng.scheduler
    from sparkserve.core.forward_batch import ForwardMode
    assert sched.forward_count[ForwardMode.VERIFY] > 0
    caps = [c for c, _ in eng.plan_log]
    lens = [n for _, n in eng.plan_log]
    assert all(0 <= n <= c <= GAMMA for c, n in eng.plan_log)
    assert max(caps) == GAMMA
    if mode == "full":
        assert lens == caps
    else:                                                     # the planner really varied lengths
        assert any(n < c for c, n in eng.plan_log) and any(n > 0 for n in lens), eng.plan_log
    # one verify per proposal with drafts to verify; the others decode plainly
    assert sum(sched.accept_hist.values()) == sum(n > 0 for n in lens)
    assert max(sched.accept_hist) <= max(lens)
    if draft == "fitted" and mode == "full":
        # Real acceptance: some verifies accept several drafts, some reject mid-block.
        assert max(sched.accept_hist) >= 2 and sched.accept_hist.get(0, 0) > 0, sched.accept_hist
        assert any(0 < k < GAMMA for k in sched.accept_hist), sched.accept_hist


def test_logprobs_match_plain(setups):
    """return_logprob under speculation reports the raw target logprobs of the committed tokens
    (accepted drafts and bonus alike), as plain decoding does."""
    s = setups["llama"]
    prompts = [s.prompts[0], s.prompts[3]]
    params = dict(temperature=0, max_new_tokens=18, return_logprob=True, top_logprobs_num=3)
    ref = s.plain.generate(input_ids=prompts, sampling_params=params)
    eng = spec_engine(s, "fitted", "full")
    out = eng.generate(input_ids=prompts, sampling_params=params)
    assert max(eng.scheduler.accept_hist) >= 2
    for o, r in zip(out, ref):
        assert o["output_ids"] == r["output_ids"]
        lo, lr = o["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        assert [t for _, t in lo] == [t for _, t in lr] == o["output_ids"]
        assert torch.allclose(torch.tensor([x for x, _ in lo]), torch.tensor([x for x, _ in lr]), atol=1e-4)
        to, tr = o["meta_info"]["output_top_logprobs"], r["meta_info"]["output_top_logprobs"]
        assert [[i for _, i in row] for row in to] == [[i for _, i in row] for row in tr]
        assert torch.allclose(torch.tensor([[v for v, _ in row] for row in to]),
                              torch.tensor([[v for v, _ in row] for row in tr]), atol=1e-4)
    assert_no_kv_leak(eng)


def test_adaptive_with_measured_step_costs(setups):
    """No SPS table: the step costs are measured at start-up (the timing varies, the output not),
    and the scheduler reports each draft pass and cycle, whose cost beyond a plain step the plans charge."""
    s = setups["llama"]
    eng = spec_engine(s, "fitted", "adaptive_measured")
    planner = eng.scheduler.spec.planner
    table = planner.costs
    assert len(table.tokens) >= 2 and table.seconds[0] > 0
    assert table.seconds == sorted(table.seconds)
    # On a tiny model a noisy start-up can measure 2 tokens at twice 1, where no draft pass would
    # ever pay: a flat table (the regime where drafting pays) makes the first steps draft, so the
    # scheduler's own measurements of its draft passes must then be what the plans charge.
    table.seconds = [table.seconds[0]] * len(table.seconds)
    assert planner.draft_seconds(1) == 0
    check_run(s, eng)
    assert eng.plan_log and planner.draft_seconds(1) > 0


def test_default_verify_mode_is_adaptive(setups, tmp_path):
    """--speculative-algorithm DSPARK with no verify mode verifies adaptively, by step costs
    measured at start-up (the mode that never loses to plain decoding), token-identical to plain;
    a draft without a confidence head, which cannot tell which drafts will pass, falls back to full
    verify under the default, and asking for adaptive with it is refused."""
    from sparkserve import Engine
    s = setups["llama"]
    kw = dict(max_total_tokens=4096, activation_quant="none", speculative_algorithm="DSPARK")
    eng = Engine(s.target, speculative_draft_model_path=s.drafts["fitted"], **kw)
    spec = eng.scheduler.spec
    assert spec.planner.mode == "adaptive" and spec.describe()["verify_mode"] == "adaptive"
    assert spec.planner.costs is not None and spec.planner.costs.seconds[0] > 0     # measured
    assert generate_ids(eng, s.prompts, s.params) == s.ref
    assert_no_kv_leak(eng)
    noconf = make_random_draft(s.target, str(tmp_path / "noconf"), block_size=GAMMA,
                               enable_confidence_head=False)
    eng = Engine(s.target, speculative_draft_model_path=noconf, **kw)
    assert eng.scheduler.spec.planner.mode == "full"
    assert generate_ids(eng, s.prompts, s.params) == s.ref
    with pytest.raises(ValueError, match="confidence head"):
        Engine(s.target, speculative_draft_model_path=noconf, speculative_dspark_verify_mode="adaptive", **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill(setups, arch):
    """Prompts prefilled 4 tokens per step: every chunk's taps become draft context."""
    s = setups[arch]
    eng = spec_engine(s, "fitted", "full", chunked_prefill_size=4)
    check_run(s, eng)
    from sparkserve.core.forward_batch import ForwardMode
    assert eng.scheduler.forward_count[ForwardMode.EXTEND] >= sum(LENGTHS) // 4


def test_prefix_cache_hit(setups):
    """A repeated prompt and a continuation of a finished request hit the prefix cache; their
    draft context (injected by the first requests, prompt and generated rows) is reused."""
    s = setups["llama"]
    eng = spec_engine(s, "fitted", "full")
    check_run(s, eng)
    i = STOP_REQ
    again = [s.prompts[i], s.prompts[0] + s.ref[0][:12] + [7, 8],
             s.prompts[2][:10] + [200, 201, 202, 203, 204, 205]]
    params = dict(temperature=0, max_new_tokens=16)
    ref = generate_ids(s.plain, again, params)
    rows_before = eng.context_stats["rows"]
    outs = eng.generate(input_ids=again, sampling_params=params)
    assert [o["output_ids"] for o in outs] == ref
    assert eng.context_stats["rows"] > rows_before
    assert outs[0]["meta_info"]["cached_tokens"] >= len(s.prompts[i]) - 1
    assert outs[1]["meta_info"]["cached_tokens"] >= len(s.prompts[0]) + 10   # generated rows reused
    assert outs[2]["meta_info"]["cached_tokens"] >= 10
    assert max(eng.scheduler.accept_hist) >= 2
    assert_no_kv_leak(eng)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_page_size_4(setups, arch):
    s = setups[arch]
    eng = spec_engine(s, "fitted", "full", page_size=4)
    check_run(s, eng)


@pytest.mark.parametrize("mode", ["full", "threshold"])
def test_retraction(setups, mode):
    """A 72-token pool cannot hold the batch: requests are retracted and recomputed, with their
    draft context, and the output is still plain decoding's."""
    s = setups["llama"]
    eng = spec_engine(s, "fitted", mode, max_total_tokens=72)
    check_run(s, eng)
    assert eng.scheduler.num_retractions > 0


def test_everything_at_once(setups):
    """page_size 4 + chunked prefill 4 + a small pool (retraction) + threshold verify, qwen3."""
    s = setups["qwen3"]
    eng = spec_engine(s, "fitted", "threshold", page_size=4, chunked_prefill_size=4, max_total_tokens=70)
    check_run(s, eng)
    assert eng.scheduler.num_retractions > 0


# ---- embedded SmolLM2 --------------------------------------------------------------------------
def test_smollm2_shared_embedding_draft(tmp_path):
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft, save_dspark_draft
    plain = engine(None)
    msgs = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Write a haiku about rain."}]]
    params = dict(temperature=0, max_new_tokens=12)
    ref = plain.generate(messages=msgs, sampling_params=params)
    cfg = dspark_config_dict(plain.model_config, num_layers=1, block_size=4, mask_token_id=0, markov_rank=32)
    save_dspark_draft(init_dspark_draft(cfg, std=0.02), str(tmp_path), include_shared=False)
    del plain
    eng = engine(None, str(tmp_path), "full")
    draft = eng.scheduler.spec.draft
    target = eng.scheduler.runner.model
    assert draft.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    out = eng.generate(messages=msgs, sampling_params=params)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert [o["text"] for o in out] == [r["text"] for r in ref]
    assert [o["meta_info"]["finish_reason"] for o in out] == [r["meta_info"]["finish_reason"] for r in ref]
    assert len(out[1]["output_ids"]) == 12
    assert sum(eng.scheduler.accept_hist.values()) > 0
    assert_no_kv_leak(eng)


def test_shipped_draft_is_the_default_on_the_embedded_model():
    """--speculative-algorithm DSPARK with no draft path on the embedded model serves the draft
    shipped in the package (<= 30 MB, reduced vocab, embedding shared with the target), greedy
    output token-identical to plain decoding, in full and adaptive verify modes."""
    import os

    from sparkserve.embedded import default_model_path, shipped_draft_path
    path = shipped_draft_path(default_model_path())
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size <= 30 * 2**20, size
    msgs = [[{"role": "user", "content": "Describe the water cycle."}],
            [{"role": "user", "content": "Write a Python function that adds two numbers."}]]
    params = dict(temperature=0, max_new_tokens=24)
    ref = engine(None, activation_quant="int8").generate(messages=msgs, sampling_params=params)
    for mode in ("full", "adaptive"):
        from sparkserve import Engine
        eng = Engine(max_total_tokens=4096, speculative_algorithm="DSPARK", max_running_requests=4,
                     speculative_dspark_verify_mode=mode)       # adaptive: step costs for 4 requests
        draft = eng.scheduler.spec.draft
        assert draft.d2t is not None and draft.embed_tokens is eng.scheduler.runner.model.model.embed_tokens
        out = eng.generate(messages=msgs, sampling_params=params)
        assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref], mode
        hist = eng.scheduler.accept_hist
        if mode == "full":
            assert sum(k * v for k, v in hist.items()) > 0, hist     # some drafts accepted
        assert_no_kv_leak(eng)


def test_drafting_backs_off_when_nothing_is_verified(setups):
    """A threshold no confidence reaches: every verify budget is 0, so every step is a plain
    DECODE, and after two such proposals a request decodes plainly for 2, 4, .. tokens before
    drafting again — far fewer draft passes than decode steps, output still identical."""
    s = setups["llama"]
    eng = spec_engine(s, "random", "threshold", speculative_dspark_confidence_threshold=1.0)
    check_run(s, eng)
    lens = [n for _, n in eng.plan_log]
    assert lens and all(n == 0 for n in lens)
    from sparkserve.core.forward_batch import ForwardMode
    steps = eng.scheduler.forward_count[ForwardMode.VERIFY] + eng.scheduler.forward_count[ForwardMode.DECODE]
    speculating = [i for i in range(len(s.prompts)) if i != 4 and s.params[i]["max_new_tokens"] > 2]
    longest = max(len(s.ref[i]) for i in speculating)
    assert len(lens) < 0.5 * sum(len(s.ref[i]) for i in speculating), (len(lens), steps)
    assert eng.scheduler.forward_count[ForwardMode.DECODE] > 0 and steps >= longest - 1
    assert eng.scheduler.forward_count[ForwardMode.VERIFY] == 0    # nothing to verify: plain steps
    # A request that comes after them starts from the back-off they reached: it drafts fewer
    # times than the same request on a fresh engine, where it starts drafting at once.
    prompt, params = s.prompts[1], dict(s.params[1], max_new_tokens=20)
    fresh = spec_engine(s, "random", "threshold", speculative_dspark_confidence_threshold=1.0)
    for e in (eng, fresh):
        e.plan_log.clear()
        assert generate_ids(e, [prompt], params) == generate_ids(s.plain, [prompt], params)
    assert 0 < len(eng.plan_log) < len(fresh.plan_log), (eng.plan_log, fresh.plan_log)


def test_backed_off_requests_keep_their_draft_context_back(setups, monkeypatch):
    """Steps in which no request drafts (all backed off: a threshold no confidence reaches) keep
    their rows back, and every row kept back is injected in one batch when some request drafts or
    leaves: the same context as a fresh prefill at every step (the installed check also reads the
    kept rows), and the plain-decoding tokens."""
    from sparkserve.speculative.dspark_worker import DSparkWorker
    s = setups["llama"]
    eng = spec_engine(s, "random", "threshold", speculative_dspark_confidence_threshold=1.0)
    deferred, flushed = [], []
    defer, flush, propose = DSparkWorker.defer, DSparkWorker.flush, DSparkWorker.propose

    def checked_propose(self, reqs, *a):
        assert not self.backlog, "a request drafts with rows still kept back"
        return propose(self, reqs, *a)

    def counting_flush(self):
        flushed.append(self.backlog_rows)
        flush(self)
    monkeypatch.setattr(DSparkWorker, "defer", lambda self, *a: deferred.append(1) or defer(self, *a))
    monkeypatch.setattr(DSparkWorker, "flush", counting_flush)
    monkeypatch.setattr(DSparkWorker, "propose", checked_propose)
    check_run(s, eng)
    assert deferred, "no request kept its rows back"
    assert max(flushed) > len(s.prompts), flushed
    assert not eng.scheduler.spec.backlog


def test_no_draft_pass_where_the_batch_cannot_pay(setups, tmp_path):
    """Adaptive verify with a step-cost table where a verified row costs 0.3 of a step and a
    batch's decode step little more than one request's: from 4 requests in a forward up, even
    drafts sure to pass would not pay, so those steps run no draft pass, and ask again at every
    step (a batch too large is no reason to back off); as requests finish the rest draft again.
    Tokens as plain."""
    s = setups["llama"]
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"tokens": [1, 64], "seconds": [1.0, 1.0 + 63 * 0.3],
                                 "requests": [1, 6], "request_seconds": [1.0, 1.25]}))
    params = [dict(p, max_new_tokens=m) for p, m in zip(s.params, (60, 1, 2, 25, 16, 40))]
    ref = generate_ids(s.plain, s.prompts, params)
    eng = spec_engine(s, "fitted", "adaptive", speculative_dspark_sps_table_path=str(table))
    sched, spec = eng.scheduler, eng.scheduler.spec
    passes, skipped, large_steps = [], [], []
    propose, may_pay, run_decode = spec.propose, spec.may_pay, sched._run_decode
    spec.propose = lambda reqs, plain=0: passes.append(len(reqs) + plain) or propose(reqs, plain)
    spec.may_pay = lambda reqs, plain=0: may_pay(reqs, plain) or skipped.append(len(reqs) + plain)
    sched._run_decode = lambda: (len(sched.running) >= 4 and large_steps.append(1)) or run_decode()
    check_run(s, eng, params=params, ref=ref)
    assert passes and max(passes) <= 3, passes
    assert skipped and min(skipped) >= 4, skipped
    # (the penalty request never drafts, and the others each have a token left to draft for)
    assert len(skipped) == len(large_steps), (skipped, len(large_steps))


def test_logit_bias_requests_decode_plainly(setups):
    """A request with logit_bias (which verify's raw target logits would not see) decodes without
    drafts inside the speculating batch: every request's tokens as plain decoding gives them."""
    s = setups["llama"]
    params = [dict(p) for p in s.params]
    params[0]["logit_bias"] = {str(s.ref[0][3]): -100, "7": 5.0}    # bans a token plain decoding takes
    ref = generate_ids(s.plain, s.prompts, params)
    assert ref[0] != s.ref[0] and ref[1:] == s.ref[1:]
    eng = spec_engine(s, "fitted", "full")
    spec = eng.scheduler.spec
    biased = []
    propose = spec.propose
    spec.propose = lambda reqs, plain=0: biased.extend(r.params.logit_bias is not None for r in reqs) or \
        propose(reqs, plain)
    check_run(s, eng, params=params, ref=ref)
    assert biased and not any(biased)
