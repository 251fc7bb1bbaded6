"""GGUF quant types the int8 kernels do not read, held in ones they do.

Most GGUF files people download are not Q4_0 / Q4_1 / Q8_0 throughout: a "Q4_K_M" file holds
Q4_K and Q6_K tensors, a "Q4_0" one Q4_0 layers beside a Q6_K or Q8_0 embedding. Dequantized to
fp32 those would take 5-7x their bytes and run on fp32 GEMV. Served with int8 activations they are
instead turned into blocks the int8 kernels read, once, at load:
- Q4_0 stays Q4_0, which they read too (and -> Q4_1, exactly, the same nibbles with m = -8 d,
  beside Q4_1 tensors in a fused projection).
- Q4_K -> Q4_1 per sub-block of 32: the same nibbles, d = d_K * scale and m = -dmin * min rounded
  to fp16, by at most 2^-11 of themselves: under 1/32 of d_K (dmin), the step Q4_K itself rounds
  its 6-bit scales (mins) to. A weight moves by at most 2^-11 (|w - m| + |m|).
- Q6_K -> Q6_S (kernels/blocks.py), exactly: the same 6-bit values and int8 scales of 16, in
  blocks of 32 that each repeat the super-block's d (7 bits a weight against Q6_K's 6.56 and
  Q8_0's 8.5).
- Q5_0 -> Q6_S, exactly: its 5-bit values plus 16, scales 1 (and -> Q8_0, exactly, its values
  minus 16 as int8, where a fused projection's other tensors go to Q8_0).
- MXFP4 (GPT-OSS's experts) -> Q8_0, exactly: its e2m1 values are the integers -12..12 times
  2^(e - 128), an fp16 d for every exponent a weight has (else requantized, below).
- anything else quantized (Q5_1, Q5_K, Q2_K, Q3_K, IQ*, ...) -> Q8_0, requantized from
  gguf-py's fp32 values: an 8-bit grid over values that had at most 6 bits.
The converted blocks are then the model's weights (their dequantization is the fp32 value
wherever one is kept), as for a file that held them. F32 / F16 / BF16 tensors are left to the
loader, which keeps them exact. `--activation-quant none` loads every tensor exactly instead."""
from __future__ import annotations

import gguf
import numpy as np

from sparkserve.kernels.blocks import BLOCK_BYTES, Q4_0, Q4_1, Q6_S, Q8_0, BlockWeight

Q4_K, Q5_0, Q6_K = (int(gguf.GGMLQuantizationType.Q4_K), int(gguf.GGMLQuantizationType.Q5_0),
                    int(gguf.GGMLQuantizationType.Q6_K))
MXFP4 = int(gguf.GGMLQuantizationType.MXFP4)
# ggml's MXFP4 element values, doubled to integers (its scale is then 2^(e - 128))
_MXFP4_INTS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_UNQUANTIZED = {int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16),
                int(gguf.GGMLQuantizationType.BF16), int(gguf.GGMLQuantizationType.F64)}


# The forms each quantized type is held in without changing its values (Q4_K: within fp16's
# rounding of its scales), smallest first. Any type can go to Q8_0, requantized where not listed.
_FORMS = {Q4_0: (Q4_0, Q4_1), Q4_1: (Q4_1,), Q4_K: (Q4_1,), Q5_0: (Q6_S, Q8_0), Q6_K: (Q6_S,),
          Q8_0: (Q8_0,)}


def _forms(qtype: int) -> tuple[int, ...]:
    return _FORMS.get(qtype, (Q8_0,))


def int8_form(qtype: int) -> int | None:
    """The int8 kernels' block type a GGUF tensor of `qtype` is held in; None for one kept as it
    is (a type they read, or an unquantized one)."""
    if qtype in _UNQUANTIZED or _forms(qtype)[0] == qtype:
        return None
    return _forms(qtype)[0]


def type_name(qtype: int) -> str:
    """A GGUF type's name, or a form's that is not one (Q6_S)."""
    return "Q6_S" if qtype == Q6_S else gguf.GGMLQuantizationType(qtype).name


def group_form(qtypes: list[int]) -> int | None:
    """One form for tensors fused into one projection (q|k|v, gate|up), which the kernels run as
    one block weight of one type: the smallest form that holds each of them as its own does, else
    Q8_0. None when one of them is unquantized (the fused weight then stays fp32, exact)."""
    if any(t in _UNQUANTIZED for t in qtypes):
        return None
    common = set.intersection(*(set(_forms(t)) for t in qtypes))
    return min(common, key=BLOCK_BYTES.__getitem__) if common else Q8_0


def int8_blocks(qtype: int, data: np.ndarray, shape: tuple[int, int], form: int) -> BlockWeight:
    """A 2-D GGUF tensor (`data`: its raw bytes, torch-order `shape` [N, K]) as `form` blocks."""
    n, k = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
    if form == qtype:
        return BlockWeight.from_numpy(qtype, raw, shape)
    if form == Q4_1 and qtype in (Q4_0, Q4_K):
        converted = _q4_0_as_q4_1(raw) if qtype == Q4_0 else _q4_k_as_q4_1(raw)
        if converted is not None:
            return BlockWeight.from_numpy(Q4_1, converted, shape)
    if form == Q8_0 and qtype == MXFP4 and (converted := _mxfp4_as_q8_0(raw)) is not None:
        return BlockWeight.from_numpy(Q8_0, converted, shape)
    if form == Q8_0 and qtype == Q5_0:
        return BlockWeight.from_numpy(Q8_0, _q5_0_as_q8_0(raw), shape)
    if form == Q6_S and qtype in (Q5_0, Q6_K):
        converted = _q5_0_as_q6_s(raw) if qtype == Q5_0 else _q6_k_as_q6_s(raw)
        return BlockWeight.from_numpy(Q6_S, converted, shape)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(n, k)
    return BlockWeight.from_numpy(Q8_0, gguf.quants.quantize(
        np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0), shape)


