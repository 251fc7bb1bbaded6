"""DeepSeek-V2 / V2-Lite: MLA attention with a decoupled rope (layers/mla.py, [latent | rotated k_pe]
cached per token), the first `first_k_dense_replace` layers with a dense SwiGLU MLP, the rest a MoE
of `n_shared_experts` shared experts plus routed ones (softmax, greedy or group-limited top-k, never
renormalised, times routed_scaling_factor: layers/moe.py `softmax_greedy`).

YaRN as transformers' DeepseekV2 runs it: the rope tables come from the `yarn` scaling (cos / sin
times mscale(mscale) / mscale(mscale_all_dim), 1 for V2-Lite's equal pair), and the softmax scale is
qk_head_dim ** -0.5 times mscale(factor, mscale_all_dim) squared (`yarn_apply_mscale`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch, PPProxy
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import Dim
from sparkserve.layers.dp_attention import run_mlp
from sparkserve.layers.mla import MLAttention, latent_buffers, rope_rows_to_halves
from sparkserve.layers.moe import GatedMLP, SharedExpertMoE
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.rotary import RotaryEmbedding
from sparkserve.layers.vocab_parallel import VocabParallelEmbedding
from sparkserve.loader.weights import WeightLoader, blocks_of, values_of, with_blocks
from sparkserve.mem.hybrid_pool import HybridPool
from sparkserve.models.causal_lm import CausalLM, DecoderStack, stage_layer_list
from sparkserve.models.deepseek_v2_native import NativeMLAStep
from sparkserve.models.llama import _EXPERT_PART, _EXPERT_TENSOR, LlamaForCausalLM
from sparkserve.models.split_kv_b import SplitKvB

_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass
class DeepseekV2Args:
    """DeepSeek-V2 fields of config.json (transformers' DeepseekV2Config names)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    num_experts: int
    top_k: int
    num_shared: int
    moe_intermediate: int
    first_dense: int
    num_groups: int
    topk_groups: int
    scaling: float
    softmax_scale: float

    @classmethod
    def from_raw(cls, d: dict[str, Any], rope: dict[str, Any] | None) -> "DeepseekV2Args":
        """`rope`: the model's rope scaling (ModelConfig.rope_scaling)."""
        method = d.get("topk_method") or "greedy"
        if method not in _TOPK_METHODS:
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported "
                             f"(supported: {', '.join(_TOPK_METHODS)})")
        if d.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"DeepSeek-V2 scoring_func {d['scoring_func']!r} is not supported "
                             "(softmax only)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"DeepSeek-V2 hidden_act {d['hidden_act']!r} is not supported (silu only)")
        nope, rope_dim = d.get("qk_nope_head_dim", 128), d.get("qk_rope_head_dim", 64)
        scale = (nope + rope_dim) ** -0.5
        if rope and (mscale_all := rope.get("mscale_all_dim")) and rope.get("factor", 1.0) > 1:
            scale *= (0.1 * mscale_all * math.log(rope["factor"]) + 1.0) ** 2
        grouped = method == "group_limited_greedy"
        return cls(
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d.get("kv_lora_rank", 512),
            nope_dim=nope, rope_dim=rope_dim, v_dim=d.get("v_head_dim", 128),
            num_experts=d.get("n_routed_experts") or 0, top_k=d.get("num_experts_per_tok") or 0,
            num_shared=d.get("n_shared_experts") or 0, moe_intermediate=d.get("moe_intermediate_size", 1407),
            first_dense=d.get("first_k_dense_replace", 0),
            num_groups=(d.get("n_group") or 1) if grouped else 1,
            topk_groups=(d.get("topk_group") or 1) if grouped else 1,
            scaling=float(d.get("routed_scaling_factor", 1.0)), softmax_scale=scale)

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, a: DeepseekV2Args, i: int):
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = MLAttention(i, d, cfg.num_attention_heads, a.q_lora_rank, a.kv_lora_rank, a.nope_dim,
                                     a.rope_dim, a.v_dim, cfg.attention_bias, scale=a.softmax_scale)
        with ps.mlp_scope():
            if a.is_moe(i):
                self.mlp = SharedExpertMoE(d, a.num_experts, a.moe_intermediate, a.top_k, a.num_shared,
                                           a.num_groups, a.topk_groups, False, a.scaling,
                                           router="softmax_greedy")
            else:
                self.mlp = GatedMLP(d, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, rope)
        return x + run_mlp(self.mlp, self.post_attention_layernorm(x), batch)


class DeepseekV2Model(DecoderStack):
    def __init__(self, cfg: ModelConfig, a: DeepseekV2Args):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = stage_layer_list(cfg.num_hidden_layers, lambda i: DeepseekV2DecoderLayer(cfg, a, i))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.rope_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)


