"""BlockWeight: a 2-D weight [N, K] kept in a GGUF block format, one row of blocks per output row.

Formats (ggml's, as gguf-py dequantizes them), 32 weights per block:
  Q4_0 (type 2), 18 bytes: fp16 d, 16 bytes of nibbles (as Q4_1's); w = d*(q - 8).
  Q4_1 (type 3), 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; low nibbles are elements 0..15,
                 high nibbles 16..31; w = d*q + m.
  Q8_0 (type 8), 34 bytes: fp16 d, 32 int8; w = d*q.
  BF16 (type 30), 64 bytes: 32 bf16 values; w = their fp32 widening.
  F16 (type 1),   64 bytes: 32 fp16 values; w = their fp32 widening (exact).
  Q6_S (114, sparkserve's own: GGUF Q6_K in blocks of 32, loader/gguf_int8.py), 28 bytes: fp16 d
                 (the super-block's), int8 scales of elements 0..15 and 16..31, 16 bytes of
                 low nibbles of u (as Q4_1's), 8 bytes of high bits (element 16c + 4k + j: byte
                 4c + j, bits 2k); w = (d * scale) * (u - 32), Q6_K's values exactly.
Row operations (q|k|v concatenation, llama.cpp's q/k rope permutation) act on whole block rows.

Served with int8 activations, Q4_0 / Q4_1 / Q8_0 / Q6_S weights (INT8_TYPES) are held in the
layout the int8 kernels read (`packed()`: Q4_0_X16 / ..., groups of 16 output rows,
kernels/int8_common.h) instead of the block one, as ggml's CPU backend repacks its weights: the
same bytes in another order, so the model's weights are held once. `unpacked()` gives the block
form back."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sparkserve.kernels.build import load_extension

Q4_0, Q4_1, Q8_0, BF16, F16, Q6_S = 2, 3, 8, 30, 1, 114
# packed for the int8 kernels (not GGUF types)
Q4_0_X16, Q4_1_X16, Q8_0_X16, Q6_S_X16 = 1002, 1003, 1008, 1114
PACKED_TYPE = {Q4_0: Q4_0_X16, Q4_1: Q4_1_X16, Q8_0: Q8_0_X16, Q6_S: Q6_S_X16}
INT8_TYPES = tuple(PACKED_TYPE)          # the block types the int8 kernels read
GGUF_TYPE = {v: k for k, v in PACKED_TYPE.items()}
PACK_ROWS = 16                           # output rows per packed group
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, BF16: 64, F16: 64, Q6_S: 28}
BLOCK_BYTES.update({p: BLOCK_BYTES[t] for p, t in GGUF_TYPE.items()})
_HALF_TYPES = {torch.bfloat16: BF16, torch.float16: F16}


@dataclass
class BlockWeight:
    qtype: int
    blocks: torch.Tensor        # uint8 [N, K // 32 * BLOCK_BYTES[qtype]], contiguous
    in_features: int            # K
    # The other form (packed <-> GGUF) while someone holds it, so that modules sharing one weight
    # (a tied LM head and embedding) share its other form too.
    _other: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)
    _dense: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported block type {self.qtype}")
        if self.in_features % 32:
            raise ValueError(f"K={self.in_features} is not a multiple of 32")
        want = self.in_features // 32 * BLOCK_BYTES[self.qtype]
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != want:
            raise ValueError(f"blocks {tuple(self.blocks.shape)} {self.blocks.dtype}: expected uint8 [N, "
                             f"{want}]")
        if self.is_packed and self.blocks.shape[0] % PACK_ROWS:
            raise ValueError(f"packed blocks hold whole groups of {PACK_ROWS} rows, not "
                             f"{self.blocks.shape[0]}")
        self.blocks = self.blocks.contiguous()

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def is_packed(self) -> bool:
        return self.qtype in GGUF_TYPE

    @property
    def gguf_type(self) -> int:
        """The GGUF type of the values (a packed weight's unpacked type)."""
        return GGUF_TYPE.get(self.qtype, self.qtype)

    def packed(self) -> "BlockWeight | None":
        """This weight in the int8 kernels' layout, or None where they do not read one: a type
        other than INT8_TYPES, rows not a multiple of 16 (those get a packed copy beside the
        blocks, kernels/int8_packed.cpp), or no int8 variant to run (unbuilt, or all switched off)."""
        if self.is_packed:
            return self
        ext = load_extension()
        if (self.qtype not in PACKED_TYPE or self.out_features % PACK_ROWS or ext is None
                or ext.int8_variant() == "fp32"):
            return None
        return self._other_form(lambda: BlockWeight(
            PACKED_TYPE[self.qtype], ext.pack_blocks(self.blocks, self.qtype), self.in_features))

    def unpacked(self) -> "BlockWeight":
        """This weight in GGUF order (itself unless packed)."""
        if not self.is_packed:
            return self
        return self._other_form(lambda: BlockWeight(
            self.gguf_type, load_extension().unpack_blocks(self.blocks, self.gguf_type), self.in_features))

    def dense_shared(self, wrap: Callable[[torch.Tensor], Any]) -> Any:
        """wrap(self.dequantize()), made once for every holder of these blocks while one of them keeps
        it: modules that share their blocks (a tied LM head and embedding) get one fp32 weight back."""
        dense = self._dense() if self._dense is not None else None
        if dense is None:
            dense = wrap(self.dequantize())
            self._dense = weakref.ref(dense)
        return dense

    def _other_form(self, make) -> "BlockWeight":
        other = self._other() if self._other is not None else None
        if other is None:
            other = make()
            self._other, other._other = weakref.ref(other), weakref.ref(self)
        return other

    @classmethod
    def supports(cls, qtype: int, shape: Sequence[int]) -> bool:
        """shape in torch order [N, K]."""
        return int(qtype) in BLOCK_BYTES and len(shape) == 2 and shape[1] % 32 == 0

    @classmethod
    def from_numpy(cls, qtype: int, data: np.ndarray, shape: Sequence[int]) -> "BlockWeight":
        """From a GGUF tensor's raw data (any dtype view of its bytes); shape [N, K]."""
        n, k = shape
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
        return cls(int(qtype), torch.from_numpy(raw.copy()), k)

    @classmethod
    def from_half(cls, w: torch.Tensor) -> "BlockWeight":
        """A 2-D bf16 or fp16 tensor, its values kept exactly (BF16 or F16 blocks)."""
        if w.dtype not in _HALF_TYPES or w.dim() != 2:
            raise ValueError("from_half needs a 2-D bfloat16 or float16 tensor")
        n, k = w.shape
        return cls(_HALF_TYPES[w.dtype], w.contiguous().view(torch.uint8).reshape(n, 2 * k).clone(), k)

    @classmethod
    def q8_0(cls, w: torch.Tensor) -> "BlockWeight":
        """Q8_0 blocks of a 2-D float tensor [N, K] (ggml's rounding, by gguf-py)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize
        data = quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0)
        return cls.from_numpy(Q8_0, data, tuple(w.shape))

    @staticmethod
    def half_type(t: torch.Tensor) -> int | None:
        """The block type that holds `t` exactly, if it is a half-precision 2-D tensor."""
        return _HALF_TYPES.get(t.dtype) if t.dim() == 2 else None

    def rows(self, index: torch.Tensor | np.ndarray) -> "BlockWeight":
        """The block rows `index` (a permutation or selection of output rows), in GGUF order."""
        if self.is_packed:
            return self.unpacked().rows(index)
        return BlockWeight(self.qtype, self.blocks[torch.as_tensor(index, dtype=torch.long)],
                           self.in_features)

    def cols(self, k0: int, k1: int) -> "BlockWeight | None":
        """Input columns k0..k1 (a row-parallel shard), in GGUF order; None unless both fall on
        block edges."""
        if k0 % 32 or k1 % 32:
            return None
        if self.is_packed:
            return self.unpacked().cols(k0, k1)
        width = BLOCK_BYTES[self.qtype]
        return BlockWeight(self.qtype, self.blocks[:, k0 // 32 * width:k1 // 32 * width], k1 - k0)

    @staticmethod
    def cat(parts: Sequence["BlockWeight | None"]) -> "BlockWeight | None":
        """Row concatenation (fused projections); None unless every part has the same format.
        Packed parts concatenate as they are: each one's rows are whole groups of 16."""
        if not parts or any(p is None for p in parts):
            return None
        first = parts[0]
        # type: ignore[union-attr]
        if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
            return None
        # type: ignore[union-attr]
        return BlockWeight(first.qtype, torch.cat([p.blocks for p in parts]), first.in_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], bit-identical to gguf-py's `dequantize` (reference for the kernels)."""
        if self.is_packed:
            return self.unpacked().dequantize()
        n, k = self.shape
        b = self.blocks.view(n, k // 32, BLOCK_BYTES[self.qtype])
        if self.qtype in (BF16, F16):
            half = torch.bfloat16 if self.qtype == BF16 else torch.float16
            return b.reshape(n, k, 2).contiguous().view(half).reshape(n, k).float()
        d = b[..., 0:2].contiguous().view(torch.float16).float()          # [n, nb, 1]
        if self.qtype == Q8_0:
            q = b[..., 2:].contiguous().view(torch.int8).float()
            return (q * d).reshape(n, k)
        if self.qtype == Q4_0:
            qs = b[..., 2:]
            q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float() - 8
            return (d * q).reshape(n, k)
        if self.qtype == Q6_S:
            u, scale = q6_s_ints(b)
            return ((d * scale.float()) * (u - 32).float()).reshape(n, k)
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()                # elements 0..15, 16..31
        return (d * q + m).reshape(n, k)


def q6_s_ints(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_S blocks [..., 28] -> u [..., 32] (0..63) and each element's int8 scale [..., 32]."""
    nib = b[..., 4:20]
    low = torch.cat([nib & 0x0F, nib >> 4], dim=-1)
    e = torch.arange(32)
    hbyte = b[..., 20:28][..., 4 * (e // 16) + e % 4]
    high = (hbyte >> (2 * (e % 16 // 4))) & 3
    scale = b[..., 2:4].contiguous().view(torch.int8)[..., e // 16]
    return low | (high << 4), scale
