"""The training recipe's options (TrainConfig): cross-entropy against the teacher's distribution
(ce_target soft), a confidence head whose loss trains the head only (conf_detach), more anchors
per sequence (with the block attention); and the draft's architecture options trained from
scratch. Short runs on the bigram target's cache (test_training.py) must lower the loss; the soft
CE of a one-hot teacher must be the hard CE."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from test_training import bigram_target, distilled  # noqa: F401 (fixtures)

from sparkserve.config import ModelConfig
from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft
from sparkserve.training.blocks import BlockSeq
from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.train_dspark import Teacher, TrainConfig, blocks_losses, soft_cross_entropy, train


def test_soft_cross_entropy_of_a_one_hot_teacher_is_the_hard_one():
    g = torch.Generator().manual_seed(0)
    logp = F.log_softmax(torch.randn(12, 30, generator=g) * 3, -1)
    labels = torch.randint(0, 30, (12,), generator=g)
    hard = F.nll_loss(logp, labels, reduction="none")
    torch.testing.assert_close(soft_cross_entropy(logp, F.one_hot(labels, 30).float()), hard)
    smooth = 0.9 * F.one_hot(labels, 30).float() + 0.1 / 30
    assert (soft_cross_entropy(logp, smooth) - hard).abs().max() > 1e-2


def sharp_sequence(draft, head: torch.Tensor, S: int = 20, seed: int = 3):
    """A sequence whose teacher (softmax of head @ final) is one-hot on each next token: final
    rows solve head @ final = 60 * onehot(next token). Returns (BlockSeq, lse of the full head)."""
    g = torch.Generator().manual_seed(seed)
    V = head.shape[0]
    tokens = torch.randint(0, V, (S,), generator=g)
    want = 60 * F.one_hot(tokens.roll(-1), V).float()
    final = torch.linalg.lstsq(head, want.T).solution.T
    taps = torch.randn(S, len(draft.config.target_layer_ids) * draft.config.hidden_size, generator=g)
    lse = torch.logsumexp(final @ head.T, -1)
    return BlockSeq(tokens, taps, torch.tensor([2, 5, 9, 14]), final, lse), lse


@pytest.mark.parametrize("reduced", [False, True])
def test_soft_ce_loss_equals_hard_ce_when_the_teacher_is_one_hot(distilled, reduced):  # noqa: F811
    """blocks_losses' CE term: soft against a one-hot teacher = hard on the next tokens, over the
    full vocab and over a reduced draft vocab (tokens outside it masked alike); the L1 term is
    the same either way. A sampled answer (tokens other than the teacher's) tells them apart."""
    _, target, dcfg, *_ = distilled
    V = dcfg["vocab_size"]
    cfg = dict(dcfg, draft_vocab_size=40) if reduced else dcfg
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40] if reduced else None
    draft = init_dspark_draft(cfg, target, vocab=vocab)
    head = target.lm_head.dense_weight().float()
    seq, lse = sharp_sequence(draft, head if reduced else draft.lm_head.weight.detach())
    teacher = Teacher.for_draft(draft, head) if reduced else None
    with torch.no_grad():
        hard = blocks_losses(draft, [seq], TrainConfig(ce_target="hard"), teacher)
        soft = blocks_losses(draft, [seq], TrainConfig(ce_target="soft"), teacher)
        assert hard["ce"] > 0
        torch.testing.assert_close(soft["ce"], hard["ce"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(soft["l1"], hard["l1"])
        other = BlockSeq((seq.tokens + 1) % V, seq.taps, seq.anchors, seq.final, seq.lse)
        moved = {t: blocks_losses(draft, [other], TrainConfig(ce_target=t), teacher)["ce"]
                 for t in ("hard", "soft")}
        assert (moved["hard"] - moved["soft"]).abs() > 1e-2


@pytest.mark.parametrize("detach", [False, True])
def test_detached_confidence_loss_trains_the_head_only(distilled, detach):  # noqa: F811
    _, target, dcfg, *_ = distilled
    draft = init_dspark_draft(dcfg, target)
    draft.requires_grad_(True)
    seq, _ = sharp_sequence(draft, draft.lm_head.weight.detach())
    blocks_losses(draft, [seq], TrainConfig(conf_detach=detach))["conf"].backward()
    assert draft.confidence_head.proj.weight.grad.abs().sum() > 0
    backbone = [draft.layers[0].self_attn.q_proj.weight, draft.fc.weight, draft.markov_head.markov_w1.weight]
    touched = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in backbone]
    assert touched == [not detach] * 3


RECIPES = {
    "soft_ce": (dict(ce_target="soft", ce_weight=1.0, l1_weight=0.1), {}),
    "conf_detach": (dict(conf_detach=True, conf_weight=0.3), {}),
    "anchors_64": (dict(anchors_per_seq=64, block_attention=True), {}),
    "options": (dict(ce_target="soft", ce_weight=1.0, l1_weight=0.1, conf_detach=True),
                dict(num_layers=2, tap_norm=True, prev_context_fusion=True, kv_heads=4)),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_short_training_lowers_the_loss(bigram_target, distilled, recipe, tmp_path):  # noqa: F811
    path, _ = bigram_target
    _, target, dcfg, fc_dir, *_ = distilled
    train_kw, arch = RECIPES[recipe]
    if arch:
        dcfg = dspark_config_dict(ModelConfig.from_hf_dir(path), block_size=4, mask_token_id=3,
                                  markov_rank=64, **arch)
    draft = init_dspark_draft(dcfg, target)
    out = str(tmp_path / "draft")
    cfg = TrainConfig(**{**dict(steps=60, seqs_per_step=4, anchors_per_seq=16, lr=1e-2, save_every=60),
                         **train_kw})
    train(draft, FeatureCache.open(fc_dir), out, cfg, log_every=10)
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"], (log[0], log[-1])
    if arch:
        assert draft.fuse_proj.weight.abs().max() > 0          # the fusion learned from zero
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
        assert saved["prev_context_fusion"] and saved["tap_norm"] and saved["num_hidden_layers"] == 2


def test_pipeline_flags_write_the_options_into_the_draft_config(bigram_target):  # noqa: F811
    from sparkserve.training.config import PipelineConfig
    from sparkserve.training.pipeline import draft_config
    tc = ModelConfig.from_hf_dir(bigram_target[0])
    plain = draft_config(PipelineConfig(out="x", draft_vocab_size=0), tc, None)
    assert plain == dspark_config_dict(tc, mask_token_id=0)
    cfg = draft_config(PipelineConfig(out="x", draft_vocab_size=0, num_layers=2, draft_kv_heads=4,
                                      tap_norm=True, prev_context_fusion=True), tc, None)
    assert {k: v for k, v in cfg.items() if plain.get(k) != v} == {
        "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "num_key_value_heads": 4,
        "tap_norm": True, "prev_context_fusion": True}


def test_option_flags_parse():
    from sparkserve.cli import _parser
    from sparkserve.dataclass_cli import dataclass_from_args
    from sparkserve.training.config import PipelineConfig
    argv = ["train-draft", "--out", "OUT", "--ce-target", "soft", "--conf-detach", "--block-attention",
            "--tap-norm", "--prev-context-fusion", "--draft-kv-heads", "9", "--num-layers", "2"]
    ns = _parser().parse_args(argv)
    cfg = dataclass_from_args(PipelineConfig, ns, train=dataclass_from_args(TrainConfig, ns))
    assert (cfg.train.ce_target, cfg.train.conf_detach, cfg.train.block_attention) == ("soft", True, True)
    assert (cfg.tap_norm, cfg.prev_context_fusion, cfg.draft_kv_heads, cfg.num_layers) == (True, True, 9, 2)
    with pytest.raises(SystemExit):
        _parser().parse_args(["train-draft", "--out", "OUT", "--ce-target", "medium"])


def test_init_draft_refuses_options_that_cannot_start_as_its_draft(bigram_target):  # noqa: F811
    """--init-draft grows its draft by fusion, layers and a wider read (grow_draft.py); a tap norm,
    fewer layers or a read that is no multiple of the draft's are refused, naming the flag."""
    from sparkserve.training.grow_draft import grown_config
    tc = ModelConfig.from_hf_dir(bigram_target[0])          # 4 attention heads, 2 KV heads
    plain, fused = dspark_config_dict(tc, num_layers=2), dspark_config_dict(tc, tap_norm=True,
                                                                            prev_context_fusion=True)
    for flags, flag in ((dict(tap_norm=True), "--tap-norm"), (dict(num_layers=1), "--num-layers 1"),
                        (dict(kv_heads=3), "--draft-kv-heads 3")):
        with pytest.raises(ValueError, match=f"{flag} with --init-draft"):
            grown_config(plain, "D", **flags)
    assert grown_config(fused, "D", tap_norm=True, prev_context_fusion=True, kv_heads=2) == fused
    assert grown_config(fused, "D") == fused and grown_config(plain, "D", num_layers=2) == plain
    grown = grown_config(plain, "D", num_layers=3, kv_heads=4, prev_context_fusion=True)
    assert {k: v for k, v in grown.items() if plain.get(k) != v} == {
        "num_hidden_layers": 3, "layer_types": ["full_attention"] * 3, "num_key_value_heads": 4,
        "prev_context_fusion": True}
