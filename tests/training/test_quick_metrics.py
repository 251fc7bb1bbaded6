"""The quick evaluation metrics (validate.slot1_accuracy): uniform slot-1 accuracy over held-out
positions and the same without next tokens outside the draft vocab, checked against the block
walk's accepted prefixes (accepted_prefix, which test_training checks against serving)."""
import math

import torch
from test_training import _reduced_draft, bigram_target, distilled  # noqa: F401 (fixtures)

from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.markov_init import fit_markov_head
from sparkserve.training.validate import accepted_prefix, slot1_accuracy


def _reference(draft, cache):
    """Per usable position of every sequence: slot 1 accepted, next token in the draft vocab."""
    vocab = draft.to_target_ids(torch.arange(draft.config.out_vocab))
    hits, inv = [], []
    for i in range(len(cache)):
        tokens, taps, _, plen = cache.sequence(i)
        a = torch.arange(max(plen, 1), len(tokens) - 1)
        hits.append(accepted_prefix(draft, tokens, taps, a) >= 1)
        inv.append(torch.isin(tokens[a + 1], vocab))
    return torch.cat(hits), torch.cat(inv)


def test_slot1_accuracy_and_oov_excluded(distilled):  # noqa: F811
    """All positions: the reference's means exactly; a uniform third: within 4 binomial sigmas of
    them, and that many positions; OOV-excluded = accuracy over in-vocab positions (> the plain
    one when some next tokens fall outside a 12-id vocab)."""
    _, target, dcfg, fc_dir, *_ = distilled
    cache = FeatureCache.open(fc_dir)
    draft, *_ = _reduced_draft(dcfg, target, cache, 12)
    fit_markov_head(draft, cache)             # the bigram target: the Markov head alone predicts well
    hits, inv = _reference(draft, cache)
    full = slot1_accuracy(draft, cache, positions=10 ** 9)
    assert full["positions"] == len(hits)
    assert math.isclose(full["slot1_acc"], hits.float().mean().item(), abs_tol=1e-6)
    assert math.isclose(full["slot1_acc_in_vocab"], hits[inv].float().mean().item(), abs_tol=1e-6)
    assert math.isclose(full["oov"], 1 - inv.float().mean().item(), abs_tol=1e-6)
    assert 0 < full["oov"] and 0.2 < full["slot1_acc"] < full["slot1_acc_in_vocab"]
    n = len(hits) // 3
    part = slot1_accuracy(draft, cache, positions=n, seed=1)
    assert part["positions"] == n
    p = full["slot1_acc"]
    assert abs(part["slot1_acc"] - p) < 4 * math.sqrt(p * (1 - p) / n)
