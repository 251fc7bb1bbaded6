"""Sampling params validation and the batched sampler, checked against transformers' logits processors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.executor.sampler import (
    Sampler,
    apply_penalties,
    processed_probs,
    sample_from_probs,
)
from sparkserve.sampling_params import SamplingParams

V = 64


def _states(params: list[SamplingParams], **kw: Any) -> list[RequestSamplingState]:
    return [RequestSamplingState(p, **kw) for p in params]


# ---------------------------------------------------------------- params


@pytest.mark.parametrize(
    "key,value",
    [
        ("temperature", -1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("max_new_tokens", -1),
        ("max_new_tokens", True),
        ("min_new_tokens", 500),
        ("min_new_tokens", -1),
        ("n", 0),
        ("top_logprobs_num", 21),
        ("top_logprobs_num", -1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["x"] * 17),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [V]),
        ("stop_token_ids", "1"),
        ("seed", 1.5),
        ("seed", "7"),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("no_stop_trim", None),
        ("return_logprob", 0),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {"\u00b2": 1.0}),
        ("logit_bias", {"-1": 1.0}),
        ("logit_bias", {str(V): 1.0}),
        ("logit_bias", {"3": 100.5}),
        ("logit_bias", {"3": float("inf")}),
        ("logit_bias", {"3": "up"}),
    ],
)
def test_bad_value_names_param(key: str, value: Any) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{key: value}).validate(vocab_size=V)
    assert str(e.value).startswith(key), str(e.value)


def test_from_dict_aliases_unknown_and_defaults() -> None:
    p = SamplingParams.from_dict({"max_tokens": 7, "sampling_seed": 3, "top_k": 0, "stop": "END"})
    assert (p.max_new_tokens, p.seed, p.top_k, p.stop_strings) == (7, 3, -1, ["END"])
    assert SamplingParams().stop_strings == [] and not SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    with pytest.raises(ValueError, match="^tempurature"):
        SamplingParams.from_dict({"tempurature": 0.5})
    with pytest.raises(ValueError, match="^max_new_tokens"):
        SamplingParams.from_dict({"max_tokens": 5, "max_new_tokens": 6})
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams.from_dict({"temperature": -0.5})


# ---------------------------------------------------------------- greedy / seeds


def test_greedy_fast_path_and_top_k_1_equal_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    want = logits.argmax(-1).tolist()
    out = Sampler().sample(logits, _states([SamplingParams(temperature=0)] * 5))
    assert out.next_token_ids == want and out.logprobs == [None] * 5
    mixed = [SamplingParams(top_k=1, temperature=0.7),
             SamplingParams(temperature=0)] * 2 + [SamplingParams(top_k=1)]
    assert Sampler().sample(logits, _states(mixed)).next_token_ids == want
    assert torch.equal(processed_probs(logits, SamplingParams(temperature=0)).argmax(-1), logits.argmax(-1))


def test_seeded_sampling_reproducible() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))

    def run(seed: int) -> list[list[int]]:
        states = _states([SamplingParams(seed=seed, temperature=1.3)] * 4)
        return [Sampler().sample(logits, states).next_token_ids for _ in range(20)]

    assert run(11) == run(11)
    assert run(11) != run(12)
    # Unseeded requests follow the global RNG.
    torch.manual_seed(5)
    a = [Sampler().sample(logits, _states([SamplingParams()] * 4)).next_token_ids for _ in range(5)]
    torch.manual_seed(5)
    b = [Sampler().sample(logits, _states([SamplingParams()] * 4)).next_token_ids for _ in range(5)]
    assert a == b


def test_seeded_row_independent_of_batch_neighbours() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    alone = RequestSamplingState(SamplingParams(seed=9))
    paired = _states([SamplingParams(temperature=0.5, seed=1), SamplingParams(seed=9),
                      SamplingParams(temperature=0)])
    for _ in range(10):
        single = Sampler().sample(logits[1:2], [alone]).next_token_ids[0]
        assert single == Sampler().sample(logits, paired).next_token_ids[1]


def test_top_p_tiny_keeps_only_argmax_and_min_p() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(top_p=1e-6)
    probs = processed_probs(logits, p)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())
    assert Sampler().sample(logits, _states([p] * 6)).next_token_ids == logits.argmax(-1).tolist()
    raw = logits.softmax(-1)
    mp = processed_probs(logits, SamplingParams(min_p=0.3))
    keep = raw >= 0.3 * raw.amax(-1, keepdim=True)
    assert torch.equal(mp > 0, keep)
    torch.testing.assert_close(mp, (raw * keep) / (raw * keep).sum(-1, keepdim=True))


# ---------------------------------------------------------------- vs transformers


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(top_p=0.8),
        dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),
        dict(min_p=0.2, temperature=1.5),
        dict(repetition_penalty=1.3, temperature=0.9, top_p=0.95),
        dict(repetition_penalty=0.7, top_k=10),
    ],
)
def test_distribution_matches_transformers(kw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, V, generator=gen) * 3
    prompt = torch.randint(0, V, (3, 12), generator=gen)
    params = SamplingParams(**kw).validate(V)
    states = [RequestSamplingState(params, prompt_token_ids=prompt[i].tolist()) for i in range(3)]
    ours = processed_probs(apply_penalties(logits, states), params)

    ref = logits.clone()
    procs: list[Any] = []
    if params.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        procs.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        procs.append(MinPLogitsWarper(params.min_p))
    for proc in procs:
        ref = proc(prompt, ref)
    torch.testing.assert_close(ours, ref.softmax(-1), atol=1e-6, rtol=1e-5)
    assert torch.allclose(ours.sum(-1), torch.ones(3))


def test_frequency_presence_and_repetition_over_generated() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, V, generator=gen)
    prompt = [1, 2, 3, 3]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=1.0, repetition_penalty=1.2),
    ]
    states = _states(params, prompt_token_ids=prompt)
    generated = [5, 7, 5, 5, 3, V + 3]     # an id past the model's vocabulary is left out
    apply_penalties(logits, states)  # applied before the observes too: later ones must still count
    for t in generated:
        for s in states:
            s.observe(t)
    late = _states(params, prompt_token_ids=prompt)  # observes before any penalty was applied
    for t in generated:
        for s in late:
            s.observe(t)
    want = logits.clone()
    for r, p in enumerate(params):
        if p.repetition_penalty != 1:
            for t in set(prompt + generated) - {V + 3}:
                v = want[r, t]
                want[r, t] = v * p.repetition_penalty if v < 0 else v / p.repetition_penalty
        for t in set(generated) - {V + 3}:  # OpenAI: generated tokens only
            want[r, t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    torch.testing.assert_close(apply_penalties(logits, states), want)
    torch.testing.assert_close(apply_penalties(logits, late), want)


def test_penalties_reach_only_their_own_rows() -> None:
    """A batch mixing rows without penalties, with a repetition penalty and with frequency /
    presence ones: each row gets its own, over its own prompt and output."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5),
              SamplingParams(frequency_penalty=0.7, presence_penalty=0.2), SamplingParams()]
    prompts = [[1, 2], [3, 4, 4], [5, 6], [7]]
    outputs = [[8], [9, 3], [10, 10, 5], [11]]
    states = [RequestSamplingState(p, prompt_token_ids=pr) for p, pr in zip(params, prompts)]
    for s, out in zip(states, outputs):
        for t in out:
            s.observe(t)
    want = logits.clone()
    for t in {3, 4, 9}:
        want[1, t] = want[1, t] * 1.5 if want[1, t] < 0 else want[1, t] / 1.5
    for t, n in ((10, 2), (5, 1)):
        want[2, t] -= 0.7 * n + 0.2
    torch.testing.assert_close(apply_penalties(logits, states), want)


