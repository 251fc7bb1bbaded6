"""train-draft's settings are written once, on the dataclasses: every field is a flag, the flags'
defaults are the fields' defaults, and values parse to the fields' types."""
from __future__ import annotations

import dataclasses

import pytest
import torch

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


def test_device_flag_defaults_to_auto_and_takes_cpu_or_cuda():
    assert _parse().device == "auto" and _parse("--device", "cuda").device == "cuda"
    with pytest.raises(SystemExit):
        _parse("--device", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here: --device cuda is no error")
def test_device_cuda_without_a_gpu_fails_at_start(tmp_path, capsys):
    """Before any stage (no model is loaded, nothing is written): exit 2 and a message naming
    the flag and the way out."""
    from sparkserve.cli import main
    out = tmp_path / "run"
    assert main(["train-draft", "--out", str(out), "--device", "cuda", "--stages", "train"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "--device cpu" in err, err
    assert not out.exists()
    from sparkserve.training.ranks import train_device
    assert train_device("auto") == torch.device("cpu")
