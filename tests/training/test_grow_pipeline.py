"""`train-draft --init-draft DIR` with architecture flags grows that draft (training/grow_draft.py):
with lr 0 the saved draft has the added options and, loaded as serving loads it, computes the init
draft's logits on the cached data; --tap-norm cannot start as the init draft and is refused."""
import json
import os

import pytest
import torch
from train_data_fixtures import (  # noqa: F401
    PROMPTS,
    data_flags,
    make_char_chat_checkpoint,
    one_thread,
    train_flags,
    write_prompts,
)

from sparkserve import Engine
from sparkserve.cli import main
from sparkserve.models.dspark_draft import load_dspark_draft
from sparkserve.training.blocks import BlockSeq, blocks_forward
from sparkserve.training.feature_cache import FeatureCache


def test_init_draft_grows_by_the_option_flags(tmp_path):
    model = make_char_chat_checkpoint(str(tmp_path / "model"))
    first = str(tmp_path / "first")
    assert main(data_flags(first, model, write_prompts(str(tmp_path / "p.jsonl"), PROMPTS))
                + train_flags(2) + ["--draft-vocab-size", "48"]) == 0
    grow = ["train-draft", "--model-path", model, "--stages", "train", "--extra-features",
            os.path.join(first, "features"), "--init-draft", os.path.join(first, "draft"), "--steps", "1",
            "--lr", "0", "--seqs-per-step", "2", "--anchors-per-seq", "4"]
    out = str(tmp_path / "grown")
    added = ["--prev-context-fusion", "--num-layers", "2", "--draft-kv-heads", "4"]
    assert main(grow + ["--out", out, *added]) == 0
    cfg = json.load(open(os.path.join(out, "draft", "config.json")))
    assert (cfg["prev_context_fusion"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (True, 2, 4)
    assert cfg["draft_vocab_size"] == 48
    eng = Engine(model)
    try:
        target = eng.scheduler.runner.model
        init = load_dspark_draft(os.path.join(first, "draft"), target)
        grown = load_dspark_draft(os.path.join(out, "draft"), target)
        cache = FeatureCache.open(os.path.join(first, "features"))
        for i in range(len(cache)):
            tokens, taps, _, plen = cache.sequence(i)
            anchors = torch.arange(plen, len(tokens) - 1, 3)
            seq = [BlockSeq(tokens, taps, anchors)]
            with torch.inference_mode():
                torch.testing.assert_close(blocks_forward(grown, seq)[1], blocks_forward(init, seq)[1],
                                           atol=1e-5, rtol=0)
    finally:
        eng.shutdown()
    for bad in (["--tap-norm"], ["--num-layers", "0"], ["--draft-kv-heads", "3"]):
        assert main(grow + ["--out", str(tmp_path / "bad"), *bad]) == 2
    with pytest.raises(ValueError, match="--tap-norm with --init-draft"):
        from sparkserve.training.grow_draft import grown_config
        grown_config(cfg, "D", tap_norm=True)
