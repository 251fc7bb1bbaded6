"""MiniMax-M3 text model (transformers `minimax_m3_vl_text`, MiniMaxM3VLForCausalLM).

Per layer: dense or block-sparse attention (`layer_types`: "minimax_m3_sparse" runs the lightning
indexer, layers/sparse_indexer.py, and reads only the chosen key blocks), and a dense SwiGLU-OAI
MLP or a sigmoid-routed MoE with a shared expert (`mlp_layer_types`). Heads use per-head q/k norm
and partial RoPE; every RMSNorm is Gemma-style (scale 1 + w), folded into the weight at load.

Sparse layers may add the index value path (SGLang's per-layer `sparse_disable_index_value`
flag, 0 = on); absent flag = K-only, as transformers and the released M3 checkpoint have it.
Interface as LlamaForCausalLM (docs/design.md, contracts 1-3).

Tensor parallel: query and KV heads split as in Llama (KV replicated when fewer than the ranks),
and so do the indexer's heads (layers/sparse_indexer.py says why that is exact); dense MLP and
shared-expert widths split, routed experts split over the same ranks (--ep-size = --tp-size).
Each block sums its partial outputs with one all-reduce (attention + index value; routed +
shared experts). The q/k norms are per head_dim, shared by every head: whole on every rank."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.core.pool import Split
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import Dim, heads_shard, kv_heads_shard, kv_split, width_shard
from sparkserve.layers.activation import swiglu_oai
from sparkserve.layers.attention import PagedAttention
from sparkserve.layers.dp_attention import run_mlp
from sparkserve.layers.linear import ColumnParallelLinear, FusedLinear, RowParallelLinear
from sparkserve.layers.moe import Experts, MoEBlock, Router, shared_experts_scope
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.rotary import RotaryEmbedding, apply_partial_rotary
from sparkserve.layers.sparse_attention import BlockSparseAttention
from sparkserve.layers.sparse_indexer import LightningIndexer
from sparkserve.layers.vocab_parallel import VocabParallelEmbedding
from sparkserve.loader.weights import WeightLoader, values_of
from sparkserve.mem.hybrid_pool import HybridPool
from sparkserve.mem.kv_quant import SCALE_DTYPE, block_size, is_quantized, scale_component
from sparkserve.models.causal_lm import CausalLM, DecoderStack, stage_layer_list
from sparkserve.models.llama import _EXPERT_PART, _EXPERT_TENSOR, LlamaForCausalLM

# A GGUF file's dense MLP / shared expert: gate and up apart (HF checkpoints hold them as one gate_up_proj)
_GATE_OR_UP = re.compile(r"(.*\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight")


@dataclass
class M3Spec:
    """The model-specific fields of config.json (flat transformers names first, then the
    original `sparse_attention_config` / `moe_layer_freq` layout)."""
    sparse: list[bool]
    index_value: list[bool]
    moe: list[bool]
    index_heads: int
    index_head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int
    init_blocks: int
    rotary_dim: int
    dense_intermediate: int
    shared_intermediate: int
    num_experts: int
    top_k: int
    routed_scaling: float
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "M3Spec":
        raw, n = cfg.raw, cfg.num_hidden_layers
        sac = raw.get("sparse_attention_config") or {}

        def pick(flat: str, legacy: str, default: Any) -> Any:
            return raw[flat] if raw.get(flat) is not None else sac.get(legacy, default)

        if raw.get("layer_types"):
            sparse = [t == "minimax_m3_sparse" for t in raw["layer_types"]]
        else:
            sparse = [bool(f) for f in sac.get("sparse_attention_freq", [0] * n)]
        off = raw.get("sparse_disable_index_value", sac.get("sparse_disable_index_value"))
        off = [True] * n if off is None else ([bool(off)] * n if isinstance(off, (bool, int)) else
                                              [bool(f) for f in off])
        if raw.get("mlp_layer_types"):
            moe = [t == "sparse" for t in raw["mlp_layer_types"]]
        else:
            moe = [bool(f) for f in raw.get("moe_layer_freq", [1] * n)]
        rope = raw.get("rope_parameters") or {}
        rotary_dim = int(cfg.head_dim * rope.get("partial_rotary_factor", raw.get("partial_rotary_factor",
                                                                                  1.0)))
        spec = cls(
            sparse=sparse, index_value=[s and not o for s, o in zip(sparse, off)], moe=moe,
            index_heads=int(pick("index_n_heads", "sparse_num_index_heads", 4)),
            index_head_dim=int(pick("index_head_dim", "sparse_index_dim", 128)),
            block_size=int(pick("index_block_size", "sparse_block_size", 128)),
            topk_blocks=int(pick("index_topk_blocks", "sparse_topk_blocks", 16)),
            local_blocks=int(pick("index_local_blocks", "sparse_local_block", 1)),
            init_blocks=int(pick("index_init_blocks", "sparse_init_block", 0)),
            rotary_dim=rotary_dim,
            dense_intermediate=int(raw.get("dense_intermediate_size", cfg.intermediate_size)),
            shared_intermediate=int(raw.get("shared_intermediate_size", cfg.intermediate_size)),
            num_experts=int(raw.get("num_local_experts", raw.get("num_experts", 1))),
            top_k=int(raw.get("num_experts_per_tok", 1)),
            routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
        if any(spec.sparse) and spec.index_head_dim < rotary_dim:
            raise ValueError(f"index_head_dim {spec.index_head_dim} < rotary dim {rotary_dim} is not "
                             f"supported")
        if len(sparse) != n or len(moe) != n or len(off) != n:
            raise ValueError(f"per-layer lists must have num_hidden_layers={n} entries")
        return spec

    def activation(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The MLP / expert activation: clamped SwiGLU-OAI with this config's alpha and limit."""
        return partial(swiglu_oai, alpha=self.swiglu_alpha, limit=self.swiglu_limit)


