"""NGRAM greedy decoding is token-identical to plain decoding, and on copy-heavy text it commits
several tokens per verify.

Two tiny random llama targets: an ordinary one (its greedy outputs fall into loops now and then,
which NGRAM catches, and otherwise miss), and a "copier" whose attention and MLP outputs are zero,
so its greedy next token is a fixed function f of the current token: a prompt that walks f and
then returns to its start is continued by copying it, which NGRAM drafts from the prompt. One mixed
batch per run (prompt lengths 1..40, max_new_tokens 1 and 2, a stop token mid-generation, a
repetition penalty request that decodes plainly inside the VERIFY forwards), then the memory paths:
chunked prefill, prefix-cache hits, page_size 4, retraction; every one checked against plain
decoding and for KV leaks."""
from __future__ import annotations

import json

import pytest
from dspark_fixtures import (
    GreedyBatch,
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    load_hf,
    make_target,
    next_token_map,
    zero_attn_and_mlp_out,
)

from sparkserve.core.forward_batch import ForwardMode

LENGTHS = (1, 5, 17, 40, 9, 3)
MAX_NEW = (40, 1, 2, 45, 36, 38)
STOP_REQ, PENALTY_REQ = 3, 4


def ngram_engine(target: str, mode: str = "full", **kw):
    """full: every draft found is verified (the default, adaptive, plans with step costs measured
    at start-up, which on a tiny model may verify none)."""
    return engine(target, speculative_algorithm="NGRAM", speculative_dspark_verify_mode=mode, **kw)


def copy_prompt(f: list[int], start: int, walk: int, filler: list[int]) -> list[int]:
    """start, f(start), .. (walk tokens), then filler, then start again: the copier's greedy
    continuation copies the walk."""
    seq = [start]
    for _ in range(walk - 1):
        seq.append(f[seq[-1]])
    return seq + filler + [start]


class Setup(GreedyBatch):
    """The ordinary target (its plain engine, the mixed batch, plain outputs) and the copier."""

    def __init__(self, root):
        super().__init__(root, "llama", LENGTHS, MAX_NEW, STOP_REQ, PENALTY_REQ)
        self.copier = make_target(str(root / "copier"), "llama", edit=zero_attn_and_mlp_out)
        self.f = next_token_map(load_hf(self.copier))
        self.copier_plain = engine(self.copier)


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("ngram_greedy"))


def check_run(s: Setup, eng, prompts=None, params=None, ref=None):
    out = generate_ids(eng, prompts or s.prompts, params or s.params)
    assert out == (ref or s.ref)
    assert_no_kv_leak(eng)
    return out


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_greedy_matches_plain(s, match_type):
    eng = ngram_engine(s.target, speculative_ngram_match_type=match_type)
    check_run(s, eng)
    sched = eng.scheduler
    assert sched.forward_count[ForwardMode.VERIFY] > 0, "no draft was ever verified"
    # the random target rejects some drafts: both outcomes ran
    assert sched.accept_hist.get(0, 0) > 0 and max(sched.accept_hist) >= 1, sched.accept_hist


@pytest.mark.parametrize("kw", [dict(chunked_prefill_size=4), dict(page_size=4),
                                dict(speculative_num_draft_tokens=3), dict(max_total_tokens=100)],
                         ids=["chunked_prefill", "page_size_4", "two_drafts", "retraction"])
def test_memory_paths(s, kw):
    eng = ngram_engine(s.target, **kw)
    check_run(s, eng)
    if "max_total_tokens" in kw:
        assert eng.scheduler.num_retractions > 0


def test_adaptive_with_measured_step_costs(s):
    """The default: the planner measures the step costs at start-up and plans with the drafts'
    acceptance so far (whatever it verifies, the output is plain decoding's)."""
    eng = engine(s.target, speculative_algorithm="NGRAM")
    assert eng.scheduler.spec.planner.mode == "adaptive" and eng.scheduler.spec.planner.costs is not None
    check_run(s, eng)


