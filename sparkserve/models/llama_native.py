"""When a Llama-family forward runs as one native call (kernels/native_llama.cpp), and how the
model's weights and KV pool are handed to it.

The native step covers what dominates serving on a CPU: decode, VERIFY blocks and small extends on
one rank, with every projection held as GGUF / half-precision blocks (the block kernel's inputs).
Anything else — prefill chunks, tensor / pipeline / context parallel, DP attention, autograd, fp32
weights without blocks — runs the Python layer path, which stays the reference the tests compare
against. The step reads the block weights once, when first used: `reset()` drops it after the
weights change, and a switch of the activation mode (which changes the blocks' form) rebuilds it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed import parallel_state as ps
from sparkserve.kernels.build import load_extension
from sparkserve.layers.linear import Linear
from sparkserve.layers.moe import SharedExpertMoE
from sparkserve.layers.moe_decode import native_experts, native_moe_unsupported
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.native_step import NativeStepBase

if TYPE_CHECKING:
    from sparkserve.models.llama import LlamaForCausalLM


class NativeStep(NativeStepBase):
    name = "native forward step"
    pool_type = KVPool

    def unsupported(self, model: LlamaForCausalLM) -> str | None:
        return unsupported(model)

    def build(self, model: LlamaForCausalLM):
        return build(model)

    def int8_activations(self, model: LlamaForCausalLM) -> bool:
        return _int8(model)

    def forward(self, model: LlamaForCausalLM, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        if pool is not self._pool:
            self._step.set_pool(pool.k, pool.v, pool.swa_layers)
            if pool.quantized:     # the step stores its K/V quantized and attends through the scales
                self._step.set_pool_scales(pool.k_scale, pool.v_scale)
            self._pool = pool
        x = model.model.embed_tokens(input_ids)
        aux = model.aux_layer_set
        if -1 in aux:
            batch.aux_hidden.append(x)
        out = self._step.forward(x, batch.positions, batch.out_cache_loc, batch.kv_indices, batch.kv_start,
                                 batch.swa_out_cache_loc, batch.swa_kv_indices, batch.swa_kv_start,
                                 batch.seq_lens, batch.extend_lens, sorted(i for i in aux if i >= 0),
                                 self._int8, True)
        batch.aux_hidden.extend(out[1:])
        return out[0]


def unsupported(model: LlamaForCausalLM) -> str | None:
    """Why this model cannot run natively, or None."""
    if load_extension() is None:
        return "the C++ kernels are unavailable"
    m = model.model
    if ps.tp_size() > 1 or not (model.first_stage and model.last_stage) or ps.mlp_gathers():
        return "it runs on several ranks"
    tables = [r for r in (m.rotary, m.local_rotary) if r is not None]
    if m.rotary is None or any(r.cos.device.type != "cpu" for r in tables):
        return "no CPU rotary table"
    if (beyond := beyond_native(model.config)) is not None:
        return beyond
    for layer in model.model.layers:
        if isinstance(layer.mlp, SharedExpertMoE) and (why := native_moe_unsupported(layer.mlp)) is not None:
            return why
        projs = _projections(layer)
        if any(lin.inference_blocks() is None for lin in projs):
            return "a projection has no block weights"
        if any(lin.bias is not None for lin in projs[2:]):
            return "an MLP projection has a bias"
    return None


def beyond_native(cfg: ModelConfig) -> str | None:
    """The first ModelConfig feature the native step (kernels/native_llama.cpp: pre-, sandwich or
    post norms, q/k norms per head or full-width, SiLU or GeGLU, a global and a local rope table,
    partial rotary, NoPE layers, an attention scale and soft-cap, attention sinks (the decode
    kernel's: not with a soft-cap), q|k|v and o biases, a residual scale; the embedding scale is the
    embedding module's, before the call) does not compute, or None."""
    features = {f"the {cfg.norm_layout!r} norm layout": cfg.norm_layout not in ("pre", "sandwich", "post"),
                f"the {cfg.activation} activation": cfg.activation not in _ACTIVATIONS,
                "attention sinks with a soft-cap": cfg.attn_sinks and bool(cfg.attn_softcap)}
    return next((f"{name} is not in the native step" for name, on in features.items() if on), None)


_ACTIVATIONS = ("silu", "gelu_tanh")


def _int8(model: LlamaForCausalLM) -> bool:
    """Whether the layers serve int8 activations (their blocks then held packed)."""
    return model.model.layers[0].self_attn.qkv_proj.activation_quant == "int8"


def _projections(layer: torch.nn.Module) -> list[Linear]:
    """q|k|v, o, gate|up, down of a decoder layer (a MoE layer: q|k|v, o)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SharedExpertMoE):
        return [attn.qkv_proj, attn.o_proj]
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


_NO_BLOCKS = torch.empty(0, dtype=torch.uint8)     # a MoE layer's dense MLP blocks (none)


def _set_moe(step, i: int, block: SharedExpertMoE) -> None:
    """Layer i's MLP as its experts' kernel object and its router (as moe.py Router computes it:
    softmax then top-k, GPT-OSS's biased top-k then softmax, or MiniMax-M2's sigmoid scores chosen
    with the correction bias)."""
    gate = block.gate
    if block.routed_tokens is None:     # the counts /metrics reads: the step adds to them in place
        block.routed_tokens = torch.zeros(block.experts.num_experts, dtype=torch.long)
    router = gate.weight.detach().float().contiguous()
    topk_softmax, sigmoid = gate.rule == "topk_softmax", gate.rule == "sigmoid_grouped"
    bias = (gate.bias if topk_softmax else gate.e_score_correction_bias if sigmoid else None)
    bias = None if bias is None else bias.detach().float().contiguous()
    renormalize = gate.renormalize if sigmoid else gate.rule == "softmax_topk_renorm"
    step.set_layer_moe(i, native_experts(block.experts), router, bias, gate.top_k, renormalize, topk_softmax,
                       block.routed_tokens, sigmoid)


def _input_norms(layer: torch.nn.Module, layout: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The attention's and the MLP's input norm weights (LlamaDecoderLayer's layouts; "post" has none)."""
    if layout == "post":
        return None, None
    mlp_norm = layer.pre_feedforward_layernorm if layout == "sandwich" else layer.post_attention_layernorm
    return _weight(layer.input_layernorm), _weight(mlp_norm)


def _weight(module: torch.nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module.weight.detach()


def build(model: LlamaForCausalLM):
    c, m = model.config, model.model
    ext = load_extension()
    step = ext.NativeLlama(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           c.intermediate_size, c.rms_norm_eps, m.rotary.cos, m.rotary.sin, _weight(m.norm))
    local = m.local_rotary
    # the Python layer applies the residual scale on pre-norm layers only (LlamaDecoderLayer)
    step.set_model_options(c.attn_scale or 0.0, c.attn_softcap or 0.0,
                           c.residual_scale if c.norm_layout == "pre" else 1.0,
                           None if local is None else local.cos, None if local is None else local.sin)
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        moe = isinstance(layer.mlp, SharedExpertMoE)
        qkv, o, *mlp = (lin.inference_blocks() for lin in _projections(layer))
        gate_up_blocks, gate_up_type, down_blocks, down_type = (_NO_BLOCKS, 0, _NO_BLOCKS, 0) if moe else \
            (mlp[0].blocks, mlp[0].qtype, mlp[1].blocks, mlp[1].qtype)
        qkv_bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach()
        opts = ext.NativeLayerOptions()
        opts.window, opts.gelu = attn.attn.window or 0, c.activation == "gelu_tanh"
        opts.rope = not c.rope_layers or c.rope_layers[i]
        opts.local_rope = local is not None and m.windowed[i]
        opts.qk_norm_full_width = c.qk_norm_full_width
        opts.o_bias = None if attn.o_proj.bias is None else attn.o_proj.bias.detach().float()
        opts.sinks = None if attn.sinks is None else attn.sinks.detach().float()
        input_norm, mlp_norm = _input_norms(layer, c.norm_layout)
        if c.norm_layout != "pre":       # the branches' outputs are normed before the residual adds
            opts.attn_out_norm = _weight(layer.post_attention_layernorm)
            opts.mlp_out_norm = _weight(layer.post_feedforward_layernorm)
        step.add_layer_with(qkv.blocks, qkv.qtype, qkv_bias, o.blocks, o.qtype, gate_up_blocks, gate_up_type,
                            down_blocks, down_type, input_norm, mlp_norm, _weight(attn.q_norm),
                            _weight(attn.k_norm), opts)
        if moe:
            _set_moe(step, i, layer.mlp)
    return step
