"""The routed experts of a quantized MoE layer for a few rows in one C++ call (kernels/moe_experts.cpp).

At decode and small batches the Python expert loop (moe.py grouped_experts: sort, count, gather,
one gate|up / activation / down per expert, index_add) costs ~30 small torch calls per layer, far
more than the two experts' arithmetic. When the experts are held as block Linears under int8
activations (Experts.load_blocks: a quantized GGUF served as `sparkserve serve` does), this path
hands the same block weights to one kernel call that groups the rows per expert and runs the same
block kernels (block_linear_int8), so the two differ only by fp32 rounding (activation, the order
of the weighted sum). Anything else (fp32 experts, fp32 activations, experts split by width,
an activation the kernel does not compute, many rows) stays on the Python path. The native step
(models/llama_native.py) runs the same kernel object for the MoE layers of Mixtral / Qwen3-MoE /
GPT-OSS, routing in C++ (`native_moe_unsupported` says when it can); experts held in fp32 (the exact
path, --activation-quant none) it runs as fp32 GEMMs on the parameters in place (`native_experts`),
what the Python path computes for them."""
from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch

from sparkserve.kernels.build import load_extension
from sparkserve.layers.activation import silu_and_mul, swiglu_oai

if TYPE_CHECKING:
    from sparkserve.layers.moe import Experts, MoEBlock

# Most tokens per call: decode and VERIFY-sized batches (as the native step's NATIVE_MAX_TOKENS);
# larger ones are prefill chunks, where per-expert GEMMs over many rows amortize the Python loop.
MAX_TOKENS = 64

# MoEExperts.kSiluMul / kSwigluOai
_SILU_MUL, _SWIGLU_OAI = 0, 1

# Experts -> (the first gate|up Linear's blocks the kernel object was made from, the object); None
# when this Experts cannot take the path.
_kernels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _activation_code(activation) -> tuple[int, float, float] | None:
    """The kernel's code (and alpha, limit) of the gated activation, or None if it has none."""
    if activation is silu_and_mul:
        return _SILU_MUL, 0.0, 0.0
    if isinstance(activation, functools.partial) and activation.func is swiglu_oai and not activation.args:
        kw = activation.keywords
        return _SWIGLU_OAI, float(kw["alpha"]), float(kw["limit"])
    return None


def _build(experts: Experts):
    """The kernel object over `experts`' block Linears, or None when the path does not apply."""
    ext = load_extension()
    code = _activation_code(experts.activation)
    if ext is None or code is None or experts.block_experts is None or experts.width_parts != 1:
        return None
    gate_up, down = [], []
    for gu_lin, down_lin in experts.block_experts:
        if gu_lin.activation_quant != "int8" or down_lin.activation_quant != "int8":
            return None
        gu, dn = gu_lin.inference_blocks(), down_lin.inference_blocks()
        if gu is None or dn is None or gu_lin.bias is not None or down_lin.bias is not None:
            return None
        gate_up.append(gu)
        down.append(dn)
    if len({b.qtype for b in gate_up}) != 1 or len({b.qtype for b in down}) != 1:
        return None
    def bias(p: torch.nn.Parameter | None) -> torch.Tensor | None:
        return None if p is None else p.detach().float().contiguous()
    return ext.MoEExperts([b.blocks for b in gate_up], [b.blocks for b in down], gate_up[0].qtype,
                          down[0].qtype, bias(experts.gate_up_proj_bias), bias(experts.down_proj_bias), *code)


def experts_kernel(experts: Experts):
    """The kernel object (ext.MoEExperts) over `experts`' block weights, made on first use and
    again when they change form; None when the path does not apply."""
    if experts.block_experts is None:
        return None
    first = experts.block_experts[0][0].inference_blocks()
    cached = _kernels.get(experts)
    if cached is None or cached[0] is not first:      # first use, or the blocks changed form / mode
        cached = (first, _build(experts))
        _kernels[experts] = cached
    return cached[1]


def decode_experts(experts: Experts, x: torch.Tensor, weights: torch.Tensor,
                   local_ids: torch.Tensor) -> torch.Tensor | None:
    """Experts.forward of x [T, d] (local_ids: this rank's expert index per (token, slot)) in one
    kernel call, or None when the Python path must run it."""
    if (x.shape[0] > MAX_TOKENS or x.dtype != torch.float32 or x.device.type != "cpu"
            or experts.block_experts is None or torch.is_grad_enabled()):
        return None
    kernel = experts_kernel(experts)
    return None if kernel is None else kernel.forward(x, weights.float(), local_ids, True)


def native_experts(experts: Experts):
    """The kernel object the native step runs `experts` with: their block weights' (experts_kernel),
    else over their fp32 parameters in place; None when neither applies."""
    kernel = experts_kernel(experts)
    if kernel is not None or experts.block_experts is not None or experts.width_parts != 1:
        return kernel
    ext, code = load_extension(), _activation_code(experts.activation)
    if ext is None or code is None:
        return None
    def bias(p: torch.nn.Parameter | None) -> torch.Tensor | None:
        return None if p is None else p.detach().float().contiguous()
    return ext.MoEExperts.dense(experts.gate_up_proj.detach(), experts.down_proj.detach(),
                                bias(experts.gate_up_proj_bias), bias(experts.down_proj_bias), *code)


# The routers the native step computes itself (kernels/native_llama.cpp route); sigmoid_grouped with
# one group and no scaling (MiniMax-M2's).
NATIVE_ROUTERS = ("softmax_topk", "softmax_topk_renorm", "topk_softmax", "sigmoid_grouped")


def native_moe_unsupported(block: MoEBlock) -> str | None:
    """Why the native step cannot run this MoE block (its router, its experts), or None."""
    if block.a2a:
        return "the all-to-all MoE backend is not in the native step"
    if block.shared_experts is not None:
        return "shared experts are not in the native step"
    if block.gate.rule not in NATIVE_ROUTERS:
        return f"the {block.gate.rule!r} MoE router is not in the native step"
    if block.gate.rule == "sigmoid_grouped" and (block.gate.num_groups > 1 or block.gate.scaling != 1.0):
        return "grouped or scaled sigmoid routing is not in the native step"
    if native_experts(block.experts) is None:
        return "a MoE layer's experts are neither block weights under int8 activations nor fp32 on one rank"
    return None