def test_logit_bias_reaches_only_its_rows() -> None:
    """OpenAI's logit_bias (keys as JSON gives them, strings) is added to its own row's logits,
    after the penalties: +100 makes a greedy row's token certain; logprobs stay the raw ones."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={"5": 100, "7": -3.5},
                                                            return_logprob=True),
              SamplingParams(repetition_penalty=2.0, logit_bias={9: 2})]
    for p in params:
        p.validate(vocab_size=V)
    assert params[1].logit_bias == {5: 100.0, 7: -3.5}
    states = _states(params, prompt_token_ids=[9])
    want = logits.clone()
    want[1, 5] += 100
    want[1, 7] -= 3.5
    want[2, 9] = (want[2, 9] * 2 if want[2, 9] < 0 else want[2, 9] / 2) + 2
    torch.testing.assert_close(apply_penalties(logits, states), want)
    out = Sampler().sample(logits, states)
    assert out.next_token_ids[:2] == [int(logits[0].argmax()), 5]
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[5].item(), abs=1e-5)
    alone = _states([SamplingParams(temperature=0, logit_bias={5: 100.0})])   # no other row to go slow for
    assert Sampler().sample(logits[:1], alone).next_token_ids == [5]


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, 2] = 100.0  # eos would always win
    logits[0, 9] = 90.0  # then the stop id
    state = RequestSamplingState(SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[9]),
                                 eos_token_ids=[2])
    s = Sampler()
    for _ in range(2):
        tok = s.sample(logits, [state]).next_token_ids[0]
        assert tok not in (2, 9)
        state.observe(tok)
    assert s.sample(logits, [state]).next_token_ids == [2]


# ---------------------------------------------------------------- statistics


# Upper 0.1% points of chi-square with df degrees of freedom: a correct sampler fails with
# probability 0.001 per check (and never, given the fixed seeds below).
CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588,
            31.264, 32.909, 34.528, 36.123, 37.697]  # fmt: skip


def _chi_square_ok(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "sampled a token outside the nucleus"
    expected = probs.double()[kept] * len(tokens)
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert 1 <= df <= len(CHI2_999)
    assert stat < CHI2_999[df - 1], f"chi2={stat:.2f} df={df}"


def test_chi_square_top_p_follows_processed_probs() -> None:
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    probs = processed_probs(logits, params)[0]
    assert 1 < int((probs > 0).sum()) < 16  # the nucleus really cut something
    n = 20000
    draws = sample_from_probs(probs.expand(n, 16), torch.Generator().manual_seed(123))
    _chi_square_ok(draws.tolist(), probs)
    # Same through the batched Sampler: 4000 requests with their own seeds, one step.
    states = [RequestSamplingState(SamplingParams(top_p=0.9, seed=s)) for s in range(4000)]
    _chi_square_ok(Sampler().sample(logits.expand(4000, 16), states).next_token_ids, probs)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(return_logprob=True, top_logprobs_num=5, temperature=0.5, repetition_penalty=1.5,
                       seed=1),
        SamplingParams(return_logprob=True, temperature=0),
        SamplingParams(seed=2),
        SamplingParams(return_logprob=True, top_logprobs_num=20, top_k=3, seed=3),
    ]
    states = _states(params, prompt_token_ids=[0, 1, 2])
    out = Sampler().sample(logits, states)
    raw = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.next_token_ids):
        if params[i].return_logprob:
            assert math.isclose(out.logprobs[i], float(raw[i, tok]), abs_tol=1e-5)  # type: ignore[arg-type]
        else:
            assert out.logprobs[i] is None
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    for i, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert top[0][0] == int(raw[i].argmax())
        for tok, v in top:
            assert math.isclose(v, float(raw[i, tok]), abs_tol=1e-5)


@pytest.mark.parametrize("scale, full_sort", [(8.0, False), (4.0, False), (0.05, True)])
def test_top_p_large_vocab_matches_transformers_without_a_full_sort(scale, full_sort, monkeypatch) -> None:
    """49,152 tokens (SmolLM2's vocabulary): peaked rows find their nucleus among the 64 or 1024
    best tokens, and then no full sort runs (torch.sort is made to fail); a nearly flat row
    needs it. Either way the distribution is transformers' TopPLogitsWarper's."""
    from sparkserve.executor import sampler as sampler_mod
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 49152, generator=gen) * scale
    params = SamplingParams(top_p=0.9).validate(49152)
    if not full_sort:
        def no_sort(*a, **k):
            raise AssertionError("full sort of the vocabulary")
        monkeypatch.setattr(sampler_mod.torch, "sort", no_sort)
    ours = processed_probs(logits, params)
    monkeypatch.undo()
    ref = TopPLogitsWarper(0.9)(torch.zeros(4, 1, dtype=torch.long), logits.clone()).softmax(-1)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_top_p_rows_go_as_far_as_each_needs(monkeypatch) -> None:
    """One batch of rows whose nuclei lie within 64, within 1024 and beyond 1024 tokens: only the
    last row is sorted, and every row is transformers' TopPLogitsWarper's."""
    from sparkserve.executor import sampler as sampler_mod
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(5, 49152, generator=gen) * torch.tensor([[8.0], [3.0], [0.05], [8.0], [3.3]])
    sorted_rows, sort = [], torch.sort

    def counting_sort(x, *a, **k):
        sorted_rows.append(x.shape[0])
        return sort(x, *a, **k)
    monkeypatch.setattr(sampler_mod.torch, "sort", counting_sort)
    ours = processed_probs(logits, SamplingParams(top_p=0.9, temperature=0.8).validate(49152))
    monkeypatch.undo()
    ref = TopPLogitsWarper(0.9)(torch.zeros(5, 1, dtype=torch.long), logits / 0.8).softmax(-1)
    kept = (ref > 0).sum(-1).tolist()
    assert kept[0] <= 64 < kept[1] <= 1024 < kept[2] and kept[3] <= 64 < kept[4] <= 1024, kept
    assert sorted_rows == [1]
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_draws_follow_probs_across_a_large_vocabulary() -> None:
    """The two-level inverse transform over 49,152 ids: mass at both edges of blocks, in the last
    id, in a block of its own and beside zero-mass blocks; no draw lands on a zero-mass id."""
    probs = torch.zeros(49152)
    ids = torch.tensor([0, 5, 255, 256, 511, 30000, 49151])
    probs[ids] = torch.tensor([0.05, 0.1, 0.2, 0.15, 0.1, 0.25, 0.15])
    n = 20000
    draws = sample_from_probs(probs.expand(n, -1), torch.Generator().manual_seed(4))
    _chi_square_ok(draws.tolist(), probs)
    # one generator per row: the Sampler's case
    gens = [torch.Generator().manual_seed(s) for s in range(4000)]
    _chi_square_ok(sample_from_probs(probs.expand(4000, -1), gens).tolist(), probs)