class DeepseekV2ForCausalLM(CausalLM):
    stacked_params = {".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up")}

    def __init__(self, cfg: ModelConfig):
        args = DeepseekV2Args.from_raw(cfg.raw, cfg.rope_scaling)
        super().__init__(cfg, DeepseekV2Model(cfg, args))
        self.args = args
        self.native = NativeMLAStep()

    def enable_native_step(self, on: bool) -> None:
        self.native.enabled = on

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                proxy: PPProxy | None = None) -> torch.Tensor | PPProxy:
        if proxy is None and self.native.applies(self, batch):
            return self.native.forward(self, input_ids, batch)
        return super().forward(input_ids, positions, batch, proxy)

    @staticmethod
    def tp_dims(cfg: ModelConfig) -> list[Dim]:
        """MLA heads, dense MLP and shared-expert widths, routed experts (--ep-size)."""
        a = DeepseekV2Args.from_raw(cfg.raw, cfg.rope_scaling)
        moe = [a.is_moe(i) for i in range(cfg.num_hidden_layers)]
        dims = [Dim("attention heads", cfg.num_attention_heads)]
        if any(moe):
            dims.insert(0, Dim("experts", a.num_experts, flag="--ep-size", mlp=True,
                               width=a.moe_intermediate))
            if a.num_shared:
                dims.append(Dim("shared-expert channels", a.moe_intermediate * a.num_shared, mlp=True,
                                whole_under_a2a=True))
        if not all(moe):
            dims.append(Dim("dense MLP channels", cfg.intermediate_size, mlp=True))
        return dims

    # ---- pools: one latent row per token and layer ------------------------------------------
    def _latent_dim(self) -> int:
        return self.args.kv_lora_rank + self.args.rope_dim

    # the latent may be quantized (--kv-cache-dtype int8 / fp8: mem/kv_quant.py), with its block scales
    KV_CACHE_DTYPES = (torch.float32, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

    def make_pool(self, num_slots: int, num_rows: int, swa_slots: int = 0) -> HybridPool:
        pool = HybridPool(num_slots, num_rows)
        for name, shape, dtype in self._pool_buffers():
            pool.add(name, "token_page", list(self.layer_range), shape, dtype)
        return pool

    def pool_bytes_per_token(self) -> int:
        n = len(self.layer_range)
        return HybridPool.token_bytes([(n, shape, dtype) for _, shape, dtype in self._pool_buffers()])

    def _pool_buffers(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return latent_buffers(self._latent_dim(), self.kv_dtype)

    # ---- loading ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (per-expert gate/up/down_proj, or GGUF's stacked ones as `experts.gate_proj`;
        a GGUF's kv_b split into `k_b_proj` [heads, kv_lora_rank, nope] and `v_b_proj` [heads, v,
        kv_lora_rank], held as blocks or joined: models/split_kv_b.py); the rope rows of q and kv_a
        reordered pairs -> halves (layers/mla.py)."""
        a = self.args
        self.native.reset()
        loader = WeightLoader(self, self.stacked_params)
        modules, filled = dict(self.named_modules()), {}
        kv_b = SplitKvB(a.kv_lora_rank, modules, loader)
        for name, t in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if kv_b.is_half(name):
                if (joined := kv_b.add(name, t)) is None:
                    continue
                name, t = joined
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                t = _rope_halves(t, a.rope_dim, a.nope_dim + a.rope_dim)
            elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
                t = _rope_halves(t, a.rope_dim, a.kv_lora_rank + a.rope_dim)
            m = _EXPERT_TENSOR.fullmatch(name)
            if m:
                LlamaForCausalLM._load_expert(modules[m[1]], m[1], _EXPERT_PART[m[3]], t,
                                              None if m[2] is None else int(m[2]), filled, loader)
                continue
            loader.load(name, t)
        if self.config.tie_word_embeddings:
            loader.mark_loaded("lm_head.weight", tied_to="model.embed_tokens.weight")
        loader.check_complete()


def _rope_halves(t: torch.Tensor, rope_dim: int, head_width: int) -> torch.Tensor:
    """rope_rows_to_halves of a checkpoint tensor, its GGUF blocks' rows permuted alike (so q_b and
    kv_a keep their blocks: int8 kernels, not an fp32 GEMM); an unread one stays unread."""
    blocks = blocks_of(t)
    if blocks is None:
        return rope_rows_to_halves(values_of(t), rope_dim, head_width)
    perm = rope_rows_to_halves(torch.arange(t.shape[0]), rope_dim, head_width)
    values = torch.empty(t.shape, device="meta") if t.is_meta else t[perm]
    return with_blocks(values, blocks.rows(perm))
