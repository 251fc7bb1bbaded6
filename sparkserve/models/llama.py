"""Llama-family decoder (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norm, Mistral with sliding
windows, SmolLM2; Mixtral and Qwen3-MoE with MoE layers; Gemma 2 / 3 through models/gemma.py). Which
projections carry a bias is the config's `qkv_bias` / `o_bias`; which layers are MoE and their router
rule, `moe_layers` / `moe_router` (layers/moe.py SharedExpertMoE without shared experts); Gemma's
departures (sandwich norms, GeGLU, attention scale and soft-cap, embedding scale, a local rope base on
sliding layers) are ModelConfig fields too.

Contract (docs/design.md): `forward(input_ids, positions, batch)` returns final normed hidden states;
logits come from `compute_logits(hidden)` so callers choose the rows; `set_aux_layers(ids)`
makes the forward record the output of those decoder layers into `batch.aux_hidden`."""
from __future__ import annotations

import functools
import re
from typing import Callable, Iterable

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch, PPProxy
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import Dim, heads_shard, kv_heads_shard, kv_split, width_shard
from sparkserve.layers.activation import GLUS, swiglu_oai
from sparkserve.layers.attention import PagedAttention
from sparkserve.layers.dp_attention import run_mlp
from sparkserve.layers.linear import FusedLinear, RowParallelLinear
from sparkserve.layers.moe import SharedExpertMoE
from sparkserve.layers.norm import RMSNorm, WidthRMSNorm
from sparkserve.layers.rotary import RotaryEmbedding, apply_partial_rotary
from sparkserve.layers.sharded import Sharded
from sparkserve.layers.vocab_parallel import VocabParallelEmbedding
from sparkserve.loader.weights import WeightLoader, blocks_of, split_rows, values_of
from sparkserve.mem.kv_pool import KVPool, split_windows, uniform_window
from sparkserve.models.causal_lm import CausalLM, DecoderStack, stage_layer_list
from sparkserve.models.llama_native import NativeStep


