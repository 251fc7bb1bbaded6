"""DSpark sampling is lossless: seeded continuations drawn with speculative decoding follow the
target's exact sampling distribution (computed by enumeration from the transformers model), for
temperature 1, top_p and top_k; plus unit tests of the accept rules in speculative/verify.py.

Every goodness-of-fit check uses Pearson's chi-square with cells of expected count < 5 pooled,
and fails when the statistic exceeds the critical value at a false-alarm rate of 1e-3 per check
(alpha = 1e-3). Seeds are fixed (request i uses seed=i; Monte Carlo uses a seeded generator), so
each test is deterministic: it either always passes or always fails on a given torch build."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import (
    assert_continuations_fit,
    assert_fits,
    chi2_critical,
    chi_square_gof,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    exact_distributions,
    load_hf,
    make_target,
)

from sparkserve.sampling_params import SamplingParams
from sparkserve.speculative.verify import accept_greedy, accept_sampling

V = 24                # target vocabulary
N = 3000              # seeded continuations per configuration
PROMPT = [3, 7, 1, 9]
MAX_NEW = 4           # t1 from prefill; t2, t3 from one verify of 2 drafts (+ t4 bonus if both pass)


def test_chi_square_helpers():
    """The hand-written chi-square tail matches table values, and the test rejects a wrong fit."""
    for df, table in [(1, 10.828), (4, 18.467), (10, 29.588), (50, 86.661), (100, 149.449)]:
        assert abs(chi2_critical(df, 1e-3) - table) < 2e-3 * table
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = torch.multinomial(p, 4000, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=4).tolist()
    assert_fits(counts, p.tolist(), "multinomial draws")
    with pytest.raises(AssertionError):
        assert_fits(counts, [0.45, 0.35, 0.15, 0.05], "wrong probabilities")
    with pytest.raises(AssertionError):
        chi_square_gof([1, 0, 5], [0.0, 0.5, 0.5])      # an impossible outcome was drawn


# ---- end to end: DSpark engine vs exact target distribution ----------------------------------
@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_sampling")
    # initializer_range 0.5 keeps every step's distribution spread over several tokens (at 1.0
    # the first step of this tiny model puts 0.998 on one token and the test would see little).
    target = make_target(str(root / "target"), "llama", hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         vocab_size=V, initializer_range=0.5)
    return target, load_hf(target)


@pytest.fixture(scope="module")
def draft_dir(hf_target, tmp_path_factory):
    """A random draft (backbone, confidence head: random; embedding / LM head shared with the
    target) whose Markov head adds 0.8 x the target's logits after PROMPT + [prev] and whose
    final norm is damped to 0.3: its q is related to p but not equal, so verifies see a mix of
    rejections at slot 0, rejections at slot 1 and full accepts (the bonus path)."""
    from sparkserve.config import ModelConfig
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft, save_dspark_draft
    target, hf = hf_target
    cfg = dspark_config_dict(ModelConfig.from_hf_dir(target), num_layers=1, block_size=3,
                             mask_token_id=0, markov_rank=V)
    d = init_dspark_draft(cfg, seed=5, std=0.3)
    with torch.no_grad():
        table = hf(torch.tensor([PROMPT + [x] for x in range(V)])).logits[:, -1]     # [prev, V]
        d.norm.weight.fill_(0.3)
        d.markov_head.markov_w1.weight.copy_(torch.eye(V))
        d.markov_head.markov_w2.weight.copy_(0.8 * table.T)
    path = str(tmp_path_factory.mktemp("dspark_sampling_draft"))
    save_dspark_draft(d, path, include_shared=False)
    return path


@pytest.fixture(scope="module")
def reduced_draft_dir(hf_target, draft_dir, tmp_path_factory):
    """The same draft with a reduced vocab of 15 of the 24 ids (d2t): its q is zero on the
    other 9, so every draw of those must come from the residual max(p - q, 0)."""
    import json
    import os

    from sparkserve.models.dspark_draft import DSparkConfig, DSparkDraft, load_dspark_draft, save_dspark_draft
    target, _ = hf_target
    full = load_dspark_draft(draft_dir, _load_target(target))
    keep = torch.tensor([i for i in range(V) if i % 3 != 1][:15])
    cfg = dict(json.load(open(os.path.join(draft_dir, "config.json"))), draft_vocab_size=len(keep))
    d = DSparkDraft(DSparkConfig.from_dict(cfg))
    d.rotary.build()
    sd = {k: v for k, v in full.state_dict().items() if k != "d2t"}
    sd["lm_head.weight"] = full.lm_head.weight[keep]
    sd["markov_head.markov_w2.weight"] = full.markov_head.markov_w2.weight[keep]
    d.load_state_dict(sd, strict=False)
    d.d2t.copy_(keep - torch.arange(len(keep)))
    path = str(tmp_path_factory.mktemp("dspark_sampling_reduced"))
    save_dspark_draft(d, path, include_shared=False)
    return path


def _load_target(path):
    from sparkserve.models.registry import load_model
    return load_model(path)


CONFIGS = {
    "temperature1": dict(temperature=1.0),
    "top_p0.8": dict(temperature=1.0, top_p=0.8),
    "top_k5": dict(temperature=1.0, top_k=5),
}


@pytest.mark.parametrize("name", list(CONFIGS) + ["temperature1_reduced_vocab"])
def test_sampling_matches_target_distribution(hf_target, draft_dir, reduced_draft_dir, name):
    (target, hf) = hf_target
    draft = reduced_draft_dir if name.endswith("_reduced_vocab") else draft_dir
    sp = CONFIGS[name.removesuffix("_reduced_vocab")]
    eng = engine(target, draft, "full", max_running_requests=256)
    outs = eng.generate(input_ids=[PROMPT] * N,
                        sampling_params=[dict(sp, max_new_tokens=MAX_NEW, seed=i) for i in range(N)])
    seqs = [o["output_ids"] for o in outs]
    assert all(len(s) == MAX_NEW for s in seqs)
    hist = eng.scheduler.accept_hist
    print(name, dict(sorted(hist.items())))
    # Not degenerate: drafts get both rejected and accepted, so both branches of the rule ran.
    assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k > 0) > 0, hist
    assert hist.get(2, 0) > 0, f"no verify accepted both drafts (no bonus path): {hist}"

    dists = exact_distributions(hf, PROMPT, SamplingParams(**sp), V, MAX_NEW)
    assert_continuations_fit(torch.tensor(seqs), dists, name)


# ---- unit tests of verify.py ------------------------------------------------------------------
def _synthetic(L: int, seed: int):
    """Target distributions p [L+1, 5] and draft distributions q [L, 5], with zeros in both
    (tokens the draft never proposes, and drafts the target forbids)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(L + 1, 5, generator=g) + 0.05
    q = torch.rand(L, 5, generator=g) + 0.05
    p[:, 4] = 0.0                  # the target never emits token 4 ...
    q[:, 0] = 0.0                  # ... the draft never proposes token 0
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def test_accept_sampling_output_distribution():
    """Monte Carlo of accept_sampling with drafts drawn from q: the first output token has exactly
    distribution p_0, the acceptance rate of d_1 is sum_x min(p_0, q_0), the token after an
    accepted d_1 has distribution p_1, and the bonus after two accepts has distribution p_2."""
    L, trials = 2, 20000
    p, q = _synthetic(L, seed=1)
    logits = p.log()                                   # softmax(log p) = p; log 0 = -inf
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(123)
    drafts_all = torch.stack([torch.multinomial(q[k], trials, replacement=True, generator=g)
                              for k in range(L)], 1).tolist()
    first, second, bonus = [0] * 5, [0] * 5, [0] * 5
    accepted_first = 0
    for drafts in drafts_all:
        n, tok = accept_sampling(drafts, q, logits, params, g)
        assert 0 <= n <= L
        out = drafts[:n] + [tok]
        first[out[0]] += 1
        if n >= 1:
            accepted_first += 1
            second[out[1]] += 1
        if n == 2:
            bonus[out[2]] += 1
    assert_fits(first, p[0].tolist(), "first token")
    assert_fits(second, p[1].tolist(), "token after an accepted d1")
    assert_fits(bonus, p[2].tolist(), "bonus after two accepts")
    rate = float(torch.minimum(p[0], q[0]).sum())
    sd = (rate * (1 - rate) / trials) ** 0.5
    assert abs(accepted_first / trials - rate) < 3.3 * sd        # two-sided ~1e-3


