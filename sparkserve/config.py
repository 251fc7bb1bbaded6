"""ModelConfig: one normalised view of a model's architecture, whether it came from an HF
config.json or from GGUF metadata, so models and pools never parse raw configs themselves."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # HF's `attention_bias` as written (MLA reads it)
    # Which attention projections carry a bias, apart: HF Llama's `attention_bias` means all four,
    # Qwen2 has q/k/v bias without a key for it (FAMILY_TRAITS) and no o bias.
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (num_experts 0: none): `moe_router` names the routing rule (layers/moe.py
    # ROUTERS), `moe_layers[i]` whether layer i's MLP is the MoE (the others are dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_router: str = ""
    moe_layers: list[bool] = field(default_factory=list)
    # Per-layer sliding window (None = full attention), length num_hidden_layers.
    layer_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type", ""))
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        n_layers = d["num_hidden_layers"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        bias = bool(d.get("attention_bias", False))
        traits = FAMILY_TRAITS.get(d.get("model_type") or _model_type_from_arch(arch), {})
        router = _moe_router(d, traits)
        n_experts = (d.get("num_experts") or d.get("num_local_experts") or 0) if router else 0
        return cls(
            architecture=arch,
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope_type not in ("default", None) else None,
            max_position_embeddings=d.get("max_position_embeddings") or d.get("model_max_length") or 4096,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qkv_bias=traits.get("qkv_bias", bias),
            o_bias=traits.get("o_bias", bias),
            qk_norm=traits.get("qk_norm", False),
            num_experts=n_experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if n_experts else 0,
            moe_intermediate_size=d.get("moe_intermediate_size", d["intermediate_size"]) if n_experts else 0,
            moe_router=router if n_experts else "",
            moe_layers=_moe_layers(d, n_layers) if n_experts else [False] * n_layers,
            layer_windows=_layer_windows(d, n_layers),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=d,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_dict(json.load(f))

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings


# What a family implies without a config key for it (HF model_type -> ModelConfig fields). A MoE
# family's router rule is here too: Mixtral always renormalises its top-k, Qwen3-MoE when `norm_topk_prob`.
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "qwen2": {"qkv_bias": True, "o_bias": False},
    "qwen3": {"qk_norm": True},
    "qwen3_moe": {"qk_norm": True, "moe_router": "softmax_topk"},
    "mixtral": {"moe_router": "softmax_topk_renorm"},
}
_ARCH_OF_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}


def _moe_router(d: dict[str, Any], traits: dict[str, Any]) -> str:
    """The family's routing rule ('' without experts); `norm_topk_prob` turns on renormalisation
    where the family reads it (softmax_topk -> softmax_topk_renorm)."""
    rule = traits.get("moe_router", "")
    return rule + "_renorm" if rule == "softmax_topk" and d.get("norm_topk_prob", False) else rule


def _moe_layers(d: dict[str, Any], n_layers: int) -> list[bool]:
    """Which layers' MLP is the MoE: all but `mlp_only_layers`, every `decoder_sparse_step`-th
    (Qwen3-MoE, as transformers decides; Mixtral has neither key: every layer)."""
    dense, step = set(d.get("mlp_only_layers") or ()), d.get("decoder_sparse_step") or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(n_layers)]


def _arch_from_model_type(model_type: str) -> str:
    return _ARCH_OF_TYPE.get(model_type, model_type)


def _model_type_from_arch(arch: str) -> str:
    return next((t for t, a in _ARCH_OF_TYPE.items() if a == arch), "")


def _layer_windows(d: dict[str, Any], n_layers: int) -> list[int | None]:
    """Which layers use a sliding window. Mistral: every layer when `sliding_window` is set;
    Qwen3/Gemma style: `layer_types` names each layer; Qwen2/Qwen3 without `layer_types`: only when
    `use_sliding_window`, and then on layers `max_window_layers` and up (as transformers does)."""
    window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    if layer_types:
        use = d.get("use_sliding_window", True)
        return [window if (t == "sliding_attention" and use and window) else None for t in layer_types]
    if "use_sliding_window" in d:
        first = d.get("max_window_layers", 0) if d["use_sliding_window"] else n_layers
        return [window if window and i >= first else None for i in range(n_layers)]
    return [window] * n_layers if window else [None] * n_layers