class OAIMLP(nn.Module):
    """Dense SwiGLU-OAI MLP (dense layers and the MoE's shared expert); gate|up is one weight
    in the checkpoint (a rank keeps its rows of each half). `reduce=False` (shared expert): the
    partial sum, added to the experts' before the MoE block's one all-reduce."""

    def __init__(self, hidden: int, intermediate: int, spec: M3Spec, reduce: bool = True):
        super().__init__()
        index, parts, _ = width_shard(intermediate)
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * intermediate, part=(index, parts), stacks=2)
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce=reduce)
        self.activation = spec.activation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))


class M3MoE(MoEBlock):
    """Sigmoid routing with a bias correction (choice only), renormalised top-k weights times
    `routed_scaling_factor`, plus one always-on shared expert."""

    def __init__(self, cfg: ModelConfig, spec: M3Spec):
        with shared_experts_scope():
            shared = OAIMLP(cfg.hidden_size, spec.shared_intermediate, spec, reduce=False)
        super().__init__(Router(cfg.hidden_size, spec.num_experts, spec.top_k, scaling=spec.routed_scaling),
                         Experts(spec.num_experts, cfg.hidden_size, cfg.intermediate_size, spec.activation()),
                         shared)


class M3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: M3Spec, layer_id: int):
        super().__init__()
        q_index, q_parts, self.h = heads_shard(cfg.num_attention_heads)
        kv_index, kv_parts, self.hkv = kv_heads_shard(cfg.num_key_value_heads)
        self.d = cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.h * self.d, "k": self.hkv * self.d,
                                                      "v": self.hkv * self.d},
                                    tp_parts={"q": (q_index, q_parts), "k": (kv_index, kv_parts),
                                              "v": (kv_index, kv_parts)})
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.d, cfg.hidden_size, reduce=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        if spec.sparse[layer_id]:
            self.indexer = LightningIndexer(layer_id, cfg.hidden_size, spec.index_heads, spec.index_head_dim,
                                            spec.block_size, spec.topk_blocks, spec.local_blocks,
                                            spec.init_blocks, cfg.rms_norm_eps, spec.index_value[layer_id])
            self.attn = BlockSparseAttention(layer_id, self.h, self.hkv, self.d, spec.block_size,
                                             self.indexer.h)
        else:
            self.indexer = None
            self.attn = PagedAttention(layer_id, self.h, self.hkv, self.d)

    def forward(self, x: torch.Tensor, cos_sin, batch: ForwardBatch) -> torch.Tensor:
        h, hkv, d = self.h, self.hkv, self.d
        qkv = self.qkv_proj(x)
        q = apply_partial_rotary(self.q_norm(qkv[:, :h * d].view(-1, h, d)), *cos_sin)
        k = apply_partial_rotary(self.k_norm(qkv[:, h * d:(h + hkv) * d].view(-1, hkv, d)), *cos_sin)
        v = qkv[:, (h + hkv) * d:].view(-1, hkv, d)
        if self.indexer is None:
            return ps.all_reduce(self.o_proj(self.attn(q, k, v, batch)))
        block_ids, index_out = self.indexer(x, cos_sin, batch)
        out = self.o_proj(self.attn(q, k, v, batch, block_ids))
        return ps.all_reduce(out if index_out is None else out + index_out)


class M3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: M3Spec, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = M3Attention(cfg, spec, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with ps.mlp_scope():
            self.mlp = M3MoE(cfg, spec) if spec.moe[layer_id] else OAIMLP(cfg.hidden_size,
                                                                          spec.dense_intermediate, spec)

    def forward(self, x, cos_sin, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch)
        return x + run_mlp(self.mlp, self.post_attention_layernorm(x), batch)


class M3Model(DecoderStack):
    def __init__(self, cfg: ModelConfig, spec: M3Spec):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = stage_layer_list(cfg.num_hidden_layers, lambda i: M3DecoderLayer(cfg, spec, i))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)


