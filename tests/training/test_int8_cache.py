"""The int8 feature cache (training/int8_cache.py): its taps reproduce the fp16 cache's within half
a quantisation step, its top-k teacher is the target's full softmax's, a conversion stopped midway
and resumed writes what a fresh one writes, and training reads the same losses from it as from
the fp16 cache."""
import json
import os

import numpy as np
import pytest
import torch
from test_training import V, _reduced_draft, bigram_target, distilled  # noqa: F401 (fixtures)

from sparkserve.models.dspark_draft import init_dspark_draft
from sparkserve.training.blocks import BlockSeq
from sparkserve.training.feature_cache import FeatureCache, write_lse
from sparkserve.training.int8_cache import Int8FeatureCache, convert_fp16_cache
from sparkserve.training.train_dspark import (
    Teacher,
    TrainConfig,
    blocks_losses,
    sample_anchors,
    teacher_probs,
    train,
)

FILES = ("tokens", "taps_q", "tap_scales", "topk_ids", "topk_logp")


@pytest.fixture(scope="module")
def caches(distilled, tmp_path_factory):  # noqa: F811
    """(fp16 cache with lse.npy, its int8 conversion with a top-32 teacher, the target's head)."""
    import shutil
    _, target, _, fc_dir, *_ = distilled
    head = target.lm_head.dense_weight().float()
    fp16 = str(tmp_path_factory.mktemp("fp16") / "fc")
    shutil.copytree(fc_dir, fp16)
    write_lse(fp16, head)
    q = str(tmp_path_factory.mktemp("int8") / "fc")
    assert convert_fp16_cache(fp16, q, head, chunk_rows=300)
    return fp16, q, head


def test_int8_taps_within_half_a_step_of_fp16(caches):
    """Every value within half its row-and-tap's step (absmax / 254) of the fp16 cache's, the
    whole within 1 % relative RMS; the taps of a subset read as the subset of the whole."""
    fp16_dir, q_dir, _ = caches
    fp16, q = FeatureCache.open(fp16_dir), FeatureCache.open(q_dir)
    assert isinstance(q, Int8FeatureCache) and len(q) == len(fp16)
    n_taps = len(fp16.target_layer_ids)
    err2 = ref2 = 0.0
    for i in range(len(fp16)):
        t_ref, x_ref, _, plen = fp16.sequence(i)
        t_got, x_got, final, plen_got = q.sequence(i)
        assert torch.equal(t_ref, t_got) and plen == plen_got and final is None
        step = x_ref.view(len(t_ref), n_taps, -1).abs().amax(-1, keepdim=True) / 127
        diff = (x_got - x_ref).view(len(t_ref), n_taps, -1).abs()
        assert (diff <= step / 2 + 1e-6).all()
        err2 += float((diff ** 2).sum())
        ref2 += float((x_ref ** 2).sum())
    assert (err2 / ref2) ** 0.5 < 1e-2
    one = fp16.target_layer_ids[-1]
    torch.testing.assert_close(q.with_taps([one]).sequence(3)[1],
                               q.sequence(3)[1][:, (n_taps - 1) * fp16.final.shape[1]:])


def test_int8_teacher_is_the_full_softmax_top_k(caches):
    """On response rows: ids and log-probs of the 32 most likely next tokens of softmax(head @
    final), computed here from the fp16 rows; prompt rows hold no teacher; top-1 = greedy."""
    fp16_dir, q_dir, head = caches
    fp16, q = FeatureCache.open(fp16_dir), FeatureCache.open(q_dir)
    for i in (0, 5, 17):
        _, _, final, plen = fp16.sequence(i)
        ids, logp = q.sequence_topk(i)
        want = torch.log_softmax(final[plen:-1] @ head.T, -1).topk(32, -1)
        torch.testing.assert_close(logp[plen:-1], want.values, atol=2e-2, rtol=1e-3)
        probs = torch.log_softmax(final[plen:-1] @ head.T, -1).gather(1, ids[plen:-1])
        torch.testing.assert_close(probs, want.values, atol=2e-2, rtol=1e-3)   # ties may swap ids
        assert torch.isinf(logp[:plen]).all()
        assert torch.equal(q.sequence_greedy(i)[plen:-1], (final[plen:-1] @ head.T).argmax(-1))


