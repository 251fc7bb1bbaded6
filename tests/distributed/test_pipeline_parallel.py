"""Pipeline parallelism on torch.distributed (gloo, 1 torch thread per rank): stages of
contiguous layers give the single-process engine's greedy tokens and logprobs (with TP inside the
stages too); DSpark captures its taps on every stage — Llama and Kimi-Linear, SGLang's
"DSPARK aux hidden capture requires PP=1" case — and stays token-identical to plain decoding,
with retraction forced; return_hidden_states under PP equals the single-process capture."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, assert_no_kv_leak
from dspark_fixtures import make_oracle_draft
from kimi_fixtures import VOCAB as KIMI_VOCAB
from kimi_fixtures import make_kimi
from parallel_fixtures import COMMON, PROMPTS, assert_same, bigram_of, run_mixed

from sparkserve import Engine
from sparkserve.distributed.mirror import micro_batch_bounds

SPLIT = dict(pp_micro_batch_min_tokens=1)      # these tiny steps split into micro-batches too


@pytest.mark.parametrize("layout,first", [
    (dict(pp_size=2), 2), (dict(pp_size=2, pp_layer_partition=[1, 2]), 1), (dict(pp_size=3, **SPLIT), 1),
    (dict(pp_size=2, tp_size=2, **SPLIT), 2), (dict(pp_size=2, pp_micro_batches=3, **SPLIT), 2)])
def test_stages_equal_one_process(layout, first, llama_dir):
    """The tiny Llama's 3 layers over 2 or 3 stages (the driver keeps the first `first`)."""
    want = run_mixed(Engine(llama_dir, **COMMON))
    with Engine(llama_dir, **layout, **COMMON) as eng:
        got = run_mixed(eng)
        assert eng.scheduler.runner.model.layer_range == range(0, first)
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)