class MiniMaxM3ForCausalLM(CausalLM):
    # checkpoint fragment -> (fused fragment, shard); also maps the indexer's q/k/v_proj
    stacked_params = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"),
                      ".v_proj.": (".qkv_proj.", "v")}

    def __init__(self, cfg: ModelConfig):
        spec = M3Spec.from_config(cfg)
        super().__init__(cfg, M3Model(cfg, spec))
        self.spec = spec

    @staticmethod
    def tp_dims(cfg: ModelConfig) -> list[Dim]:
        """What splits over the tensor-parallel ranks (distributed/sharding.py checks them)."""
        s = M3Spec.from_config(cfg)
        h = cfg.num_attention_heads
        dims = [Dim("attention heads", h), Dim("KV heads", cfg.num_key_value_heads, serves=h)]
        if any(s.sparse):
            dims.append(Dim("index heads", s.index_heads, serves=h))
        if not all(s.moe):
            dims.append(Dim("dense MLP channels", s.dense_intermediate, mlp=True))
        if any(s.moe):
            dims += [Dim("experts", s.num_experts, flag="--ep-size", mlp=True, width=cfg.intermediate_size),
                     Dim("shared-expert channels", s.shared_intermediate, mlp=True, whole_under_a2a=True)]
        return dims

    # ---- pools (docs/design.md, contract 3): main KV on every layer, index K on sparse layers, index V
    # on sparse layers with the value path; all token_page at the same slots.
    def _pool_specs(self) -> list[tuple[str, list[int], tuple[int, ...], Split | None]]:
        c, s = self.config, self.spec
        every = list(self.layer_range)            # this pipeline stage's layers
        hkv = kv_heads_shard(c.num_key_value_heads)[2]   # this rank's KV heads; index K/V are one shared head
        kv = kv_split(c.num_key_value_heads)
        specs = [("k", every, (hkv, c.head_dim), kv), ("v", every, (hkv, c.head_dim), kv),
                 ("index_k", [i for i in every if s.sparse[i]], (s.index_head_dim,), None),
                 ("index_v", [i for i in every if s.index_value[i]], (s.index_head_dim,), None)]
        return [sp for sp in specs if sp[1]]

    # K/V and index K/V may be quantized (--kv-cache-dtype int8 / fp8: mem/kv_quant.py), each with
    # a block-scale buffer of its own (cut over the tp ranks as it is)
    KV_CACHE_DTYPES = (torch.float32, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

    def _pool_buffers(self) -> list[tuple[str, list[int], tuple[int, ...], Split | None, torch.dtype]]:
        out = []
        for name, layers, shape, split in self._pool_specs():
            out.append((name, layers, shape, split, self.kv_dtype))
            if is_quantized(self.kv_dtype):
                blocks = (*shape[:-1], shape[-1] // block_size(shape[-1]))
                out.append((scale_component(name, self.kv_dtype), layers, blocks, split, SCALE_DTYPE))
        return out

    def make_pool(self, num_slots: int, num_rows: int, swa_slots: int = 0) -> HybridPool:
        pool = HybridPool(num_slots, num_rows)
        for name, layers, shape, split, dtype in self._pool_buffers():
            pool.add(name, "token_page", layers, shape, dtype, split=split)
        return pool

    def pool_bytes_per_token(self) -> int:
        return HybridPool.token_bytes([(len(layers), shape, dtype)
                                       for _, layers, shape, _, dtype in self._pool_buffers()])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF checkpoints (gate|up fused, experts stacked) and GGUF files (loader/gguf.py: gate and up
        apart, joined here; experts stacked in fp32 or one by one with their blocks)."""
        loader = WeightLoader(self, self.stacked_params)
        modules, filled, halves = dict(self.named_modules()), {}, {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.startswith("mtp."):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if (".indexer.v_proj." in name or ".indexer.o_proj." in name) and \
                    not self.spec.index_value[int(name.split(".layers.")[1].split(".")[0])]:
                continue      # value weights of a layer whose flag disables the value path
            if name.endswith("norm.weight"):
                tensor = tensor + 1.0     # Gemma RMSNorm: x_hat * (1 + w)
            if (m := _EXPERT_TENSOR.fullmatch(name)) is not None:
                LlamaForCausalLM._load_expert(modules[m[1]], m[1], _EXPERT_PART[m[3]], tensor,
                                              None if m[2] is None else int(m[2]), filled, loader)
                continue
            if (m := _GATE_OR_UP.fullmatch(name)) is not None:
                pair = halves.setdefault(m[1], {})
                pair[m[2]] = values_of(tensor)
                if len(pair) == 2:
                    loader.load(f"{m[1]}.gate_up_proj.weight", torch.cat([pair["gate"], pair["up"]]))
                    del halves[m[1]]
                continue
            loader.load(name, tensor)
        if self.config.tie_word_embeddings:
            loader.mark_loaded("lm_head.weight")
        loader.check_complete()