def test_resumed_conversion_equals_a_fresh_one(caches, tmp_path):
    """Stopped after a third of the rows, with garbage past the recorded chunks (a crash mid-chunk),
    then resumed: every file byte for byte a fresh conversion's; another data set is refused."""
    fp16_dir, fresh, head = caches
    out = str(tmp_path / "resumed")
    total = int(np.load(os.path.join(fp16_dir, "tokens.npy")).shape[0])
    assert not convert_fp16_cache(fp16_dir, out, head, chunk_rows=300, stop_after_rows=total // 3)
    assert not os.path.exists(os.path.join(out, "index.json"))
    with open(os.path.join(out, "convert.json")) as f:
        done = json.load(f)["seqs_done"]
    assert 0 < done < len(FeatureCache.open(fp16_dir))
    q = np.load(os.path.join(out, "taps_q.npy"), mmap_mode="r+")
    q[total // 2:] = 99
    q.flush()
    del q
    assert convert_fp16_cache(fp16_dir, out, head, chunk_rows=300)
    for name in FILES:
        assert np.array_equal(np.load(os.path.join(out, f"{name}.npy")),
                              np.load(os.path.join(fresh, f"{name}.npy")), equal_nan=True), name
    with open(os.path.join(out, "index.json")) as a, open(os.path.join(fresh, "index.json")) as b:
        assert json.load(a) == json.load(b)
    other = str(tmp_path / "other")
    assert not convert_fp16_cache(fp16_dir, other, head, chunk_rows=300, stop_after_rows=10)
    with pytest.raises(ValueError, match="other data"):
        convert_fp16_cache(fp16_dir, other, head, k=16)


@pytest.mark.parametrize("reduced", [False, True])
def test_training_losses_on_int8_equal_fp16(distilled, caches, reduced):  # noqa: F811
    """blocks_losses on the same anchors of several sequences: CE, L1 and the confidence loss
    from the int8 cache (dequantised taps, top-32 teacher) within 2 % of the fp16 cache's (full
    softmax or lse teacher), and the teacher distributions they read the same; with the
    teacher's ids shifted those are far off (the check can fail)."""
    _, target, dcfg, *_ = distilled
    fp16_dir, q_dir, head = caches
    fp16, q = FeatureCache.open(fp16_dir), FeatureCache.open(q_dir)
    if reduced:
        draft, *_ = _reduced_draft(dcfg, target, fp16, 40)
        teacher = Teacher.for_draft(draft, head)
    else:
        draft, teacher = init_dspark_draft(dcfg, target, seed=3), None
    ref, got, bad = [], [], []
    for i in (1, 8, 22, 30):
        tokens, taps, final, plen = fp16.sequence(i)
        anchors = sample_anchors(len(tokens), plen, 8, torch.Generator().manual_seed(i))
        ref.append(BlockSeq(tokens, taps, anchors, final, fp16.sequence_lse(i)))
        _, qtaps, _, _ = q.sequence(i)
        ids, logp = q.sequence_topk(i)
        got.append(BlockSeq(tokens, qtaps, anchors, topk=(ids, logp)))
        bad.append(BlockSeq(tokens, qtaps, anchors, topk=((ids + 1) % V, logp)))
    cfg = TrainConfig(ce_target="soft")
    with torch.no_grad():
        want, have, wrong = (blocks_losses(draft, s, cfg, teacher) for s in (ref, got, bad))
    for key in ("ce", "l1", "conf", "wsum"):
        torch.testing.assert_close(have[key], want[key], rtol=2e-2, atol=1e-3)
    # the teacher distributions themselves: int8's top-32 = fp16's (an untrained draft's L1 is ~2
    # against any teacher, so the losses alone would not show a wrong one); shifted ids do not
    starts = torch.cumsum(torch.tensor([0] + [len(s.tokens) for s in ref[:-1]]), 0).tolist()
    rows = torch.cat([torch.arange(o + int(s.anchors.min()), o + len(s.tokens) - 1)
                      for o, s in zip(starts, ref)])
    p_ref, out_ref = teacher_probs(draft, ref, rows, teacher)
    p_got, out_got = teacher_probs(draft, got, rows, teacher)
    torch.testing.assert_close(p_got, p_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_got, out_ref, atol=2e-2, rtol=2e-2)
    assert (teacher_probs(draft, bad, rows, teacher)[0] - p_ref).abs().sum(-1).mean() > 0.5
    assert (wrong["ce"] - want["ce"]).abs() > 0 and wrong["wsum"] == want["wsum"]


def test_a_reduced_vocab_draft_trains_on_the_int8_cache(distilled, caches, tmp_path):  # noqa: F811
    """train() on the int8 cache (no lse.npy, no final rows): the loss of the first steps is the
    fp16 cache's (same draft seed, same anchors) within 2 %, and it falls."""
    _, target, dcfg, *_ = distilled
    fp16_dir, q_dir, head = caches
    losses = {}
    for name, path in (("fp16", fp16_dir), ("int8", q_dir)):
        cache = FeatureCache.open(path)
        draft, *_ = _reduced_draft(dcfg, target, FeatureCache.open(fp16_dir), 40)
        cfg = TrainConfig(steps=30, seqs_per_step=4, anchors_per_seq=6, lr=3e-3, ce_weight=1.0,
                          warmup_frac=0.1)
        train(draft, cache, str(tmp_path / name), cfg, log_every=1, target_head=head)
        rows = [json.loads(line) for line in open(tmp_path / name / "train_log.jsonl")]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    for a, b in zip(losses["fp16"][:3], losses["int8"][:3]):
        assert abs(a - b) <= 2e-2 * abs(a)
    assert np.mean(losses["int8"][-5:]) < 0.8 * np.mean(losses["int8"][:5])