class LlamaAttention(Sharded):
    """Heads split over the tensor-parallel ranks (KV heads replicated when fewer than ranks);
    o_proj sums the ranks' partial outputs. GPT-OSS's sinks (one per head) split with the heads."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        q_index, q_parts, self.h = heads_shard(cfg.num_attention_heads)
        kv_index, kv_parts, self.hkv = kv_heads_shard(cfg.num_key_value_heads)
        self.d = cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.h * self.d, "k": self.hkv * self.d,
                                                      "v": self.hkv * self.d}, bias=cfg.qkv_bias,
                                    tp_parts={"q": (q_index, q_parts), "k": (kv_index, kv_parts),
                                              "v": (kv_index, kv_parts)})
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.full_width_norm = cfg.qk_norm_full_width
        if cfg.qk_norm and self.full_width_norm:      # OLMo2: over the projection, before the heads
            self.q_norm = WidthRMSNorm(cfg.num_attention_heads * self.d, cfg.rms_norm_eps, q_index, q_parts)
            self.k_norm = WidthRMSNorm(cfg.num_key_value_heads * self.d, cfg.rms_norm_eps, kv_index, kv_parts)
        else:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(layer_id, self.h, self.hkv, self.d, cfg.layer_windows[layer_id],
                                   cfg.attn_scale, cfg.attn_softcap)
        self.q_index = q_index
        self.sinks = nn.Parameter(torch.empty(self.h), requires_grad=False) if cfg.attn_sinks else None

    def local_shard(self, tensor, blocks=None):
        """This rank's heads' sinks (the only tensor held here directly)."""
        return tensor[self.q_index * self.h:(self.q_index + 1) * self.h], None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                batch: ForwardBatch) -> torch.Tensor:
        h, hkv, d = self.h, self.hkv, self.d
        qkv = self.qkv_proj(x)
        v = qkv[:, (h + hkv) * d:].view(-1, hkv, d)
        q, k = qkv[:, :h * d], qkv[:, h * d:(h + hkv) * d]
        if self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(-1, h, d), k.reshape(-1, hkv, d)
        if self.q_norm is not None and not self.full_width_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin is not None:     # None: a NoPE layer (SmolLM3)
            if self.q_norm is None:   # one rotary call for q and k together
                qk = apply_partial_rotary(qkv[:, :(h + hkv) * d].view(-1, h + hkv, d), *cos_sin)
                q, k = qk[:, :h], qk[:, h:]
            else:
                q, k = apply_partial_rotary(q, *cos_sin), apply_partial_rotary(k, *cos_sin)
        return self.o_proj(self.attn(q, k, v, batch, self.sinks))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        index, parts, width = width_shard(cfg.intermediate_size)
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": width, "up": width},
                                        tp_parts={"gate": (index, parts), "up": (index, parts)})
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = GLUS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def moe_activation(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' GLU: the dense MLP's, or GPT-OSS's clamped SwiGLU with its alpha and limit."""
    if cfg.moe_activation == "swiglu_oai":
        return functools.partial(swiglu_oai, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return GLUS[cfg.moe_activation]


class LlamaDecoderLayer(nn.Module):
    """cfg.norm_layout: "pre" (Llama: post_attention_layernorm is the MLP's input norm),
    "sandwich" (Gemma: post_attention_layernorm norms the attention output, pre_ / post_feedforward_
    layernorm the MLP's input and output) or "post" (OLMo2: the branches' outputs only, no
    input_layernorm)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layout, self.residual_scale = cfg.norm_layout, cfg.residual_scale
        if self.layout != "post":
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with ps.mlp_scope():
            if cfg.moe_layers and cfg.moe_layers[layer_id]:
                self.mlp = SharedExpertMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                           cfg.num_experts_per_tok, 0, router=cfg.moe_router,
                                           activation=moe_activation(cfg), expert_bias=cfg.moe_bias)
            else:
                self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos_sin, batch):
        if self.layout == "post":
            x = x + self.post_attention_layernorm(self.self_attn(x, cos_sin, batch))
            return x + self.post_feedforward_layernorm(run_mlp(self.mlp, x, batch))
        a = self.self_attn(self.input_layernorm(x), cos_sin, batch)
        if self.layout == "sandwich":
            x, h = self.pre_feedforward_layernorm.add_norm(self.post_attention_layernorm(a), x)
            return x + self.post_feedforward_layernorm(run_mlp(self.mlp, h, batch))
        if self.residual_scale != 1.0:        # Granite
            x, h = self.post_attention_layernorm.add_norm(x, a * self.residual_scale)
            return x + run_mlp(self.mlp, h, batch) * self.residual_scale
        x, h = self.post_attention_layernorm.add_norm(x, a)
        return x + run_mlp(self.mlp, h, batch)


class LlamaModel(DecoderStack):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale)
        self.layers = stage_layer_list(cfg.num_hidden_layers, lambda i: LlamaDecoderLayer(cfg, i))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: sliding-window layers rotate by their own base (unscaled)
        self.local_rotary = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta)
        self.windowed = [w is not None for w in cfg.layer_windows]
        self.rope_layers = cfg.rope_layers

    def layer_rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer: the global table's rows, a sliding layer's local ones (Gemma 3), None for a
        NoPE layer (SmolLM3)."""
        rope = self.rotary.cos_sin(positions)
        local = rope if self.local_rotary is None else self.local_rotary.cos_sin(positions)
        return [(local if w else rope) if r else None for w, r in zip(self.windowed, self.rope_layers)]


class LlamaForCausalLM(CausalLM):
    # checkpoint name fragment -> (fused parameter fragment, shard)
    stacked_params = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"),
                      ".v_proj.": (".qkv_proj.", "v"), ".gate_proj.": (".gate_up_proj.", "gate"),
                      ".up_proj.": (".gate_up_proj.", "up")}
    # the kernels convert on load (quantized pools: mem/kv_quant.py, dequantized as rows are read)
    KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn,
                       torch.float8_e5m2)
    DEVICES = ("cpu", "cuda")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, LlamaModel(cfg))
        self.native = NativeStep()

    def enable_native_step(self, on: bool) -> None:
        self.native.enabled = on

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                proxy: PPProxy | None = None) -> torch.Tensor | PPProxy:
        if proxy is None and self.native.applies(self, batch):
            return self.native.forward(self, input_ids, batch)
        return super().forward(input_ids, positions, batch, proxy)

    @staticmethod
    def tp_dims(cfg: ModelConfig) -> list[Dim]:
        """What splits over the tensor-parallel ranks (distributed/sharding.py checks them)."""
        h = cfg.num_attention_heads
        dims = [Dim("attention heads", h), Dim("KV heads", cfg.num_key_value_heads, serves=h)]
        if any(cfg.moe_layers):
            dims.insert(0, Dim("experts", cfg.num_experts, flag="--ep-size", mlp=True,
                                width=cfg.moe_intermediate_size))
        if not all(cfg.moe_layers):
            dims.append(Dim("MLP channels", cfg.intermediate_size, mlp=True))
        return dims

    # Pool contract (docs/design.md, contract 3): every model builds the pools its layers read, and says what
    # one token and one request row cost so the runtime can size them. Hybrid models add
    # request_row state; with full and windowed layers mixed, the windowed ones get slots of
    # their own (swa_slots, priced by pool_bytes_per_swa_token).
    def make_pool(self, num_slots: int, num_rows: int, swa_slots: int = 0) -> KVPool:
        c = self.config
        windows = split_windows(c.layer_windows) if swa_slots else None
        return KVPool(num_slots, c.num_hidden_layers, self._kv_heads(), c.head_dim, self.kv_dtype,
                      layers=self.layer_range, split=kv_split(c.num_key_value_heads),
                      window=uniform_window(c.layer_windows), swa_layers=windows[0] if windows else (),
                      swa_slots=swa_slots, swa_window=windows[1] if windows else None)

    def pool_bytes_per_token(self) -> int:
        """Per full slot: every layer's K/V, or only the full layers' when windowed layers have
        their own slots (pool_bytes_per_swa_token)."""
        c = self.config
        split = split_windows(c.layer_windows)
        n = len([i for i in self.layer_range if not split or i not in split[0]])
        return KVPool.bytes_per_token(n, self._kv_heads(), c.head_dim, self.kv_dtype)

    def pool_bytes_per_swa_token(self) -> int:
        c = self.config
        split = split_windows(c.layer_windows)
        if not split:
            return 0
        n = len([i for i in split[0] if i in self.layer_range])
        return KVPool.bytes_per_token(n, self._kv_heads(), c.head_dim, self.kv_dtype)

    def _kv_heads(self) -> int:
        """KV heads this rank keeps (all of them on one rank)."""
        return kv_heads_shard(self.config.num_key_value_heads)[2]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.native.reset()
        loader = WeightLoader(self, self.stacked_params)
        modules, filled = dict(self.named_modules()), {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")      # Mixtral
            if (parts := self._fused_parts(name)) is not None:     # Phi-3: q|k|v, gate|up in one tensor
                for (part, _), rows in zip(parts, split_rows(tensor, [n for _, n in parts])):
                    loader.load(part, rows)
                continue
            if self.config.norm_offset and name.endswith("norm.weight"):
                tensor = tensor + self.config.norm_offset             # Gemma: stored as w, used as 1 + w
            m = _EXPERT_TENSOR.fullmatch(name)
            if m:
                self._load_expert(modules[m[1]], m[1], _EXPERT_PART[m[3]], tensor,
                                  None if m[2] is None else int(m[2]), filled, loader)
                continue
            loader.load(name, tensor)
        if self.config.tie_word_embeddings:
            loader.mark_loaded("lm_head.weight", tied_to="model.embed_tokens.weight")
        loader.check_complete()

    def _fused_parts(self, name: str) -> list[tuple[str, int]] | None:
        """A checkpoint tensor holding q|k|v or gate|up in one (Phi-3's `qkv_proj`, `gate_up_proj`;
        llama.cpp's `attn_qkv`, phi3 `ffn_up`) as [(name of each part, its rows)], else None."""
        m = _FUSED_TENSOR.fullmatch(name)
        if m is None:
            return None
        c, (prefix, fused, kind) = self.config, m.groups()
        if fused == "self_attn.qkv_proj":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(f"{prefix}self_attn.{p}_proj.{kind}", n) for p, n in (("q", q), ("k", kv), ("v", kv))]
        return [(f"{prefix}mlp.{p}_proj.{kind}", c.intermediate_size) for p in ("gate", "up")]

    @staticmethod
    def _load_expert(experts, prefix: str, part: str, tensor: torch.Tensor, expert: int | None,
                     filled: dict[str, set], loader: WeightLoader) -> None:
        """One expert's gate / up / down (HF per-expert names), or every expert's (a stacked GGUF
        `ffn_*_exps`); a stacked parameter counts as loaded once every local expert has its parts."""
        if expert is not None and experts.local_index(expert) is None:
            return          # another expert-parallel rank's: not read
        param = "down_proj" if part == "down" else "gate_up_proj"
        got = filled.setdefault(f"{prefix}.{param}", set())
        blocks = blocks_of(tensor)
        if blocks is not None and expert is not None and experts.takes_blocks(blocks):
            got.update((i, part) for i in experts.load_blocks(part, blocks, expert))   # held quantized
            if experts.block_experts is not None:       # built with the last part
                for pname, _ in experts.block_experts.named_parameters():
                    loader.mark_loaded(f"{prefix}.block_experts.{pname}")
        else:
            got.update((i, part) for i in experts.load_part(part, values_of(tensor), expert))
        if len(got) == experts.local * (1 if part == "down" else 2):
            loader.mark_loaded(f"{prefix}.{param}")


_FUSED_TENSOR = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")
# Per-expert (`experts.N.w1`, `experts.N.gate_proj.weight`; older GGUFs' `blk.N.ffn_gate.E`) or stacked
# (GGUF `ffn_gate_exps` as `experts.gate_proj.weight`)
# expert tensors; transformers 5's stacked `experts.gate_up_proj` / `down_proj` load as parameters.
_EXPERT_TENSOR = re.compile(r"(.*\.mlp\.experts)\.(?:(\d+)\.)?(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}
