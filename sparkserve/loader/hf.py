"""HF checkpoint directories: config.json + *.safetensors (sharded or not)."""
from __future__ import annotations

import glob
import json
import os
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from sparkserve.config import ModelConfig
from sparkserve.kernels.blocks import BlockWeight
from sparkserve.loader.weights import with_blocks


def hf_config(path: str) -> ModelConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json (expected an HF model directory or a .gguf file)")
    return ModelConfig.from_hf_dir(path)


def safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors files")
    return files


def hf_weights(path: str, names: set[str] | None = None,
               rename: Callable[[str], str | None] = lambda name: name) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, or only those in `names` (the others are not read), under
    the model's names: `rename` maps a checkpoint name to one (None: not the model's, not read)."""
    for file in safetensor_files(path):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():
                name = rename(stored)
                if name is None or (names is not None and name not in names):
                    continue
                t = f.get_tensor(stored)
                # bf16 / fp16 matrices keep their exact half form for the small-M kernel (linear.py)
                qtype = BlockWeight.half_type(t)
                fits = qtype is not None and BlockWeight.supports(qtype, t.shape)
                blocks = BlockWeight.from_half(t) if fits else None
                yield name, with_blocks(t.float(), blocks)
