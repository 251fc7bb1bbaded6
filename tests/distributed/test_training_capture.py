"""Draft-training data from a sharded target: distillation with hidden-state capture, and the
prefill capture the feature stage falls back to, give the single-process rows when the embedded
SmolLM2 runs as two pipeline stages (each capturing the taps of its own layers). The target runs
exact activations, under which the stages' rows equal one process's up to fp32 summation order."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from sparkserve import Engine
from sparkserve.training.pipeline import PipelineConfig, distill, stage_features
from sparkserve.training.target_source import EngineTarget

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Count to five."]


def _features(root: str, pp_size: int, fallback: bool) -> dict[str, np.ndarray]:
    os.makedirs(root)
    with open(os.path.join(root, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    cfg = PipelineConfig(model_path=None, out=root, max_new_tokens=8, distill_batch=2, val_prompts=0,
                         target_layer_ids=[2, 20], pp_size=pp_size)
    with Engine(None, max_total_tokens=2048, enable_return_hidden_states=True, disable_radix_cache=True,
                pp_size=pp_size, num_threads=1, activation_quant="none") as eng:
        distill(cfg, EngineTarget(eng, 2), root)
        if fallback:                              # no distillation log: the stage captures by prefill
            shutil.rmtree(os.path.join(root, "features.log"))
        stage_features(cfg, EngineTarget(eng, 2))
    out = {name: np.load(os.path.join(root, "features", f"{name}.npy")) for name in ("tokens", "taps",
                                                                                     "final")}
    out["answers"] = [json.loads(line)["output_ids"] for line in open(os.path.join(root, "distill.jsonl"))]
    return out


def test_capture_from_two_stages_equals_one(tmp_path, capsys):
    want = _features(str(tmp_path / "one"), 1, fallback=False)
    for fallback in (False, True):
        got = _features(str(tmp_path / f"pp-{fallback}"), 2, fallback)
        assert ("capturing by prefill" in capsys.readouterr().out) == fallback
        assert got["answers"] == want["answers"]
        assert np.array_equal(got["tokens"], want["tokens"])
        for name in ("taps", "final"):       # the answers' last rows are never run (NaN) in both
            a, b = got[name].astype(np.float32), want[name].astype(np.float32)
            assert np.array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), atol=2e-2, rtol=1e-2)
