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
    rotary_dim: int | None = None     # channels of a head the rope turns (partial rotary), None: all
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # HF's `attention_bias` as written (MLA reads it)
    # Which attention projections carry a bias, apart: HF Llama's `attention_bias` means all four,
    # Qwen2 has q/k/v bias without a key for it (FAMILY_TRAITS) and no o bias.
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # q/k norms over the whole projection (OLMo2) rather than per head
    qk_norm_full_width: bool = False
    # Where a layer's norms sit: "pre" (Llama: before each branch), "sandwich" (Gemma: before and
    # after each), "post" (OLMo2: after each branch's output only).
    norm_layout: str = "pre"
    # Gemma's departures from the Llama block, as data (FAMILY_TRAITS / _gemma_fields):
    # the embedding times embed_scale; attention scale (None: head_dim ** -0.5) and logit soft-cap;
    # a soft-cap on the final logits;
    # the GLU activation; norm weights stored as w - norm_offset (Gemma's 1 + w, added at load);
    # the rope base of sliding-window layers where it differs from rope_theta (no scaling there).
    embed_scale: float = 1.0
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    activation: str = "silu"
    norm_offset: float = 0.0
    local_rope_theta: float | None = None
    # Granite's multipliers: each branch's output before its residual add, and the logits' divisor;
    # `rope_layers[i]`: whether layer i rotates q and k at all (SmolLM3's NoPE layers do not).
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    rope_layers: list[bool] = field(default_factory=list)
    # Mixture of experts (num_experts 0: none): `moe_router` names the routing rule (layers/moe.py
    # ROUTERS), `moe_layers[i]` whether layer i's MLP is the MoE (the others are dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_router: str = ""
    moe_layers: list[bool] = field(default_factory=list)
    # GPT-OSS: experts with biases and the clamped SwiGLU (`swiglu_oai`, alpha / limit) and
    # attention sinks (a learned logit per head in each softmax's denominator).
    moe_activation: str = "silu"
    moe_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attn_sinks: bool = False
    # Per-layer sliding window (None = full attention), length num_hidden_layers.
    layer_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type", ""))
        if isinstance(d.get("text_config"), dict):     # a multimodal checkpoint (Gemma 3 4B+): its text model
            d = dict(d["text_config"], architectures=[arch])
        d = {**_DEFAULTS.get(d.get("model_type", ""), {}), **d}
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        rope, local_rope = _rope_parameters(d)
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        n_layers = d["num_hidden_layers"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        bias = bool(d.get("attention_bias", False))
        model_type = d.get("model_type") or _model_type_from_arch(arch)
        traits = dict(FAMILY_TRAITS.get(model_type, {}))
        if local_rope is None and traits.pop("local_rope_unscaled", False):
            local_rope = {"rope_type": "default", "rope_theta": rope_theta}
        if local_rope is not None:
            traits["local_rope_theta"] = _local_rope_theta(local_rope)
        if model_type in _GEMMA_TYPES:
            traits.update(_gemma_fields(d, model_type))
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
            rope_scaling=_rope_scaling(rope, rope_type, d),
            rotary_dim=_rotary_dim(d, rope, head_dim),
            max_position_embeddings=d.get("max_position_embeddings") or d.get("model_max_length") or 4096,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", traits.get("tie_word_embeddings", False))),
            attention_bias=bias,
            qkv_bias=traits.get("qkv_bias", bias),
            o_bias=traits.get("o_bias", bias),
            qk_norm=traits.get("qk_norm", False),
            embed_scale=traits.get("embed_scale", d.get("embedding_multiplier", 1.0)),
            attn_scale=traits.get("attn_scale", d.get("attention_multiplier")),
            attn_softcap=traits.get("attn_softcap"),
            final_softcap=traits.get("final_softcap"),
            qk_norm_full_width=traits.get("qk_norm_full_width", False),
            norm_layout=traits.get("norm_layout", "pre"),
            activation=traits.get("activation", "silu"),
            norm_offset=traits.get("norm_offset", 0.0),
            local_rope_theta=traits.get("local_rope_theta"),
            residual_scale=d.get("residual_multiplier", 1.0),
            logits_scaling=d.get("logits_scaling", 1.0),
            rope_layers=_rope_layers(d, model_type, n_layers),
            num_experts=n_experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) if n_experts else 0,
            moe_intermediate_size=d.get("moe_intermediate_size", d["intermediate_size"]) if n_experts else 0,
            moe_router=router if n_experts else "",
            moe_layers=_moe_layers(d, n_layers) if n_experts else [False] * n_layers,
            moe_activation=traits.get("moe_activation", "silu"),
            moe_bias=traits.get("moe_bias", False),
            swiglu_alpha=d.get("swiglu_alpha", 1.702),
            swiglu_limit=d.get("swiglu_limit", 7.0),
            attn_sinks=traits.get("attn_sinks", False),
            layer_windows=traits.get("layer_windows") or _layer_windows(d, n_layers),
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
    "olmo2": {"qk_norm": True, "qk_norm_full_width": True, "norm_layout": "post"},
    # OLMo 3: OLMo 2's block; windowed layers (`layer_types`, else all but every 4th) rotating by
    # rope_parameters' sliding_attention, unscaled (a config without it: the global base, unscaled);
    # the full layers' rope scaled (YaRN)
    "olmo3": {"qk_norm": True, "qk_norm_full_width": True, "norm_layout": "post",
              "local_rope_unscaled": True},
    "gpt_oss": {"moe_router": "topk_softmax", "moe_activation": "swiglu_oai", "moe_bias": True,
                "attn_sinks": True},
    # MiniMax-M2: q/k norms over the whole projection; every layer a MoE routed by sigmoid scores,
    # chosen with the score-correction bias, the chosen renormalised (one group: no group limit)
    "minimax_m2": {"qk_norm": True, "qk_norm_full_width": True, "moe_router": "sigmoid_grouped"},
    # MiniMax-M3 (models/minimax_m3.py reads its own keys): Gemma's 1 + w norms
    "minimax_m3_vl_text": {"norm_offset": 1.0},
}
_ARCH_OF_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "olmo3": "Olmo3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
                 "minimax_m2": "MiniMaxM2ForCausalLM"}
_GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")
# What transformers' config classes assume where a shipped config.json leaves keys out (the Gemma 3
# 4B+ checkpoints' `text_config` gives little more than the sizes).
_GEMMA_DEFAULTS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "rms_norm_eps": 1e-6,
                   "hidden_activation": "gelu_pytorch_tanh"}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(_GEMMA_DEFAULTS, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(_GEMMA_DEFAULTS, vocab_size=262208, max_position_embeddings=131072, rope_theta=1e6,
                        rope_local_base_freq=10000.0, sliding_window_pattern=6),
    # Olmo3Config's: every layer but each 4th windowed
    "olmo3": {"sliding_window": 4096, "rope_theta": 500000.0, "sliding_window_pattern": 4},
}
# transformers' names for the GLU activations the decoder runs (layers/activation.py GLUS)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _rope_parameters(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rope of full-attention layers, that of sliding-window layers where the config gives
    them apart): transformers 5 writes `rope_parameters` keyed by layer type for Gemma 3; older
    configs `rope_scaling` (+ Gemma 3's `rope_local_base_freq`)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "full_attention" in rope:
        return dict(rope["full_attention"]), rope.get("sliding_attention")
    local = d.get("rope_local_base_freq")
    return rope, None if local is None else {"rope_type": "default", "rope_theta": local}


def _rope_scaling(rope: dict[str, Any], kind: str | None, d: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling as layers/rotary.py reads it (None: plain rope), with the pre-training
    length where a config keeps it at the top level (LongRoPE, Phi-3's "su" before it had the name)
    or leaves it out (YaRN, dynamic NTK: the model's), and LongRoPE's extension factor (as
    transformers derives it)."""
    if kind in ("default", None):
        return None
    model_max = d.get("max_position_embeddings") or 4096
    original = rope.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if kind in ("longrope", "su"):
        return dict(rope, rope_type="longrope", original_max_position_embeddings=original,
                    factor=rope.get("factor") or model_max / original)
    if kind in ("yarn", "dynamic"):     # without it, the pre-training length is the model's
        return dict(rope, rope_type=kind, original_max_position_embeddings=original or model_max)
    return dict(rope)


def _rope_layers(d: dict[str, Any], model_type: str, n_layers: int) -> list[bool]:
    """Which layers rotate q and k: SmolLM3's `no_rope_layers` (1: rope), else every
    `no_rope_layer_interval`-th layer without (as transformers and llama.cpp build it)."""
    if d.get("no_rope_layers"):
        return [bool(r) for r in d["no_rope_layers"]]
    if model_type == "smollm3":
        interval = d.get("no_rope_layer_interval") or 4
        return [(i + 1) % interval != 0 for i in range(n_layers)]
    return [True] * n_layers


def _rotary_dim(d: dict[str, Any], rope: dict[str, Any], head_dim: int) -> int | None:
    """Phi-4-mini's partial rotary (`partial_rotary_factor`, top level or among the rope's keys);
    MiniMax-M2's released configs give the channels instead (`rotary_dim`, read where no factor is)."""
    factor = d.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    if factor is None and d.get("rotary_dim"):
        return None if d["rotary_dim"] == head_dim else int(d["rotary_dim"])
    factor = 1.0 if factor is None else factor
    return None if factor == 1.0 else int(head_dim * factor)


def _local_rope_theta(local_rope: dict[str, Any]) -> float:
    """The rope base of sliding-window layers (Gemma 3, OLMo 3), which rotate unscaled."""
    kind = local_rope.get("rope_type", local_rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_parameters.sliding_attention: rope_type {kind!r} is not supported on "
                         "sliding-window layers (supported: default)")
    return float(local_rope["rope_theta"])


def _gemma_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """What Gemma 2 / 3 change in the Llama block (transformers' Gemma2/Gemma3 modules): 1 + w norms,
    sandwich norms, the embedding times sqrt(hidden), GeGLU, query_pre_attn_scalar, soft-caps
    (Gemma 2), q/k norms (Gemma 3), a tied head; and the sliding layers when a config predates
    `layer_types`: every other one from layer 0 (Gemma 2), all but every `sliding_window_pattern`-th
    (Gemma 3)."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    fields: dict[str, Any] = {
        "embed_scale": d["hidden_size"] ** 0.5, "norm_layout": "sandwich", "norm_offset": 1.0,
        "activation": _ACTIVATIONS[act], "tie_word_embeddings": True,
        "attn_scale": d.get("query_pre_attn_scalar", d.get("head_dim", 256)) ** -0.5,
        "attn_softcap": d.get("attn_logit_softcapping"), "final_softcap": d.get("final_logit_softcapping"),
        "qk_norm": model_type != "gemma2",
    }
    n, window = d["num_hidden_layers"], d.get("sliding_window")
    if not d.get("layer_types") and window:
        pattern = 2 if model_type == "gemma2" else d.get("sliding_window_pattern", 6)
        fields["layer_windows"] = [None if (i + 1) % pattern == 0 else window for i in range(n)]
    return fields


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
    Qwen3/Gemma style: `layer_types` names each layer (OLMo 3 without it: all but every
    `sliding_window_pattern`-th); Qwen2/Qwen3 without `layer_types`: only when
    `use_sliding_window`, and then on layers `max_window_layers` and up (as transformers does)."""
    window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    if not layer_types and window and d.get("sliding_window_pattern"):    # OLMo 3's default
        layer_types = ["full_attention" if (i + 1) % d["sliding_window_pattern"] == 0 else "sliding_attention"
                       for i in range(n_layers)]
    if layer_types:
        use = d.get("use_sliding_window", True)
        return [window if (t == "sliding_attention" and use and window) else None for t in layer_types]
    if "use_sliding_window" in d:
        first = d.get("max_window_layers", 0) if d["use_sliding_window"] else n_layers
        return [window if window and i >= first else None for i in range(n_layers)]
    return [window] * n_layers if window else [None] * n_layers
