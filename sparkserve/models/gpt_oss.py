"""GPT-OSS: the Llama decoder with q/k/v and o biases, attention sinks, alternating 128-token
window and full layers and YaRN rope (all ModelConfig fields, config.py FAMILY_TRAITS), and a MoE
of every layer: a biased router's top-k logits softmaxed, experts with biases and the clamped
SwiGLU. What this class adds is how the checkpoint stores its experts: transposed ([E, in, out]),
gate and up interleaved column by column, and in the released checkpoints as MXFP4 (`*_blocks`:
two 4-bit e2m1 values a byte, `*_scales`: a power-of-two exponent per 32), dequantized here."""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from sparkserve.models.llama import LlamaForCausalLM

# e2m1: sign, 2 exponent bits, 1 mantissa bit (the OCP microscaling FP4 element)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4 = re.compile(r"(.*\.experts\.(?:gate_up|down)_proj)_(blocks|scales)")
_GGUF_EXPERT_BIAS = re.compile(r"(.*\.experts)\.(gate|up|down)_proj\.bias")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., rows, G, 16] and e8m0 scales [..., rows, G] -> fp32 [..., rows, G * 32]
    (the low nibble of a byte first)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2)


class GptOssForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._as_ours(weights))

    @staticmethod
    def _as_ours(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under this model's names and layouts: the router as the MoE's `gate`,
        experts [E, out, in] with gate rows before up rows, MXFP4 pairs dequantized; a GGUF file's
        sinks, and its experts' biases (gate and up apart) as one."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in weights:
            if (m := _MXFP4.fullmatch(name)) is not None:
                pair = pending.setdefault(m[1], {})
                pair[m[2]] = t
                if len(pair) < 2:
                    continue
                name, t = m[1], dequantize_mxfp4(pair["blocks"], pair["scales"]).transpose(1, 2)
                del pending[m[1]]
            name = name.replace(".mlp.router.", ".mlp.gate.")
            name = name.replace(".self_attn.sinks.weight", ".self_attn.sinks")
            if (m := _GGUF_EXPERT_BIAS.fullmatch(name)) is not None:      # a GGUF file's, apart
                if m[2] == "down":
                    yield f"{m[1]}.down_proj_bias", t
                    continue
                biases = pending.setdefault(f"{m[1]}.gate_up_proj_bias", {})
                biases[m[2]] = t
                if len(biases) == 2:
                    yield f"{m[1]}.gate_up_proj_bias", torch.cat([biases["gate"], biases["up"]], dim=1)
                    del pending[f"{m[1]}.gate_up_proj_bias"]
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                t = t.transpose(1, 2).contiguous()      # [E, in, out] -> [E, out, in]
            if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
                t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)      # interleaved -> gate rows, then up
            yield name, t
        if pending:
            raise ValueError(f"checkpoint has tensors without their pair (MXFP4 blocks / scales, gate / up "
                             f"biases): {sorted(pending)}")