def test_accept_sampling_edge_cases():
    params = SamplingParams(temperature=1.0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    g = torch.Generator().manual_seed(0)
    # No drafts: the bonus is drawn from p_0 (one-hot here).
    assert accept_sampling([], torch.empty(0, 3), p[:1].log(), params, g) == (0, 1)
    # A draft the target forbids is always rejected; the resample avoids it.
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for _ in range(20):
        assert accept_sampling([0], q, p.log(), params, g) == (0, 1)
    # p == q: always accepted, whatever the draft.
    q = torch.tensor([[0.3, 0.3, 0.4]])
    pe = torch.cat([q, p[1:]])
    for d in range(3):
        n, tok = accept_sampling([d], q, pe.log(), params, g)
        assert n == 1 and 0 <= tok < 3
    # Greedy params reduce to greedy acceptance (one-hot p).
    greedy = SamplingParams(temperature=0.0)
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    onehot = torch.eye(3)
    assert accept_sampling([1, 0], onehot[[1, 0]], logits, greedy, g) == (2, 2)
    assert accept_sampling([1, 2], onehot[[1, 2]], logits, greedy, g) == (1, 0)
    assert accept_sampling([2, 0], onehot[[2, 0]], logits, greedy, g) == (0, 1)


def test_accept_greedy():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0],      # argmax 1
                           [2.0, 0.0, 1.0, 0.0],      # argmax 0
                           [0.0, 0.0, 0.0, 3.0],      # argmax 3
                           [0.0, 0.0, 4.0, 0.0]])     # argmax 2
    assert accept_greedy([1, 0, 3], logits) == (3, 2)          # all accepted, bonus from last row
    assert accept_greedy([1, 0, 2], logits) == (2, 3)          # mismatch at the last draft
    assert accept_greedy([1, 2, 3], logits) == (1, 0)          # mismatch mid-block: later drafts ignored
    assert accept_greedy([0, 0, 3], logits) == (0, 1)          # first draft wrong
    assert accept_greedy([], logits[:1]) == (0, 1)             # nothing to verify: plain decode
