"""DSpark sampling under a grammar is lossless: seeded continuations drawn with speculative decoding
and a regex constraint follow the exact distribution of the grammar-masked target (enumerated from
the transformers model with each position's allowed set), both with the draft proposing under the
grammar (its distributions masked: no draft is cut) and without (drafts the grammar rejects are cut
before verify). The tiny V=24 target and the related-but-unequal draft of test_dspark_sampling; its
ids spell the letters a..w (id 23: EOS), so a regex constrains them. Chi-square at alpha 1e-3, fixed
seeds: deterministic."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import (
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
)
from test_dspark_sampling import MAX_NEW, PROMPT, V, assert_fits, draft_dir, hf_target  # noqa: F401

from sparkserve.constrained.backend import GrammarBackend
from sparkserve.constrained.matcher import GrammarMatcher
from sparkserve.entrypoints import engine as engine_mod
from sparkserve.executor.sampler import processed_probs
from sparkserve.sampling_params import SamplingParams
from sparkserve.speculative import grammar_drafts

N = 3000
REGEX = "[a-p][b-q][a-w][c-r]"                 # MAX_NEW letters, then complete
ALLOWED = [range(0, 16), range(1, 17), range(0, 23), range(2, 18)]     # ids per position


class Letters:
    """A TokenSource over the tiny vocabulary: id i is the letter chr(97 + i), id 23 EOS."""
    vocab_size = V
    bos_token_id = None
    eos_token_id = V - 1
    eos_token_ids = {V - 1}
    all_special_ids = [V - 1]

    def token_bytes(self, tid: int) -> bytes:
        return b"</s>" if tid == V - 1 else bytes([97 + tid])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - 97 for c in text]


@torch.inference_mode()
def masked_distributions(hf, params: SamplingParams):
    """P(t_k | t_<k) of the target's processed distribution with each position's disallowed ids
    at -inf, for every prefix of allowed ids (enumerated)."""
    import itertools
    out = []
    for depth in range(MAX_NEW):
        prefixes = list(itertools.product(range(V), repeat=depth))
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        logits = torch.cat([hf(chunk).logits[:, -1] for chunk in ids.split(4096)]).float()
        mask = torch.full((V,), float("-inf"))
        mask[list(ALLOWED[depth])] = 0.0
        out.append(processed_probs(logits + mask, params).double().view(*([V] * depth), V))
    return out


@pytest.mark.parametrize("draft_masks", [True, False])
def test_sampling_under_a_regex_matches_the_masked_target(hf_target, draft_dir, monkeypatch,  # noqa: F811
                                                          draft_masks):
    target, hf = hf_target
    if not draft_masks:
        monkeypatch.setattr(grammar_drafts.DraftMasks, "of", staticmethod(lambda reqs, ids: None))
    eng = engine(target, draft_dir, "full", max_running_requests=256)
    eng.scheduler.grammar = GrammarBackend(Letters(), V)             # the target has no tokenizer
    monkeypatch.setattr(engine_mod, "check_grammar", lambda *a: None)
    cuts = []
    orig = GrammarMatcher.cut_drafts

    def recording(self, drafts, output_ids):
        n = orig(self, drafts, output_ids)
        cuts.append(len(drafts) - n)
        return n
    monkeypatch.setattr(GrammarMatcher, "cut_drafts", recording)
    outs = eng.generate(input_ids=[PROMPT] * N, sampling_params=[
        dict(temperature=1.0, regex=REGEX, max_new_tokens=MAX_NEW + 2, seed=i) for i in range(N)])
    seqs = [o["output_ids"] for o in outs]
    assert all(len(s) == MAX_NEW for s in seqs)                       # complete after 4: stop
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    hist = eng.scheduler.accept_hist
    assert hist.get(0, 0) > 0 and sum(v for k, v in hist.items() if k > 0) > 0, hist
    if draft_masks:
        assert sum(cuts) == 0, "a draft proposed under the grammar was cut"
    else:
        assert sum(cuts) > 0, "the grammar never cut a draft: the test would not see the cut"
    t = torch.tensor(seqs)
    for k, allowed in enumerate(ALLOWED):
        assert set(t[:, k].tolist()) <= set(allowed)
    p1, p2, p3, p4 = masked_distributions(hf, SamplingParams(temperature=1.0))

    def counts(cols):
        idx = torch.zeros(N, dtype=torch.long)
        for c in cols:
            idx = idx * V + t[:, c]
        ones = torch.ones(N, dtype=torch.long)
        return torch.zeros(V ** len(cols), dtype=torch.long).index_add_(0, idx, ones)

    j12 = p1[:, None] * p2
    j123 = j12[:, :, None] * p3
    m4 = (j123[:, :, :, None] * p4).sum((0, 1, 2))
    assert_fits(counts([0]).tolist(), p1.tolist(), "t1")
    assert_fits(counts([1]).tolist(), j12.sum(0).tolist(), "t2")
    assert_fits(counts([0, 1]).tolist(), j12.flatten().tolist(), "(t1, t2)")
    assert_fits(counts([2]).tolist(), j123.sum((0, 1)).tolist(), "t3")
    assert_fits(counts([1, 2]).tolist(), j123.sum(0).flatten().tolist(), "(t2, t3)")
    assert_fits(counts([3]).tolist(), m4.tolist(), "t4")

