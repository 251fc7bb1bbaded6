"""train-draft's settings are written once, on the dataclasses: every field is a flag, the flags'
defaults are the fields' defaults, and values parse to the fields' types."""
from __future__ import annotations

import dataclasses

from sparkserve.cli import _parser
from sparkserve.dataclass_cli import dataclass_from_args
from sparkserve.training.config import PipelineConfig, TrainConfig


def _parse(*argv: str):
    return _parser().parse_args(["train-draft", "--out", "OUT", *argv])


def test_defaults_are_the_dataclass_defaults():
    ns = _parse()
    assert dataclass_from_args(PipelineConfig, ns, train=dataclass_from_args(TrainConfig, ns)) == \
        PipelineConfig(out="OUT")
    assert TrainConfig().final_norm_lr_mult == 20.0 and PipelineConfig(out="x").val_prompts == 64


def test_every_field_is_a_flag_with_help():
    ns = vars(_parse())
    for cls in (PipelineConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if f.name == "train":
                continue
            assert f.name in ns, f.name
            assert f.metadata.get("help"), f.name


def test_values_parse_to_field_types():
    ns = _parse("--target-layer-ids", "1,5,9", "--extra-features", "a,b", "--no-markov-init", "--steps", "7",
                "--lr", "1e-3", "--train-lm-head", "--stages", "train,eval", "--draft-vocab-size", "0")
    cfg = dataclass_from_args(PipelineConfig, ns, train=dataclass_from_args(TrainConfig, ns))
    assert cfg.target_layer_ids == [1, 5, 9] and cfg.extra_features == ["a", "b"] and cfg.markov_init is False
    assert cfg.stages == ["train", "eval"] and cfg.draft_vocab_size == 0
    assert (cfg.train.steps, cfg.train.lr, cfg.train.train_lm_head) == (7, 1e-3, True)