def test_micro_batches_split_requests_by_tokens():
    assert micro_batch_bounds([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert micro_batch_bounds([40, 1, 1], 2) == [(0, 1), (1, 3)]       # a long chunk alone
    assert micro_batch_bounds([1, 1, 40], 3) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batch_bounds([5], 4) == [(0, 1)]
    assert micro_batch_bounds([3, 3, 3, 3, 3], 2) == [(0, 3), (3, 5)]
    assert micro_batch_bounds([1] * 32, 2, min_tokens=64) == [(0, 32)]    # a decode step runs whole
    assert micro_batch_bounds([64, 64, 64], 4, min_tokens=64) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batch_bounds([100, 20], 2, min_tokens=64) == [(0, 2)]      # 120 tokens: one part


def test_stages_run_micro_batches(llama_dir):
    """A step splits its requests into one micro-batch per stage (or --pp-micro-batches), each of
    at least --pp-micro-batch-min-tokens tokens, and the driver's stage runs once per micro-batch;
    by default (64) the tiny steps here run whole. The tokens stay the single process's (above)."""
    for micro, parts, min_tokens in ((0, 2, 1), (3, 3, 1), (0, 2, 64)):
        with Engine(llama_dir, pp_size=2, pp_micro_batches=micro, pp_micro_batch_min_tokens=min_tokens,
                    **COMMON) as eng:
            runner, model = eng.scheduler.runner, eng.scheduler.runner.model
            forward, run, calls, steps = model.forward, runner.hidden_states, [], []

            def counted_forward(*a, **kw):
                calls.append(a[2].batch_size)
                return forward(*a, **kw)

            def counted_run(batch):
                calls.clear()
                out = run(batch)
                steps.append((batch.batch_size, batch.num_tokens, len(batch.parts()), list(calls)))
                return out
            model.forward, runner.hidden_states = counted_forward, counted_run
            eng.generate(input_ids=PROMPTS[:3], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert any(b == 3 for b, _, _, _ in steps), steps
        for b, tokens, n, sizes in steps:
            assert n == max(1, min(b, parts, tokens // min_tokens)), steps
            assert len(sizes) == n and sum(sizes) == b, steps
        assert any(n > 1 for _, _, n, _ in steps) == (min_tokens == 1), steps


def _dspark_case(path: str, draft_dir: str, vocab: int, misses: bool = True, **kw):
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    plain = Engine(path, **COMMON).generate(input_ids=PROMPTS, sampling_params=sp)
    draft = make_oracle_draft(path, draft_dir, bigram_of(PROMPTS, [o["output_ids"] for o in plain], vocab),
                              block_size=4)
    args = dict(COMMON, **kw)
    with Engine(path, pp_size=2, pp_micro_batch_min_tokens=1, speculative_algorithm="DSPARK",
                speculative_draft_model_path=draft, speculative_dspark_verify_mode="full", **args) as eng:
        got = eng.generate(input_ids=PROMPTS, sampling_params=sp)
        hist, retracted = dict(eng.scheduler.accept_hist), eng.scheduler.num_retractions
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    assert sum(k * v for k, v in hist.items()) > 0 and (hist.get(0, 0) > 0) == misses, hist  # accepts, misses
    return retracted


def test_dspark_llama_pp2(llama_dir, tmp_path):
    _dspark_case(llama_dir, str(tmp_path / "draft"), TINY_CONFIGS["llama"]["vocab_size"])


@pytest.mark.parametrize("pool", [2048, 96])
def test_dspark_kimi_linear_pp2(tmp_path, pool):
    """Kimi-Linear's KDA state lives on the stage of its layer: after each VERIFY every stage
    commits its own accepted tokens; a small pool retracts requests on both stages."""
    path = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    retracted = _dspark_case(path, str(tmp_path / "draft"), KIMI_VOCAB, max_total_tokens=pool)
    assert (retracted > 0) == (pool < 2048)


def test_hidden_states_under_pp(llama_dir, tmp_path):
    """Final rows from the last stage, aux taps from both (layers 0 and 1 of stages [0, 1] and
    [2])."""
    from dspark_fixtures import make_random_draft
    draft = make_random_draft(llama_dir, str(tmp_path / "draft"), target_layer_ids=[0, 1])
    kw = dict(COMMON, disable_radix_cache=True, enable_return_hidden_states=True,
              speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
              speculative_dspark_verify_mode="full")
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    want = Engine(llama_dir, **kw).generate(input_ids=PROMPTS[:3], sampling_params=sp,
                                            return_hidden_states=True)
    with Engine(llama_dir, pp_size=2, **kw) as eng:
        got = eng.generate(input_ids=PROMPTS[:3], sampling_params=sp, return_hidden_states=True)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        for key in ("hidden_states", "aux_hidden_states"):
            torch.testing.assert_close(g["meta_info"][key], w["meta_info"][key], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "phi3_longrope", "olmo2", "olmo3", "granite", "qwen3_moe"])
def test_families_pp2(name, tmp_path):
    """The families of issue #45 over two stages (the LM head and its logits scaling on the first,
    the final norm on the last; Gemma 3's and OLMo 3's two rope tables and split pool; a MoE layer
    on each) equal one process."""
    from family_fixtures import make_family_checkpoint
    path = make_family_checkpoint(name, str(tmp_path / name))
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, pp_size=2, **SPLIT, **COMMON) as eng:
        got = run_mixed(eng)
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)


def test_dspark_gemma3_pp2(tmp_path):
    """DSpark on a new family (taps on both stages of Gemma 3: scaled embedding, sandwich norms,
    sliding layers in their own pool) stays token-identical to plain decoding (its answers repeat
    their bigrams: the oracle draft is accepted whole)."""
    from family_fixtures import make_family_checkpoint
    path = make_family_checkpoint("gemma3", str(tmp_path / "gemma3"))
    _dspark_case(path, str(tmp_path / "draft"), TINY_CONFIGS["llama"]["vocab_size"], misses=False)
