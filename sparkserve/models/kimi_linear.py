"""Kimi-Linear: a hybrid of KDA linear-attention layers (layers/kda.py) and NoPE MLA full-attention
layers (layers/mla.py), each followed by a dense SwiGLU MLP (the first layers) or a MoE with
shared experts (layers/moe.py).

Same contract as llama.py (forward -> final normed hidden, compute_logits, aux taps after any
layer kind). Pools: `kv_latent` per token for MLA layers (whole on every tensor-parallel rank: one
shared latent row), `kda_state` and `kda_conv` per request row for KDA layers (this rank's
heads); `has_request_state` turns the prefix cache off (a recurrent state summarises a whole
prefix and cannot be shared page by page). VERIFY leaves KDA state untouched until
`commit_verify` replays the accepted tokens (see layers/kda.py for the memory trade-off)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import Dim
from sparkserve.layers.dp_attention import run_mlp
from sparkserve.layers.kda import KimiDeltaAttention
from sparkserve.layers.mla import MLAttention, latent_buffers
from sparkserve.layers.moe import GatedMLP, SharedExpertMoE
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.vocab_parallel import VocabParallelEmbedding
from sparkserve.loader.weights import WeightLoader, blocks_of
from sparkserve.mem.hybrid_pool import HybridPool
from sparkserve.models.causal_lm import CausalLM, DecoderStack, stage_layer_list
from sparkserve.models.llama import _EXPERT_PART, _EXPERT_TENSOR, LlamaForCausalLM
from sparkserve.models.split_kv_b import SplitKvB


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


@dataclass
class KimiArgs:
    """Kimi-specific fields of config.json, under either the original checkpoint's names or
    transformers' (KimiLinearConfig) names."""
    layer_types: list[str]          # "linear_attention" (KDA) | "full_attention" (MLA)
    mlp_types: list[str]            # "dense" | "sparse"
    linear_heads: int
    linear_head_dim: int
    conv_kernel: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    num_experts: int
    top_k: int
    num_shared: int
    moe_intermediate: int
    num_groups: int
    topk_groups: int
    renormalize: bool
    scaling: float

    @classmethod
    def from_raw(cls, d: dict[str, Any], n: int) -> "KimiArgs":
        lin = d.get("linear_attn_config") or {}
        types = d.get("layer_types")
        if not types and "full_attn_layers" in lin and "kda_layers" in lin:
            types = [None] * n
            for i in lin["full_attn_layers"]:            # 1-indexed in the original config
                types[i - 1] = "full_attention"
            for i in lin["kda_layers"]:
                types[i - 1] = "linear_attention"
        types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        mlp = d.get("mlp_layer_types") or ["dense" if i < d.get("first_k_dense_replace", 1) else "sparse"
                                           for i in range(n)]
        if d.get("mla_use_nope") is False:
            raise ValueError("Kimi-Linear with rotary MLA (mla_use_nope: false) is not supported: "
                             "the reference implementation's MLA layers are NoPE")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Kimi-Linear hidden_act {d['hidden_act']!r} is not supported (silu only)")
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("Kimi-Linear router activation must be sigmoid")
        return cls(
            layer_types=list(types), mlp_types=list(mlp),
            linear_heads=_first(lin, "num_heads", default=_first(d, "linear_num_heads", default=32)),
            linear_head_dim=_first(lin, "head_dim", default=_first(d, "linear_head_dim", default=128)),
            conv_kernel=_first(lin, "short_conv_kernel_size", default=_first(d, "linear_conv_kernel_dim",
                                                                             default=4)),
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d.get("kv_lora_rank", 512),
            nope_dim=d.get("qk_nope_head_dim", 128), rope_dim=d.get("qk_rope_head_dim", 64),
            v_dim=_first(d, "v_head_dim", default=128),
            num_experts=_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=256),
            top_k=_first(d, "num_experts_per_token", "num_experts_per_tok", default=8),
            num_shared=_first(d, "num_shared_experts", "n_shared_experts", default=1),
            moe_intermediate=d.get("moe_intermediate_size", 1024),
            num_groups=_first(d, "num_expert_group", "n_group", default=1),
            topk_groups=_first(d, "topk_group", default=1),
            renormalize=bool(_first(d, "moe_renormalize", "norm_topk_prob", default=True)),
            scaling=float(_first(d, "routed_scaling_factor", default=1.0)),
        )


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, a: KimiArgs, i: int):
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        if a.layer_types[i] == "linear_attention":
            self.self_attn = KimiDeltaAttention(i, d, a.linear_heads, a.linear_head_dim, a.conv_kernel,
                                                cfg.rms_norm_eps)
        else:
            self.self_attn = MLAttention(i, d, cfg.num_attention_heads, a.q_lora_rank, a.kv_lora_rank,
                                         a.nope_dim, a.rope_dim, a.v_dim, cfg.attention_bias)
        with ps.mlp_scope():
            if a.mlp_types[i] == "sparse":
                self.mlp = SharedExpertMoE(d, a.num_experts, a.moe_intermediate, a.top_k, a.num_shared,
                                           a.num_groups, a.topk_groups, a.renormalize, a.scaling)
            else:
                self.mlp = GatedMLP(d, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        if isinstance(self.self_attn, KimiDeltaAttention) and batch.cp is not None:
            # Context parallel: the recurrence runs block by block in sequence order, its state
            # handed from rank to rank (distributed/context_parallel.py).
            attn = self.self_attn
            x = x + batch.cp.run_in_sequence(attn, h, attn.state_buffers(batch.kv_pool))
        else:
            x = x + self.self_attn(h, batch)
        return x + run_mlp(self.mlp, self.post_attention_layernorm(x), batch)


class KimiLinearModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, a: KimiArgs):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = stage_layer_list(cfg.num_hidden_layers, lambda i: KimiDecoderLayer(cfg, a, i))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearForCausalLM(CausalLM):
    # the MLA latents may be quantized (layers/mla.py); the KDA state stays float32
    KV_CACHE_DTYPES = (torch.float32, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
    has_request_state = True
    stacked_params = {".gate_proj.": (".gate_up_proj.", "gate"), ".up_proj.": (".gate_up_proj.", "up")}

    def __init__(self, cfg: ModelConfig):
        args = KimiArgs.from_raw(cfg.raw, cfg.num_hidden_layers)
        super().__init__(cfg, KimiLinearModel(cfg, args))
        self.args = args

    @staticmethod
    def tp_dims(cfg: ModelConfig) -> list[Dim]:
        """What splits over the tensor-parallel ranks (distributed/sharding.py checks them): MLA
        and KDA heads, dense MLP and shared-expert widths, routed experts (--ep-size)."""
        a = KimiArgs.from_raw(cfg.raw, cfg.num_hidden_layers)
        dims = []
        if "sparse" in a.mlp_types:
            dims.append(Dim("experts", a.num_experts, flag="--ep-size", mlp=True, width=a.moe_intermediate))
        if any(t != "linear_attention" for t in a.layer_types):
            dims.append(Dim("attention heads", cfg.num_attention_heads))
        if "linear_attention" in a.layer_types:
            dims.append(Dim("KDA heads", a.linear_heads))
        if "dense" in a.mlp_types:
            dims.append(Dim("dense MLP channels", cfg.intermediate_size, mlp=True))
        if "sparse" in a.mlp_types and a.num_shared:
            dims.append(Dim("shared-expert channels", a.moe_intermediate * a.num_shared, mlp=True,
                            whole_under_a2a=True))
        return dims

    def commit_verify(self, batch: ForwardBatch, kept: list[int]) -> None:
        """After VERIFY: advance every KDA layer's state by each request's kept tokens."""
        assert batch.mode == ForwardMode.VERIFY
        for layer in self._kda_layers():
            layer.commit_verify(batch, kept)

    # ---- pools ------------------------------------------------------------------------------
    def _own_layers(self) -> list[KimiDecoderLayer]:
        return [self.model.layers[i] for i in self.layer_range]

    def _kda_layers(self) -> list[KimiDeltaAttention]:
        return [l.self_attn for l in self._own_layers() if isinstance(l.self_attn, KimiDeltaAttention)]

    def _mla_ids(self) -> list[int]:
        return [i for i in self.layer_range if isinstance(self.model.layers[i].self_attn, MLAttention)]

    def _latent_dim(self) -> int:
        return self.args.kv_lora_rank + self.args.rope_dim

    def make_pool(self, num_slots: int, num_rows: int, swa_slots: int = 0) -> HybridPool:
        pool = HybridPool(num_slots, num_rows)
        if self._mla_ids():
            for name, shape, dtype in latent_buffers(self._latent_dim(), self.kv_dtype):
                pool.add(name, "token_page", self._mla_ids(), shape, dtype)
        kda = self._kda_layers()
        if kda:
            splits = kda[0].state_splits()
            for name, shape in kda[0].state_shapes().items():
                pool.add(name, "request_row", [l.layer_id for l in kda], shape, split=splits[name])
        return pool

    def pool_bytes_per_token(self) -> int:
        """Token-kind bytes only (the MLA latents); KDA state is per request row."""
        n = len(self._mla_ids())
        return max(4, HybridPool.token_bytes([(n, shape, dtype) for _, shape, dtype
                                              in latent_buffers(self._latent_dim(), self.kv_dtype)]))

    def pool_bytes_per_request(self) -> int:
        """KDA recurrent + conv state of one request row, over every KDA layer (~45 MiB per
        request at Kimi-Linear's real sizes)."""
        kda = self._kda_layers()
        if not kda:
            return 0
        return HybridPool.row_bytes([(len(kda), shape,
                                      torch.float32) for shape in kda[0].state_shapes().values()])

    # ---- loading ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Original Kimi names (block_sparse_moe, per-expert w1/w2/w3, q/k/v_conv1d, what
        save_pretrained writes) or transformers' runtime names (mlp, stacked experts, conv1d,
        forget_gate.*); a GGUF's (loader/gguf.py): experts stacked or per expert as blocks, MLA's
        kv_b split into `k_b_proj` [heads, kv_lora_rank, nope] and `v_b_proj` [heads, v,
        kv_lora_rank], held as blocks or joined: models/split_kv_b.py); KDA projections as blocks."""
        loader = WeightLoader(self, self.stacked_params)
        modules = dict(self.named_modules())
        pieces: dict[str, set] = {}      # parameters assembled from several checkpoint tensors
        filled: dict[str, set] = {}      # experts' parts loaded
        kv_b = SplitKvB(self.args.kv_lora_rank, modules, loader)
        for name, t in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.",
                                                                       ".self_attn.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if kv_b.is_half(name):
                if (joined := kv_b.add(name, t)) is None:
                    continue
                name, t = joined
            m = re.match(r"(.*\.self_attn)\.(q|k|v|f_a|g_a|b)_proj\.weight$", name)
            if m and isinstance(modules.get(m[1]), KimiDeltaAttention):
                modules[m[1]].in_proj.load(m[2], t, blocks=blocks_of(t))     # a GGUF's: as blocks
                loader.mark_loaded(f"{m[1]}.in_proj.weight#{m[2]}")
                continue
            m = re.match(r"(.*\.self_attn)\.(q_|k_|v_|)conv1d\.weight$", name)
            if m:
                w = modules[m[1]].conv_weight
                part = {"q_": 0, "k_": 1, "v_": 2, "": None}[m[2]]
                t, _ = modules[m[1]].local_shard(t.reshape(-1, t.shape[-1]), stacks=3 if part is None else 1)
                (w.data if part is None else w.data[part * t.shape[0]:(part + 1) * t.shape[0]]).copy_(t)
                self._mark_piece(pieces, f"{m[1]}.conv_weight", m[2] or "all", 3, loader)
                continue
            if name.endswith(".self_attn.A_log"):
                t = t.reshape(-1)
            m = _EXPERT_TENSOR.fullmatch(name)
            if m:
                LlamaForCausalLM._load_expert(modules[m[1]], m[1], _EXPERT_PART[m[3]], t,
                                              None if m[2] is None else int(m[2]), filled, loader)
                continue
            loader.load(name, t)
        if self.config.tie_word_embeddings:
            loader.mark_loaded("lm_head.weight")
        loader.check_complete()

    @staticmethod
    def _mark_piece(pieces: dict[str, set], param: str, piece, total: int, loader: WeightLoader) -> None:
        """A parameter filled from several checkpoint tensors counts as loaded once all are in."""
        got = pieces.setdefault(param, set())
        got.add(piece)
        if piece == "all" or len(got) == total:
            loader.mark_loaded(param)
