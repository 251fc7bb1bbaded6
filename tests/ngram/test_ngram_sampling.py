"""NGRAM sampling is lossless: seeded continuations drawn with NGRAM speculation follow the target's
exact sampling distribution (by enumeration from the transformers model), for temperature 1, top_p
and top_k, with the chi-square checks the DSpark sampling test makes (dspark_fixtures.
assert_continuations_fit: alpha 1e-3 per check, cells of expected count < 5 pooled, fixed seeds).
The prompt holds the target's greedy continuation of a seed (it falls into a loop), so the likely
first tokens occurred before and a request verifies the two tokens that followed them: point-mass
drafts, accepted with probability p(d), rejected ones resampled from p without d.

Also the suffix matcher against a brute-force search."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from dspark_fixtures import (
    assert_continuations_fit,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    exact_distributions,
    load_hf,
    make_target,
)

from sparkserve.sampling_params import SamplingParams
from sparkserve.speculative.ngram import continuation, longest_suffix_match

V = 24
N = 3000
SEED = [3, 7, 1, 9]
MAX_NEW = 4            # t1 from prefill; t2, t3 from one verify of 2 drafts (+ t4 bonus if both pass)
CONFIGS = {"temperature1": dict(temperature=1.0), "top_p0.8": dict(temperature=1.0, top_p=0.8),
           "top_k5": dict(temperature=1.0, top_k=5)}


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    target = make_target(str(tmp_path_factory.mktemp("ngram_sampling") / "target"), "llama", hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=V, initializer_range=0.7)
    hf = load_hf(target)
    global PROMPT
    PROMPT = hf.generate(torch.tensor([SEED]), max_new_tokens=28, do_sample=False)[0].tolist()
    return target, hf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampling_matches_target_distribution(hf_target, name):
    target, hf = hf_target
    sp = CONFIGS[name]
    eng = engine(target, speculative_algorithm="NGRAM", speculative_dspark_verify_mode="full",
                 max_running_requests=256)      # every draft found is verified
    outs = eng.generate(input_ids=[PROMPT] * N,
                        sampling_params=[dict(sp, max_new_tokens=MAX_NEW, seed=i) for i in range(N)])
    t = torch.tensor([o["output_ids"] for o in outs])
    assert t.shape == (N, MAX_NEW)
    hist = eng.scheduler.accept_hist
    print(name, PROMPT, dict(sorted(hist.items())))
    # rejections at both slots and full accepts (the bonus path) ran
    assert hist.get(0, 0) and hist.get(1, 0) and hist.get(2, 0), hist

    assert_continuations_fit(t, exact_distributions(hf, PROMPT, SamplingParams(**sp), V, MAX_NEW), name)


# ---- the matcher -------------------------------------------------------------------------------
def brute_force(seq: list[int], lo: int, hi: int, count: int, by_frequency: bool) -> list[int]:
    """The longest suffix (<= hi tokens, >= lo) that occurred earlier with a token after it; its
    continuation read off the sequence as it grows with the drafts (BFS: the latest occurrence;
    PROB: per step the token most agreeing occurrences continue with, ties to the latest)."""
    n = len(seq)
    for k in range(min(hi, n - 1), lo - 1, -1):
        ends = [e for e in range(k - 1, n - 1) if seq[e - k + 1:e + 1] == seq[n - k:]]
        if ends:
            break
    else:
        return []
    ext = list(seq)
    if not by_frequency:
        ends = ends[-1:]
    for i in range(count):
        vals = [ext[e + 1 + i] for e in ends]
        best = max(vals.count(v) for v in vals)
        tok = [v for v in vals if vals.count(v) == best][-1]
        ends = [e for e, v in zip(ends, vals) if v == tok]
        ext.append(tok)
    return ext[n:]


@pytest.mark.parametrize("by_frequency", [False, True])
def test_matcher_equals_brute_force(by_frequency):
    rng = random.Random(3)
    for trial in range(400):
        alphabet = rng.choice([2, 3, 5, 40])
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        if trial % 3 == 0 and len(seq) > 4:           # a copied span, as in an edit
            a = rng.randrange(len(seq) - 3)
            seq += seq[a:a + rng.randrange(2, 12)]
        lo, hi, count = rng.choice([1, 2, 3]), rng.choice([1, 3, 12]), rng.randrange(1, 9)
        hi = max(lo, hi)
        h = np.array(seq + [99] * 7, dtype=np.int64)  # spare capacity beyond n, as a history keeps
        k, ends = longest_suffix_match(h, len(seq), lo, hi)
        got = continuation(h, len(seq), ends, count, by_frequency) if k else []
        assert got == brute_force(seq, lo, hi, count, by_frequency), (seq, lo, hi, count)
