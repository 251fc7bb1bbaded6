"""Gated activations on a fused gate|up projection output (gate half first, then up)."""
import torch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# ModelConfig.activation -> the GLU a dense MLP applies
GLUS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Clamped SwiGLU-OAI (MiniMax / GPT-OSS; halves not interleaved):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), with g = min(gate, limit)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * gate * torch.sigmoid(gate * alpha)