def test_prefix_cache_hit(s):
    """A repeated prompt and a continuation of a finished request hit the prefix cache; NGRAM
    reads the whole token history whatever the cache served."""
    eng = ngram_engine(s.target)
    check_run(s, eng)
    again = [s.prompts[3], s.prompts[0] + s.ref[0][:30] + [7, 8]]
    params = dict(temperature=0, max_new_tokens=24)
    ref = generate_ids(s.plain, again, params)
    outs = eng.generate(input_ids=again, sampling_params=params)
    assert [o["output_ids"] for o in outs] == ref
    assert outs[1]["meta_info"]["cached_tokens"] >= len(s.prompts[0]) + 20
    assert_no_kv_leak(eng)


@pytest.mark.parametrize("mode", ["full", "adaptive"])
def test_copy_heavy_prompt_verifies_several_tokens_per_step(s, mode, tmp_path):
    """The copier continues a prompt that returns to its start by copying it: NGRAM drafts the
    copy from the prompt, and the verifies commit several tokens each (accept_hist), with the
    output still plain decoding's; max_new_tokens cuts a block mid-way. Adaptive: a step-cost
    table where a verify costs 1 + 0.1 per token, the planner learning the drafts' acceptance."""
    prompts = [copy_prompt(s.f, start, 30, [5, 6]) for start in (11, 40, 77)]
    params = [dict(temperature=0, max_new_tokens=m) for m in (24, 31, 7)]
    ref = generate_ids(s.copier_plain, prompts, params)
    for p, r in zip(prompts, ref):            # the reference really copies the walk
        assert r[:min(len(r), 20)] == p[1:1 + min(len(r), 20)]
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"tokens": [1, 64], "seconds": [1.0, 7.3]}))
    eng = ngram_engine(s.copier, mode, **({"speculative_dspark_sps_table_path": str(table)}
                                          if mode == "adaptive" else {}))
    assert generate_ids(eng, prompts, params) == ref
    hist = eng.scheduler.accept_hist
    verifies = sum(hist.values())
    committed = sum((k + 1) * v for k, v in hist.items())
    # (adaptive starts from short verifies while it learns how well these drafts do)
    assert verifies and committed / verifies > (3 if mode == "full" else 2.5), hist
    assert_no_kv_leak(eng)


def test_no_match_does_not_back_off(s, monkeypatch):
    """Finding no match is not a draft that failed to pay (no draft pass ran): a request whose
    latest tokens never occurred before looks again at its next step instead of backing off, so a
    loop that starts late is caught at once."""
    from sparkserve.speculative.ngram import NgramWorker
    found = []
    propose = NgramWorker.propose

    def recording(self, reqs, *a):
        out = propose(self, reqs, *a)
        found.extend(bool(p.tokens) for p in out)
        return out
    monkeypatch.setattr(NgramWorker, "propose", recording)
    eng = ngram_engine(s.target)
    prompt, params = s.prompts[0], dict(temperature=0, max_new_tokens=40)
    assert generate_ids(eng, [prompt], params) == generate_ids(s.plain, [prompt], params)
    steps = eng.scheduler.forward_count[ForwardMode.VERIFY] + eng.scheduler.forward_count[ForwardMode.DECODE]
    assert found.count(False) >= 2 and any(found), found       # misses in a row, then matches
    assert len(found) == steps - 1             # every step but the last (one token left) looked


def test_worker_satisfies_the_interface(s):
    from sparkserve.speculative.ngram import NgramWorker
    from sparkserve.speculative.worker import SpecWorker
    eng = ngram_engine(s.target)
    spec = eng.scheduler.spec
    assert isinstance(spec, NgramWorker) and isinstance(spec, SpecWorker)
    assert spec.num_drafts == 11 and spec.draft_pools() == []
    assert spec.describe()["algorithm"] == "NGRAM"
