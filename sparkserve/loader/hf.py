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
    cfg = ModelConfig.from_hf_dir(path)
    _fp8_block(cfg.raw)      # a quantization the loader cannot read fails here, naming it
    return cfg


def _fp8_block(raw: dict) -> tuple[int, int] | None:
    """The (rows, cols) of a block-scaled FP8 checkpoint's scale blocks (DeepSeek-V3's and MiniMax-M2's
    released form: e4m3 weights, one float32 `weight_scale_inv` per block, dequantized as they load),
    None for an unquantized one or GPT-OSS's MXFP4 experts (models/gpt_oss.py reads them); another
    `quantization_config` is refused naming its method."""
    q = raw.get("quantization_config")
    if not q or (q.get("quant_method") == "mxfp4" and raw.get("model_type") == "gpt_oss"):
        return None
    method, block = q.get("quant_method"), q.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise ValueError(f"config.json quantization_config (quant_method {method!r}, weight_block_size "
                         f"{block!r}) is not supported (supported: fp8 with a 2-D weight_block_size; "
                         "GPT-OSS's mxfp4)")
    return int(block[0]), int(block[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
                         ) -> torch.Tensor:
    """fp32 values of an FP8 weight [rows, cols]: each (block[0] x block[1]) block times its scale
    (the last blocks cut at the edges)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


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
    fp8 = None
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            fp8 = _fp8_block(json.load(f))
    for file in safetensor_files(path):
        with safe_open(file, framework="pt") as f:
            stored_names = set(f.keys())
            for stored in f.keys():
                name = rename(stored)
                if name is None or stored.endswith("_scale_inv") or (names is not None and name not in names):
                    continue
                t = f.get_tensor(stored)
                if fp8 is not None and t.dtype == torch.float8_e4m3fn:
                    if f"{stored}_scale_inv" not in stored_names:
                        raise ValueError(f"{file}: FP8 tensor {stored} has no {stored}_scale_inv beside it")
                    t = dequantize_fp8_block(t, f.get_tensor(f"{stored}_scale_inv"), fp8)
                # bf16 / fp16 matrices keep their exact half form for the small-M kernel (linear.py)
                qtype = BlockWeight.half_type(t)
                fits = qtype is not None and BlockWeight.supports(qtype, t.shape)
                blocks = BlockWeight.from_half(t) if fits else None
                yield name, with_blocks(t.float(), blocks)
