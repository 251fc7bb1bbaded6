"""Quantized KV pools (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2, mem/kv_quant.py) in the attention
kernels and PagedAttention.

The decode and prefill kernels read the int8 / fp8 elements and their float16 block scales in place:
per variant (avx512 where the CPU runs it, avx2) they must give, bit for bit, what they give on
the dequantized values held as float32 (the scaling is exact, so any misread scale, block or
element shows), and stay within a stated tolerance of attention over the original float32 K/V
(decode, VERIFY blocks, windows, contexts past a key chunk; prefill chunks after a cached prefix).
The quantization itself is checked against its definition (llama.cpp's q8_0: a float16 scale
amax / qmax per block of 32, errors within half a step), and PagedAttention stores quantized rows and
gives through the kernels what its torch path (gather, dequantize, SDPA) gives."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from attention_fixtures import last_tokens_batch

from sparkserve import kernels
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.layers import attention as attention_mod
from sparkserve.layers.attention import PagedAttention
from sparkserve.mem.kv_pool import KVPool
from sparkserve.mem.kv_quant import QUANT_KV_DTYPES, block_size, dequantize, quantize

# Largest |output - output over float32 K/V| allowed, unit-normal K/V and queries at head dim 64:
# the error of a dequantized value is at most half an int8 step (amax / 254 of its block, ~0.01
# for N(0, 1) values), 1/16 of the value for e4m3 (3 mantissa bits), 1/8 for e5m2 (2); an output
# averages such errors over its keys, so a window of 5-7 keys shows the most.
TOLERANCE = {"int8": 0.03, "fp8_e4m3": 0.2, "fp8_e5m2": 0.4}
VARIANTS = ["avx512", "avx2"]


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SPARKSERVE_DISABLE_KERNELS", "") not in ("", "0"):
        pytest.fail("SPARKSERVE_DISABLE_KERNELS is set: these tests check the kernels themselves")
    assert kernels.available(), "kernel build failed (see the logged warning)"
    return kernels.load_extension()


def decode_variant(ext, variant: str) -> str:
    if variant not in ext.decode_attention_variants():
        pytest.skip(f"this CPU does not run the {variant} decode attention")
    return variant


def prefill_variant(ext, variant: str) -> str:
    if variant not in ext.prefill_attention_variants():
        pytest.skip(f"this CPU does not run the {variant} prefill tiles")
    return variant


@pytest.mark.parametrize("name", list(QUANT_KV_DTYPES))
@pytest.mark.parametrize("D", [64, 48, 16])
def test_quantize_is_q8_0_per_block(name, D):
    """A float16 scale amax / qmax per block of 32 (the whole row when the head dim is not a multiple
    of 32), each value within half a step (int8) or the element type's rounding (fp8) of its
    dequantized value; all-zero blocks stay zero."""
    dtype = QUANT_KV_DTYPES[name]
    g = torch.Generator().manual_seed(D)
    x = torch.randn(50, 3, D, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7] = 0
    q, d = quantize(x, dtype)
    qb = block_size(D)
    assert qb == (32 if D % 32 == 0 else D)
    assert q.dtype == dtype and q.shape == x.shape
    assert d.dtype == torch.float16 and d.shape == (50, 3, D // qb)
    blocks = x.reshape(50, 3, D // qb, qb)
    qmax = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 448.0}[name]     # e5m2: kv_quant.py _QMAX
    assert torch.equal(d, (blocks.abs().amax(-1) / qmax).half())
    err = (dequantize(q, d) - x).reshape(blocks.shape).abs()
    if name == "int8":
        assert (err <= d.float()[..., None] * 0.5 + 1e-12).all()
        assert q.abs().max() <= 127
    else:
        rel = {"fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}[name]
        # relative to the value, or half the smallest subnormal step of the scaled format
        floor = d.float()[..., None] * (2 ** -10 if name == "fp8_e4m3" else 2 ** -17)
        assert d[torch.arange(50) != 7].min() > 0          # no scale under float16's range
        assert (err <= blocks.abs() * rel + floor + 1e-12).all()
    assert not dequantize(q, d)[7].any()


def random_pool(g: torch.Generator, slots: int, Hkv: int, D: int):
    k = torch.randn(slots, Hkv, D, generator=g)
    v = torch.randn(slots, Hkv, D, generator=g)
    return k, v


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(QUANT_KV_DTYPES))
def test_decode_kernel_reads_the_quantized_pool(ext, variant, name):
    variant = decode_variant(ext, variant)
    dtype = QUANT_KV_DTYPES[name]
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, L = 9, 3, 64, 600
    k, v = random_pool(g, L + 1, Hkv, D)
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(16, H, D, generator=g)
    # decode, VERIFY blocks, windows, a context past the 256-key chunks
    for seq, n, window in ((L, 1, 0), (L, 16, 0), (300, 8, 0), (40, 5, 7), (L, 3, 200), (9, 1, 0)):
        args = (kv_indices, [seq], 0, window, D ** -0.5, [n], variant)
        got = ext.decode_attention(q[:n], kq, vq, *args, k_scale=ks, v_scale=vs)
        assert torch.equal(got, ext.decode_attention(q[:n], kd, vd, *args)), (seq, n, window)
        err = (got - ext.decode_attention(q[:n], k, v, *args)).abs().max().item()
        assert err <= TOLERANCE[name], (seq, n, window, err)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        ext.decode_attention(q[:1], kq, vq, kv_indices, [L], 0, 0, D ** -0.5, [], variant)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float16 \[slots, Hkv, 2\]"):
        ext.decode_attention(q[:1], kq, vq, kv_indices, [L], 0, 0, D ** -0.5, [], variant,
                             k_scale=ks.float(), v_scale=vs)


# (the avx512 form takes head dims that are multiples of 16 only)
@pytest.mark.parametrize("variant,D", [(v, 32) for v in VARIANTS]
                         + [(v, 40) for v in VARIANTS if v != "avx512"])
def test_decode_kernel_odd_head_dims(ext, variant, D):
    """Head dims whose scale blocks are not 32 wide (40: one scale per row) or narrower than a zmm
    chunk form (the avx2 form takes D = 40)."""
    variant = decode_variant(ext, variant)
    g = torch.Generator().manual_seed(D)
    k, v = random_pool(g, 101, 2, D)
    (kq, ks), (vq, vs) = quantize(k, torch.int8), quantize(v, torch.int8)
    kv_indices = (1 + torch.randperm(100, generator=g))[None]
    q = torch.randn(4, 4, D, generator=g)
    args = (kv_indices, [100], 0, 0, D ** -0.5, [4], variant)
    got = ext.decode_attention(q, kq, vq, *args, k_scale=ks, v_scale=vs)
    assert torch.equal(got, ext.decode_attention(q, dequantize(kq, ks), dequantize(vq, vs), *args))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(QUANT_KV_DTYPES))
def test_prefill_kernel_reads_the_quantized_pool(ext, variant, name):
    variant = prefill_variant(ext, variant)
    dtype = QUANT_KV_DTYPES[name]
    g = torch.Generator().manual_seed(5)
    H, Hkv, D = 9, 3, 64
    q_lens, prefixes = [300, 20, 70], [200, 0, 33]           # fresh prompts and chunks after a prefix
    seq_lens = [n + p for n, p in zip(q_lens, prefixes)]
    lmax, slots = max(seq_lens), 1 + 3 * max(seq_lens)
    k, v = random_pool(g, slots, Hkv, D)
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    perm = 1 + torch.randperm(slots - 1, generator=g)[:3 * lmax].view(3, lmax)
    valid = torch.arange(lmax)[None, :] < torch.tensor(seq_lens)[:, None]
    kv_indices = torch.where(valid, perm, torch.zeros((), dtype=torch.long))
    q = torch.randn(sum(q_lens), H, D, generator=g)
    for window in (0, 7, 64):
        args = (kv_indices, seq_lens, 0, window, D ** -0.5, q_lens, variant)
        got = ext.prefill_attention(q, kq, vq, *args, k_scale=ks, v_scale=vs)
        assert torch.equal(got, ext.prefill_attention(q, kd, vd, *args)), window
        err = (got - ext.prefill_attention(q, k, v, *args)).abs().max().item()
        assert err <= TOLERANCE[name], (window, err)


def quantized_pool(g, seq_lens: list[int], Hkv: int, D: int, dtype: torch.dtype, slots: int = 400):
    """A one-layer pool of quantized random rows, a float32 pool of the same original values, and a
    token table giving each request scattered slots."""
    B, lmax = len(seq_lens), max(seq_lens)
    pool, ref = KVPool(slots, 1, Hkv, D, dtype), KVPool(slots, 1, Hkv, D)
    ref.k[0].normal_(generator=g)
    ref.v[0].normal_(generator=g)
    pool.k[0][:], pool.k_scale[0][:] = quantize(ref.k[0], dtype)
    pool.v[0][:], pool.v_scale[0][:] = quantize(ref.v[0], dtype)
    table = torch.zeros(B, lmax, dtype=torch.long)
    free = 1 + torch.randperm(slots - 1, generator=g)
    for b, n in enumerate(seq_lens):
        table[b, :n] = free[b * lmax:b * lmax + n]
    return pool, ref, table


@pytest.mark.parametrize("name", list(QUANT_KV_DTYPES))
@pytest.mark.parametrize("mode,q_lens", [(ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [60, 1, 40])])
def test_paged_attention_stores_and_reads_quantized_rows(ext, monkeypatch, name, mode, q_lens):
    """PagedAttention on a quantized pool: the new K/V rows are stored quantized with their scales
    (what quantize gives), the kernels' result equals its torch path's (gathered rows dequantized,
    SDPA) and stays within the tolerance of a float32 pool holding the original values; windowed and
    not, decode and a prefill batch with a decode riding along."""
    dtype = QUANT_KV_DTYPES[name]
    g = torch.Generator().manual_seed(21)
    H, Hkv, D = 9, 3, 64
    seq_lens = [60, 25, 90]
    pool, ref_pool, table = quantized_pool(g, seq_lens, Hkv, D, dtype)
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    for window in (None, 20):
        batch = last_tokens_batch(mode, seq_lens, q_lens, table, pool)
        attn = PagedAttention(0, H, Hkv, D, window)
        with torch.inference_mode():
            monkeypatch.setattr(attention_mod, "load_extension", lambda: ext)
            out = attn(q, k, v, batch)
            wide = attn(q, k, v, last_tokens_batch(mode, seq_lens, q_lens, table, ref_pool))
            monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
            torch_path = attn(q, k, v, batch)
        want_k, want_ks = quantize(k, dtype)
        assert torch.equal(pool.k[0][batch.out_cache_loc].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(pool.k_scale[0][batch.out_cache_loc], want_ks)
        # int8 rows on the avx512vnni variants (decode and prefill) score with the query rounded to
        # int8 (test_kv_quant_vnni.py); the rest is the torch path's arithmetic
        vnni = name == "int8" and ext.decode_attention_variants()[0] == "avx512vnni"
        assert (out - torch_path).abs().max() <= (0.05 if vnni else 1e-5)
        assert (out - wide).abs().max() <= TOLERANCE[name]


def test_torch_path_dequantizes_only_gathered_rows(monkeypatch):
    """Without the kernels the pool is read through the gathered rows only: dequantize sees the
    [B, L, Hkv, D] gather, never the whole [slots, Hkv, D] pool."""
    g = torch.Generator().manual_seed(2)
    pool, _, table = quantized_pool(g, [5, 9], 2, 32, torch.int8, slots=4000)
    seen = []
    real = attention_mod.dequantize
    monkeypatch.setattr(attention_mod, "dequantize", lambda q, s, dt: seen.append(q.shape) or real(q, s, dt))
    monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
    batch = last_tokens_batch(ForwardMode.DECODE, [5, 9], [1, 1], table, pool)
    q, k = torch.randn(2, 4, 32, generator=g), torch.randn(2, 2, 32, generator=g)
    out = PagedAttention(0, 4, 2, 32)(q, k, k, batch)
    assert seen == [(2, 9, 2, 32)] * 2
    kp = dequantize(pool.k[0][table], pool.k_scale[0][table]).transpose(1, 2)
    vp = dequantize(pool.v[0][table], pool.v_scale[0][table]).transpose(1, 2)
    mask = (torch.arange(9)[None, :] < torch.tensor([5, 9])[:, None])[:, None, None]
    ref = F.scaled_dot_product_attention(q[:, :, None], kp, vp, attn_mask=mask, scale=32 ** -0.5,
                                         enable_gqa=True)
    assert (out - ref.reshape(2, -1)).abs().max() <= 1e-5
