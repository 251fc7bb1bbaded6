"""The sampler's CPU kernel (kernels/sample.cpp) against the torch definition it stands in for:
at the same uniform draw, `sample_rows` picks the id that `processed_probs` + `invert_probs` pick,
for temperature, top_k (ties kept), top_p (rows whose nucleus spans most of the vocabulary
included), min_p and their combinations, on vocabularies whose size is not a multiple of the
vector width, with banned (-inf) ids, and for any subset of a batch's rows. The two compute the
probabilities with different rounding, so a draw that lands within a rounding step of a boundary
may part; everything else must agree, and no draw may land outside the distribution's support.
The logprobs kernel (`logprob_rows`) gives log_softmax's values at the chosen and the best ids."""
from __future__ import annotations

import pytest
import torch

from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.executor.sampler import Sampler, invert_probs, processed_probs
from sparkserve.kernels import load_extension, logprob_rows, sample_rows
from sparkserve.sampling_params import SamplingParams

CASES = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.5, top_p=0.97),
         dict(top_k=40), dict(top_k=40, top_p=0.8, temperature=0.8), dict(min_p=0.05),
         dict(min_p=0.1, top_p=0.9), dict(top_k=5, min_p=0.2), dict(temperature=3.0, top_p=0.999)]


@pytest.fixture(scope="module", autouse=True)
def ext():
    if load_extension() is None:
        pytest.fail("the C++ kernels did not build on this machine")


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked like a language model's (a few strong ids over a long tail), with some rows flat."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=g) * 6 + 0.05
    return torch.randn(rows, vocab, generator=g) * scale


def _kernel(x: torch.Tensor, rows: list[int], p: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    n = len(rows)
    return sample_rows(x, rows, [p.temperature] * n, [p.top_k] * n, [p.top_p] * n, [p.min_p] * n, u)


@pytest.mark.parametrize("vocab", [49152, 1000, 13])
@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_same_draw_as_the_torch_definition(vocab: int, kw: dict) -> None:
    x = _logits(64, vocab, seed=vocab)
    x[::3, :vocab // 3] = float("-inf")                     # banned ids (penalties' min_new_tokens)
    p = SamplingParams(**kw).validate(vocab)
    g = torch.Generator().manual_seed(1)
    parted = total = 0
    for _ in range(8):
        u = torch.rand(64, generator=g, dtype=torch.float64)
        probs = processed_probs(x, p)
        ours, ref = _kernel(x, list(range(64)), p, u), invert_probs(probs, u)
        assert bool((probs.gather(1, ours[:, None]) > 0).all()), "a draw outside the support"
        parted += int((ours != ref).sum())
        total += len(u)
    assert parted <= total // 200, f"{parted} of {total} draws parted"


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    x = torch.full((1, 100), -5.0)
    x[0, [10, 20, 30, 40]] = 2.0                            # top_k 2 keeps all four (HF's rule)
    p = SamplingParams(top_k=2).validate(100)
    ids = _kernel(x.expand(4000, -1).contiguous(), list(range(4000)), p,
                  torch.rand(4000, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    counts = torch.bincount(ids, minlength=100)
    assert set(ids.tolist()) == {10, 20, 30, 40} and int(counts[[10, 20, 30, 40]].min()) > 850


def test_listed_rows_only_with_their_own_params() -> None:
    x = _logits(6, 500, seed=3)
    rows, params = [4, 1, 5], [SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(top_k=3),
                               SamplingParams(min_p=0.3, temperature=2.0)]
    u = torch.tensor([0.1, 0.6, 0.95], dtype=torch.float64)
    ours = sample_rows(x, rows, [q.temperature for q in params], [q.top_k for q in params],
                       [q.top_p for q in params], [q.min_p for q in params], u)
    for j, (r, q) in enumerate(zip(rows, params)):
        assert int(ours[j]) == int(invert_probs(processed_probs(x[r:r + 1], q.validate(500)), u[j:j + 1])[0])


def test_sampler_gives_the_torch_paths_tokens(monkeypatch) -> None:
    """A batch of greedy and sampled requests with mixed params, seeded: the Sampler's tokens are
    the same with the kernel and with torch's definition (the kernel switched off)."""
    from sparkserve.executor import sampler as sampler_mod
    x = _logits(8, 3000, seed=4)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(top_k=20, seed=2), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(min_p=0.1, seed=4), SamplingParams(seed=5), SamplingParams(top_k=1, seed=6),
              SamplingParams(temperature=1.2, top_p=0.95, min_p=0.01, seed=7)]

    def run() -> list[list[int]]:
        states = [RequestSamplingState(p.validate(3000)) for p in params]
        return [Sampler().sample(x, states).next_token_ids for _ in range(30)]
    with_kernel = run()
    monkeypatch.setattr(sampler_mod, "sample_rows", lambda *a: None)
    assert run() == with_kernel


def test_other_inputs_are_left_to_torch() -> None:
    x = _logits(2, 64, seed=5)
    p = SamplingParams(top_p=0.9).validate(64)
    u = torch.rand(2, dtype=torch.float64)
    assert _kernel(x.to(torch.bfloat16), [0, 1], p, u) is None
    assert _kernel(x.t().contiguous().t(), [0, 1], p, u) is None


@pytest.mark.parametrize("vocab", [49152, 1000, 13])
def test_logprobs_equal_log_softmax(vocab: int) -> None:
    """logprob_rows: log_softmax at the chosen ids and the k best (ids in order), banned (-inf)
    entries included; k = 0 gives the chosen ones only."""
    x = _logits(12, vocab, seed=vocab + 1)
    x[::4, : vocab // 4] = float("-inf")
    rows = [11, 0, 5, 7, 4]
    ids = [int(x[11].argmax()), vocab - 1, 3, int(x[7].argmin()), 0]     # the last one banned
    raw = torch.log_softmax(x, -1)
    for k in (0, 1, min(vocab, 20)):
        chosen, top_v, top_i = logprob_rows(x, rows, ids, k)
        torch.testing.assert_close(chosen, raw[rows, ids], atol=1e-5, rtol=1e-6)
        want_v, want_i = raw[rows].topk(k, dim=-1)
        finite = want_v > float("-inf")                     # the banned ids tie: any order
        assert torch.equal(top_i[finite], want_i[finite])
        torch.testing.assert_close(top_v, want_v, atol=1e-5, rtol=1e-6)


def test_sampler_logprobs_are_the_torch_paths(monkeypatch) -> None:
    from sparkserve.executor import sampler as sampler_mod
    x = _logits(5, 2000, seed=6)
    params = [SamplingParams(return_logprob=True, top_logprobs_num=5, temperature=0.7, seed=1),
              SamplingParams(temperature=0), SamplingParams(return_logprob=True, seed=2),
              SamplingParams(return_logprob=True, top_logprobs_num=20, temperature=0),
              SamplingParams(return_logprob=True, top_logprobs_num=1, top_k=3, seed=3)]

    def run():
        out = Sampler().sample(x, [RequestSamplingState(p.validate(2000)) for p in params])
        return out.next_token_ids, out.logprobs, out.top_logprobs
    ids, lps, tops = run()
    monkeypatch.setattr(sampler_mod, "logprob_rows", lambda *a: None)
    ref_ids, ref_lps, ref_tops = run()
    assert ids == ref_ids and [t is None for t in tops] == [t is None for t in ref_tops]
    for a, b in zip(lps, ref_lps):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-5)
    for a, b in zip(tops, ref_tops):
        if a is not None:
            assert [i for i, _ in a] == [i for i, _ in b]
            assert all(abs(u - v) < 1e-5 for (_, u), (_, v) in zip(a, b))