def _q4_1(d: np.ndarray, m: np.ndarray, nibbles: np.ndarray) -> np.ndarray | None:
    """Q4_1 bytes [..., 20] from d, m [...] rounded to fp16 and the 16 nibble bytes of each block
    [..., 16]; None where d or m overflows fp16 (the caller then requantizes to Q8_0)."""
    with np.errstate(over="ignore"):
        d16, m16 = d.astype(np.float16), m.astype(np.float16)
    if not (np.isfinite(d16).all() and np.isfinite(m16).all()):
        return None
    return np.concatenate([d16[..., None].view(np.uint8), m16[..., None].view(np.uint8), nibbles], axis=-1)


def _q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """Q4_0 (fp16 d, 16 nibble bytes; w = d (q - 8)) rows as Q4_1 rows: w = d q + (-8 d), exact
    (a power-of-two multiple of an fp16)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 18)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = _q4_1(d, -8 * d, b[..., 2:])
    return None if q is None else q.reshape(n, -1)


def _q5_0_values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 rows (fp16 d, 32 high bits, 16 nibble bytes; w = d (q - 16)) -> the d bytes [n, nb, 2]
    and q [n, nb, 32] (0..31)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 22)
    high = (b[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1     # [n, nb, 32]
    low = np.concatenate([b[..., 6:] & 0x0F, b[..., 6:] >> 4], axis=-1)              # elements 0..15, 16..31
    return b[..., :2], low | (high.astype(np.uint8) << 4)


def _mxfp4_as_q8_0(raw: np.ndarray) -> np.ndarray | None:
    """MXFP4 rows (e8m0 exponent e, 16 nibble bytes: elements 0..15 low, 16..31 high) as Q8_0 rows:
    d = 2^(e - 128) and the element's doubled value; None where a d falls outside fp16."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 17)
    exponent = b[..., 0].astype(np.int32) - 128
    if exponent.min() < -24 or exponent.max() > 15:
        return None
    d = np.ldexp(np.float32(1), exponent).astype(np.float16)
    q = _MXFP4_INTS[np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)]
    return np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1).reshape(n, -1)


def _q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows as Q8_0 rows (fp16 d, 32 int8; w = d q): the same d, q - 16 as the int8 value."""
    d, q = _q5_0_values(raw)
    q8 = (q.astype(np.int16) - 16).astype(np.int8)
    return np.concatenate([d, q8.view(np.uint8)], axis=-1).reshape(raw.shape[0], -1)


def _q5_0_as_q6_s(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows as Q6_S rows: the same d, scales 1, u = q + 16 (w = d (u - 32))."""
    d, q = _q5_0_values(raw)
    ones = np.ones((*q.shape[:-1], 2), dtype=np.uint8)
    return _q6_s(d, ones, q + 16).reshape(raw.shape[0], -1)


def _q6_s(d: np.ndarray, scales: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Q6_S blocks [..., 28] from the fp16 d bytes [..., 2], the int8 scale bytes [..., 2] and u
    [..., 32] (0..63); in the high bytes, bits 2k of byte 4c + j hold element 16c + 4k + j's."""
    nibbles = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)
    pairs = (u >> 4).reshape(*u.shape[:-1], 2, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    high = np.bitwise_or.reduce(pairs, axis=-2).reshape(*u.shape[:-1], 8)
    return np.concatenate([d, scales, nibbles, high], axis=-1).astype(np.uint8)


def _q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """Q4_K rows (super-blocks of 256: fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 nibble
    bytes; w = d sc_j q - dmin mn_j over sub-block j of 32) as Q4_1 rows (None: see _q4_1). A
    product of an fp16 and a 6-bit integer rounds to fp16 by at most 2^-11 of itself where it is
    normal, and not at all where the fp16 is subnormal (it stays on the subnormal grid)."""
    n = raw.shape[0]
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)                # [S, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])                     # [S, 8] each
    scale, offset = d * sc.astype(np.float32), -dmin * mn.astype(np.float32)
    # Sub-block 2c holds the low nibbles of bytes 32c .. 32c+31, sub-block 2c+1 their high ones;
    # a Q4_1 block holds elements i and i+16 in the low and high nibble of its byte i.
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)
    q4_1 = _q4_1(scale, offset, q[..., :16] | (q[..., 16:] << 4))
    return None if q4_1 is None else q4_1.reshape(n, -1)


def _q6_k_as_q6_s(raw: np.ndarray) -> np.ndarray:
    """Q6_K rows (super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales of 16 elements, fp16 d; w = d sc_i (u - 32)) as Q6_S rows, exact: per sub-block j of 32
    the same d, scales 2j and 2j + 1, and the same u."""
    n = raw.shape[0]
    b = raw.reshape(-1, 210)
    s = b.shape[0]
    # gguf-py's Q6_K element order: low nibbles of bytes h*64 + i are elements 128h + i (low) and
    # 128h + 64 + i (high); bits 2t of qh byte h*32 + i belong to element 128h + 32t + i.
    shifts = np.arange(0, 8, 2, dtype=np.uint8)
    low = (b[:, :128].reshape(s, 2, 1, 64) >> shifts[[0, 2]].reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(s, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 3
    u = (low.reshape(s, 256) | (high.reshape(s, 256) << 4)).reshape(s, 8, 32)
    d = np.broadcast_to(b[:, 208:210].reshape(s, 1, 2), (s, 8, 2))
    return _q6_s(d, b[:, 192:208].reshape(s, 8, 2), u).reshape(n, -1)
