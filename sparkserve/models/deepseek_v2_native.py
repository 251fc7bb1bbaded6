"""When a DeepSeek-V2 forward runs as one native call (kernels/native_mla.cpp), and how the model's
weights and latent pool are handed to it.

As the Llama family's native step (models/llama_native.py): decode, VERIFY and small extends on
one rank run every layer in C++ — MLA the absorbed way over the latent pool read in place, the
dense first layers, the MoE layers' routing (softmax, greedy or group-limited) with their routed
and shared experts — where the Python layer path spends most of a decode step between ~40 small
torch calls per layer. Projections run on their blocks (int8 activations under
--activation-quant int8) or, where a layer holds none (a width that is not whole blocks, an fp32
checkpoint), on their fp32 weight; routed experts on the MoE kernel's blocks
(layers/moe_decode.py) or their fp32 stacks; a quantized latent pool (--kv-cache-dtype int8 / fp8)
is stored and read as the layers store and read it (mem/kv_quant.py). Anything else — prefill
chunks, several ranks (TP, PP, EP, DP attention, context parallel), autograd — runs the Python
path, which stays the reference the tests compare against."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed import parallel_state as ps
from sparkserve.kernels.build import load_extension
from sparkserve.layers.linear import Linear
from sparkserve.layers.moe import GatedMLP, SharedExpertMoE
from sparkserve.layers.moe_decode import experts_kernel
from sparkserve.mem.hybrid_pool import HybridPool
from sparkserve.mem.kv_quant import is_quantized, scale_component
from sparkserve.models.native_step import NativeStepBase

if TYPE_CHECKING:
    from sparkserve.models.deepseek_v2 import DeepseekV2ForCausalLM

_FP32 = -1      # NativeMLA's projection type for an fp32 weight [n, k]
_SILU_MUL = 0   # MoEExperts.kSiluMul


class NativeMLAStep(NativeStepBase):
    name = "native MLA step"
    pool_type = HybridPool

    def unsupported(self, model: DeepseekV2ForCausalLM) -> str | None:
        return unsupported(model)

    def build(self, model: DeepseekV2ForCausalLM):
        return build(model)

    def int8_activations(self, model: DeepseekV2ForCausalLM) -> bool:
        return _int8(model)

    def forward(self, model: DeepseekV2ForCausalLM, input_ids: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        if pool is not self._pool:      # a quantized latent (--kv-cache-dtype int8 / fp8) with its scales
            latents = [pool.get("kv_latent", i) for i in model.layer_range]
            dtype = latents[0].dtype
            scales = ([pool.get(scale_component("kv_latent", dtype), i) for i in model.layer_range]
                      if is_quantized(dtype) else None)
            self._step.set_pool(latents, scales)
            self._pool = pool
        x = model.model.embed_tokens(input_ids)
        aux = model.aux_layer_set
        if -1 in aux:
            batch.aux_hidden.append(x)
        out_loc, kv_indices, kv_start = batch.kv_view(None)
        out = self._step.forward(x, batch.positions, out_loc, kv_indices, kv_start, batch.seq_lens,
                                 batch.extend_lens, sorted(i for i in aux if i >= 0), self._int8)
        batch.aux_hidden.extend(out[1:])
        return out[0]


def unsupported(model: DeepseekV2ForCausalLM) -> str | None:
    """Why this model cannot run natively, or None."""
    if load_extension() is None:
        return "the C++ kernels are unavailable"
    m = model.model
    if (ps.tp_size() > 1 or ps.ep_size() > 1 or not (model.first_stage and model.last_stage)
            or ps.mlp_gathers()):
        return "it runs on several ranks"
    if m.rotary.cos.device.type != "cpu":
        return "no CPU rotary table"
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projs = [attn.q_a_proj, attn.q_b_proj] if attn.q_lora else [attn.q_proj]
        if any(_proj(lin) is None for lin in [*projs, attn.kv_a_proj_with_mqa, attn.o_proj]):
            return "a projection has neither blocks nor an fp32 weight"
        if isinstance(mlp, SharedExpertMoE):
            if mlp.a2a:
                return "the all-to-all MoE backend is not in the native step"
            if mlp.gate.rule != "softmax_greedy":
                return f"the {mlp.gate.rule!r} MoE router is not in the native MLA step"
            if _routed(mlp) is None:
                return "a MoE layer's experts are neither the MoE kernel's blocks nor fp32"
            if mlp.shared_experts is not None and _gated(mlp.shared_experts) is None:
                return "the shared experts' gate|up and down are neither both blocks nor both fp32"
        elif _gated(mlp) is None:
            return "a dense MLP's gate|up and down are neither both blocks nor both fp32"
    return None


def _int8(model: DeepseekV2ForCausalLM) -> bool:
    """Whether the layers serve int8 activations."""
    return model.model.layers[0].self_attn.kv_a_proj_with_mqa.activation_quant == "int8"


def _proj(lin: Linear) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """(blocks, their type) or (fp32 weight, _FP32), and the fp32 bias; None when the Linear holds
    neither (its fp32 weight dropped and its blocks stale)."""
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    blocks = lin.inference_blocks()
    if blocks is not None:
        return blocks.blocks, blocks.qtype, bias
    w = lin.weight
    return None if w.is_meta else (w.detach().float().contiguous(), _FP32, bias)


def _gated(mlp: GatedMLP):
    """A dense SwiGLU MLP as NativeExperts (one expert): the MoE kernel over its two block weights,
    or its fp32 weights; None when one has blocks and the other not."""
    gu, down = _proj(mlp.gate_up_proj), _proj(mlp.down_proj)
    if gu is None or down is None or gu[2] is not None or down[2] is not None:
        return None
    ext = load_extension()
    if gu[1] == _FP32 and down[1] == _FP32:
        return ext.NativeExperts(None, gu[0].unsqueeze(0), down[0].unsqueeze(0))
    if gu[1] == _FP32 or down[1] == _FP32:
        return None
    kernel = ext.MoEExperts([gu[0]], [down[0]], gu[1], down[1], None, None, _SILU_MUL, 0.0, 0.0)
    return ext.NativeExperts(kernel, None, None)


def _routed(block: SharedExpertMoE):
    """The routed experts as NativeExperts, or None (experts split by width or over ranks, biases,
    blocks the MoE kernel does not take)."""
    ex = block.experts
    if ex.width_parts != 1 or ex.local != ex.num_experts or ex.gate_up_proj_bias is not None:
        return None
    ext = load_extension()
    if ex.block_experts is not None:
        kernel = experts_kernel(ex)
        return None if kernel is None else ext.NativeExperts(kernel, None, None)
    if ex.gate_up_proj.is_meta:
        return None
    return ext.NativeExperts(None, ex.gate_up_proj.detach().float(), ex.down_proj.detach().float())


def _weight(module: torch.nn.Module) -> torch.Tensor:
    return module.weight.detach().float().contiguous()


def _layer_weights(ext, layer: torch.nn.Module):
    """kv_b as the layer holds it (layers/mla.py AbsorbedKvB), handed over without a copy: the fp32
    weight, or a GGUF's split halves' blocks."""
    attn = layer.self_attn
    w = ext.MLALayerWeights()
    w.input_norm, w.mlp_norm = _weight(layer.input_layernorm), _weight(layer.post_attention_layernorm)
    if attn.q_lora:
        w.q_a, w.q_a_type, w.q_a_bias = _proj(attn.q_a_proj)
        w.q_a_norm, w.q_a_eps = _weight(attn.q_a_layernorm), attn.q_a_layernorm.eps
        w.q, w.q_type, _ = _proj(attn.q_b_proj)
    else:
        w.q, w.q_type, _ = _proj(attn.q_proj)
    w.kv_a, w.kv_a_type, w.kv_a_bias = _proj(attn.kv_a_proj_with_mqa)
    w.kv_a_norm, w.kv_a_eps = _weight(attn.kv_a_layernorm), attn.kv_a_layernorm.eps
    kv_b = attn.kv_b_proj
    if kv_b.k_b is not None:
        w.k_b, w.k_b_type = kv_b.k_b.blocks, kv_b.k_b.qtype
        w.v_b, w.v_b_type = kv_b.v_b.blocks, kv_b.v_b.qtype
    else:
        w.kv_b = _weight(kv_b)
    w.o, w.o_type, w.o_bias = _proj(attn.o_proj)
    return w


def build(model: DeepseekV2ForCausalLM):
    c, m, a = model.config, model.model, model.args
    ext = load_extension()
    attn0 = m.layers[0].self_attn
    step = ext.NativeMLA(c.hidden_size, attn0.h, a.q_lora_rank or 0, a.kv_lora_rank, a.nope_dim, a.rope_dim,
                         a.v_dim, c.rms_norm_eps, attn0.scale, m.rotary.cos, m.rotary.sin, _weight(m.norm))
    for i, layer in enumerate(m.layers):
        step.add_layer(_layer_weights(ext, layer))
        mlp = layer.mlp
        if not isinstance(mlp, SharedExpertMoE):
            step.set_dense_mlp(i, _gated(mlp))
            continue
        gate = mlp.gate
        if mlp.routed_tokens is None:     # the counts /metrics reads: the step adds to them in place
            mlp.routed_tokens = torch.zeros(mlp.experts.num_experts, dtype=torch.long)
        shared = None if mlp.shared_experts is None else _gated(mlp.shared_experts)
        step.set_moe(i, _routed(mlp), shared, gate.weight.detach().float().contiguous(), gate.top_k,
                     gate.num_groups, gate.topk_groups, gate.scaling, mlp.routed_tokens)
    return step
