"""Architecture name -> model class, and one `load_model` for GGUF files and HF directories."""
from __future__ import annotations

import logging
import os
from typing import Iterator

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.layers.block_backed import drop_blocks, hold_weights_in_huge_pages, set_activation_quant
from sparkserve.layers.linear import pack_linears
from sparkserve.mem.heap import release_freed_memory
from sparkserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from sparkserve.models.gemma import GemmaForCausalLM
from sparkserve.models.gpt_oss import GptOssForCausalLM
from sparkserve.models.kimi_linear import KimiLinearForCausalLM
from sparkserve.models.llama import LlamaForCausalLM
from sparkserve.models.minimax_m2 import MiniMaxM2ForCausalLM
from sparkserve.models.minimax_m3 import MiniMaxM3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "Olmo3ForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "MiniMaxM3VLForCausalLM": MiniMaxM3ForCausalLM,
}

log = logging.getLogger(__name__)


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.architecture not in MODELS:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODELS))}")
    return MODELS[cfg.architecture]


def load_config(model_path: str) -> ModelConfig:
    if model_path.endswith(".gguf"):
        from sparkserve.loader.gguf import gguf_config
        return gguf_config(model_path)
    from sparkserve.loader.hf import hf_config
    return hf_config(model_path)


def checkpoint_weights(model_path: str, cfg: ModelConfig, names: set[str] | None = None,
                       for_int8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of a GGUF file or an HF checkpoint; only `names` when given (the others
    are not read: e.g. a draft's full copy of a vocab-split target's embedding and LM head).
    `for_int8`: a GGUF file's quantized weights in the types the int8 kernels read (the model's
    `checkpoint_for_int8`, loader/gguf_int8.py)."""
    if model_path.endswith(".gguf"):
        from sparkserve.loader.gguf import gguf_weights
        return gguf_weights(model_path, cfg, names, for_int8)
    from sparkserve.loader.hf import hf_weights
    return hf_weights(model_path, names, model_class(cfg).checkpoint_name)


def load_model(model_path: str, cfg: ModelConfig | None = None, pack: bool = True,
               activation_quant: str = "none", device: torch.device = torch.device("cpu"),
               huge_pages: bool = False) -> nn.Module:
    """`activation_quant`: "int8" lets layers with quantized blocks run int8 activations at small
    M (the engine's default, --activation-quant); "none" keeps fp32 activations (exact). Off the
    CPU the model runs torch's kernels on fp32 weights (`to_device`): no blocks, no int8.
    `huge_pages`: hold the CPU weights in 2 MiB pages (mem/huge_pages.py; the engine's default)."""
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model path {model_path} does not exist")
    cfg = cfg or load_config(model_path)
    cls = model_class(cfg)
    # Build on the meta device: no time spent on random init of weights about to be overwritten.
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device="cpu")
    mode = activation_quant if device.type == "cpu" else "none"
    weights = checkpoint_weights(model_path, cfg, for_int8=mode == "int8")
    model.post_materialize()
    model.checkpoint_path, model.checkpoint_for_int8 = model_path, mode == "int8"
    # The mode first: a layer that int8 takes at every row count then needs no fp32 values, and the
    # loader leaves its GGUF tensors unread (loader/weights.py): no fp32 weight is computed for it.
    set_activation_quant(model, mode)
    model.load_weights((name, t) for name, t in weights if model.owns(name))   # a pipeline stage's share
    model = model.eval().requires_grad_(False)
    if device.type != "cpu":
        model = to_device(model, device)
    elif pack:
        pack_linears(model)
    if huge_pages and device.type == "cpu":
        moved = hold_weights_in_huge_pages(model)
        log.info("weights: %.0f MiB in 2 MiB huge pages%s", moved / 2**20,
                 "" if moved else " (none: not Linux, transparent huge pages off, or no room)")
    release_freed_memory()
    return model


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """The model on another device (one of its DEVICES: scheduler/runtime.py model_device checks),
    where torch's kernels read fp32 weights: the checkpoint blocks the CPU kernels read go first."""
    drop_blocks(model)
    model = model.to(device)
    model.device = device
    return model
