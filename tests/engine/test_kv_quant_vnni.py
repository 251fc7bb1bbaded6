"""The avx512vnni decode and prefill attention (kernels/decode_attention_avx512vnni.cpp,
prefill_attention_avx512vnni.cpp): an int8 pool's q . k scores as VNNI integer dot products, each
query row quantized to int8 (scale amax / 127 per block of the keys' scales).

Checked against references computed here, not against the kernel itself:
- exactly what the definition gives: attention whose scores are the int8 query times the int8
  keys, summed in integers per block and scaled by the query's and the key's block scales
  (float32 round-off only, 1e-5), for head dims with 1, 2, 3 and 4 scale blocks and tails past a
  64-byte chunk, decode, VERIFY blocks, windows, contexts over several key chunks, GQA;
- within OUTPUT_BOUND of the float path on the same pool (avx512: float math on the dequantized
  keys): the query's rounding moves a score by at most amax(q block) / 254 * sum |k| per block, and
  within the int8 tolerance of attention over the original float32 K/V;
- a VERIFY row equal bit for bit to the decode step at its position (DSpark stays lossless);
- other pool types untouched (equal to avx512 bit for bit);
- the prefill tiles (CP decode rows, extends over 16 tokens, long VERIFY blocks) the same: the
  definition within 1e-5 for every tile shape (1 to 16 query heads a kv head), prefixes, windows;
  within OUTPUT_BOUND of their float path and of float32 K/V; within 1e-5 of the decode kernel's
  rows (the same query rounding: a row scores alike through either kernel); other pools untouched;
- greedy tokens of the embedded SmolLM2 on an int8 pool equal to the float int8 path's (avx512), but
  at near-ties of that path (gap < 0.1); a random tiny model is no check here: its logits move by
  0.1-0.4 between a float32 and an int8 pool, so any rounding reorders its greedy tokens in a few steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sparkserve import kernels
from sparkserve.mem.kv_quant import QUANT_KV_DTYPES, block_size, dequantize, quantize

# Largest |output - float path's output|, unit-normal K/V and queries (measured <= 0.03 at head
# dims 32-128; a 5-key window shows the most): an output moves by at most the largest score change
# times the spread of V, and a score by amax(q block) / 254 * sum |k| over its blocks.
OUTPUT_BOUND = 0.05
FLOAT32_BOUND = 0.05         # vs attention over the original float32 K/V (the float path: 0.03)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = ((600, 1, 0), (600, 16, 0), (300, 8, 0), (40, 5, 7), (600, 3, 200), (9, 1, 0))


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SPARKSERVE_DISABLE_KERNELS", "") not in ("", "0"):
        pytest.fail("SPARKSERVE_DISABLE_KERNELS is set: these tests check the kernels themselves")
    assert kernels.available(), "kernel build failed (see the logged warning)"
    e = kernels.load_extension()
    if "avx512vnni" not in e.decode_attention_variants():
        pytest.skip("this CPU does not run the avx512vnni decode attention")
    assert "avx512vnni" in e.prefill_attention_variants()       # both kernels or neither
    return e


def int8_pool(g, L: int, Hkv: int, D: int):
    k, v = torch.randn(L + 1, Hkv, D, generator=g), torch.randn(L + 1, Hkv, D, generator=g)
    return k, v, quantize(k, torch.int8), quantize(v, torch.int8)


def vnni_reference(q, kq, ks, vq, vs, kv_indices, seq, n, window, scale):
    """Attention of the last n positions of a `seq`-long context with the scores the definition
    gives: q rounded to int8 per block of the keys' scales (half to even, scale amax / 127) times
    the int8 keys, each block's sum times the query's and the key's block scale, in float64 (the
    integer sums are exact there); softmax and P V in float64."""
    H, D, Hkv = q.shape[1], q.shape[2], kq.shape[1]
    qb = block_size(D)
    blocks = q.view(n, H, D // qb, qb)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q8 = (blocks * inv).round().clamp(-127, 127)
    qd = (q8.double() * (amax / 127.0).double()).view(n, H, D)                     # the int8 query's values
    slots = kv_indices[0, :seq]
    keys = dequantize(kq[slots], ks[slots], torch.float64).repeat_interleave(H // Hkv, 1)   # [seq, H, D]
    vals = dequantize(vq[slots], vs[slots], torch.float64).repeat_interleave(H // Hkv, 1)
    s = torch.einsum("nhd,shd->nsh", qd, keys) * scale
    pos, last = torch.arange(seq), seq - n + torch.arange(n)
    seen = (pos[None] <= last[:, None]) & ((window <= 0) | (pos[None] > last[:, None] - window))
    p = torch.softmax(s.masked_fill(~seen[:, :, None], float("-inf")), dim=1)
    return torch.einsum("nsh,shd->nhd", p, vals).reshape(n, H * D).float()


@pytest.mark.parametrize("D", [64, 128, 96, 48, 80, 32])
def test_scores_are_the_int8_query_dot_products(ext, D):
    g = torch.Generator().manual_seed(D)
    H, Hkv, L = 12, 3, 600                      # 4 query rows per kv head: the 4-row tiles and tails
    k, v, (kq, ks), (vq, vs) = int8_pool(g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(16, H, D, generator=g) * torch.logspace(-1, 1, 16)[:, None, None]
    q[3, 2] = 0                                  # a zero query row: scale 0, scores 0
    for seq, n, window in CASES:
        args = (kv_indices, [seq], 0, window, D ** -0.5, [n])
        got = ext.decode_attention(q[:n], kq, vq, *args, "avx512vnni", k_scale=ks, v_scale=vs)
        want = vnni_reference(q[:n], kq, ks, vq, vs, kv_indices, seq, n, window, D ** -0.5)
        assert (got - want).abs().max() <= 1e-5, (seq, n, window, (got - want).abs().max())


@pytest.mark.parametrize("D", [64, 128, 48])
def test_within_bound_of_the_float_path(ext, D):
    g = torch.Generator().manual_seed(100 + D)
    H, Hkv, L = 9, 3, 600
    k, v, (kq, ks), (vq, vs) = int8_pool(g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(16, H, D, generator=g)
    for seq, n, window in CASES:
        args = (kv_indices, [seq], 0, window, D ** -0.5, [n])
        got = ext.decode_attention(q[:n], kq, vq, *args, "avx512vnni", k_scale=ks, v_scale=vs)
        floats = ext.decode_attention(q[:n], kq, vq, *args, "avx512", k_scale=ks, v_scale=vs)
        wide = ext.decode_attention(q[:n], k, v, *args, "avx512")
        assert 0 < (got - floats).abs().max() <= OUTPUT_BOUND, (seq, n, window)
        assert (got - wide).abs().max() <= FLOAT32_BOUND, (seq, n, window)


def test_verify_rows_equal_decode_steps(ext):
    g = torch.Generator().manual_seed(7)
    H, Hkv, D, L = 9, 3, 64, 700
    _, _, (kq, ks), (vq, vs) = int8_pool(g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(12, H, D, generator=g)
    for window in (0, 100):
        block = ext.decode_attention(q, kq, vq, kv_indices, [L], 0, window, D ** -0.5, [12], "avx512vnni",
                                     k_scale=ks, v_scale=vs)
        for i in range(12):
            one = ext.decode_attention(q[i:i + 1], kq, vq, kv_indices, [L - 11 + i], 0, window, D ** -0.5,
                                       [1], "avx512vnni", k_scale=ks, v_scale=vs)
            assert torch.equal(block[i:i + 1], one), (window, i)


def other_pool(name: str, g: torch.Generator, L: int, Hkv: int, D: int):
    """K and V of a pool kind other than int8 (with the scales a quantized one carries)."""
    k, v = torch.randn(L + 1, Hkv, D, generator=g), torch.randn(L + 1, Hkv, D, generator=g)
    kw = {}
    if name in QUANT_KV_DTYPES:
        dtype = QUANT_KV_DTYPES[name]
        (k, kw["k_scale"]), (v, kw["v_scale"]) = quantize(k, dtype), quantize(v, dtype)
    else:
        k, v = k.to(getattr(torch, name)), v.to(getattr(torch, name))
    return k, v, kw


@pytest.mark.parametrize("name", ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_other_pools_take_the_avx512_path(ext, name):
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, L = 9, 3, 64, 300
    k, v, kw = other_pool(name, g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(4, H, D, generator=g)
    args = (q, k, v, kv_indices, [L], 0, 0, D ** -0.5, [4])
    vnni = ext.decode_attention(*args, "avx512vnni", **kw)
    assert torch.equal(vnni, ext.decode_attention(*args, "avx512", **kw))


# (seq, queries, window) of one request's prefill: fresh prompts, chunks after a prefix, windows
# narrower and wider than a tile's keys, a tail tile of one query
PREFILL_CASES = ((600, 100, 0), (300, 300, 0), (200, 50, 7), (600, 40, 200), (97, 97, 33), (400, 49, 0))


@pytest.mark.parametrize("D", [64, 128, 96, 48, 80, 32])
@pytest.mark.parametrize("H,Hkv", [(12, 3), (16, 1), (3, 3)])
def test_prefill_scores_are_the_int8_query_dot_products(ext, D, H, Hkv):
    g = torch.Generator().manual_seed(D + H)
    L = 600
    k, v, (kq, ks), (vq, vs) = int8_pool(g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(300, H, D, generator=g) * torch.logspace(-1, 1, 300)[:, None, None]
    q[3, 1] = 0                                  # a zero query row: scale 0, scores 0
    for seq, n, window in PREFILL_CASES:
        args = (kv_indices, [seq], 0, window, D ** -0.5, [n], "avx512vnni")
        got = ext.prefill_attention(q[:n], kq, vq, *args, k_scale=ks, v_scale=vs)
        want = vnni_reference(q[:n], kq, ks, vq, vs, kv_indices, seq, n, window, D ** -0.5)
        assert (got - want).abs().max() <= 1e-5, (seq, n, window, (got - want).abs().max())


@pytest.mark.parametrize("D", [64, 128, 48])
def test_prefill_within_bound_of_the_float_path_and_the_decode_kernel(ext, D):
    """Against the avx512 tiles (float scores on the same pool), float32 K/V, and the decode
    kernel's VNNI rows (the same int8 queries; sums in another order)."""
    g = torch.Generator().manual_seed(200 + D)
    H, Hkv, L = 9, 3, 600
    k, v, (kq, ks), (vq, vs) = int8_pool(g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(300, H, D, generator=g)
    for seq, n, window in PREFILL_CASES:
        args = (kv_indices, [seq], 0, window, D ** -0.5, [n])
        got = ext.prefill_attention(q[:n], kq, vq, *args, "avx512vnni", k_scale=ks, v_scale=vs)
        floats = ext.prefill_attention(q[:n], kq, vq, *args, "avx512", k_scale=ks, v_scale=vs)
        wide = ext.prefill_attention(q[:n], k, v, *args, "avx512")
        decode = ext.decode_attention(q[:n], kq, vq, *args, "avx512vnni", k_scale=ks, v_scale=vs)
        assert 0 < (got - floats).abs().max() <= OUTPUT_BOUND, (seq, n, window)
        assert (got - wide).abs().max() <= FLOAT32_BOUND, (seq, n, window)
        assert (got - decode).abs().max() <= 1e-5, (seq, n, window)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_prefill_other_pools_take_the_avx512_path(ext, name):
    g = torch.Generator().manual_seed(4)
    H, Hkv, D, L = 9, 3, 64, 300
    k, v, kw = other_pool(name, g, L, Hkv, D)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(80, H, D, generator=g)
    args = (q, k, v, kv_indices, [L], 0, 0, D ** -0.5, [80])
    vnni = ext.prefill_attention(*args, "avx512vnni", **kw)
    assert torch.equal(vnni, ext.prefill_attention(*args, "avx512", **kw))


_GREEDY = r"""
import json, sys
from sparkserve import Engine
prompts = json.loads(sys.argv[2])
with Engine(sys.argv[1], max_total_tokens=2048, max_running_requests=8, kv_cache_dtype="int8",
            activation_quant="none") as eng:
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    out = eng.generate(prompt=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
print(json.dumps([[o["output_ids"], [t[0][0] - t[1][0] for t in o["meta_info"]["output_top_logprobs"]]]
                  for o in out]))
"""
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
           "Water boils at", "The quick brown fox"]
NEAR_TIE = 0.1       # a top-2 log-probability gap of the float path the query's rounding may cross


def greedy_in_process(path: str, variants_off: str) -> list:
    """The embedded model's greedy tokens on an int8 pool (native step and all), in a fresh process
    whose kernels leave out `variants_off` (read once, at load)."""
    env = {**os.environ, "SPARKSERVE_KERNEL_VARIANTS_OFF": variants_off, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _GREEDY, path, json.dumps(PROMPTS)], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_greedy_equals_the_float_int8_path(ext, smollm2_path):
    """The embedded SmolLM2 (fp32 activations) on an int8 pool, 48 greedy tokens per prompt: with VNNI
    scores equal to the float int8 path's (SPARKSERVE_KERNEL_VARIANTS_OFF=avx512vnni), or parting
    only where the float path's top two choices were within NEAR_TIE; at least half the prompts
    equal throughout (measured 3 of 6; an int8 pool against float32 parts as often:
    test_kv_quant_engine.py)."""
    vnni, floats = greedy_in_process(smollm2_path, ""), greedy_in_process(smollm2_path, "avx512vnni")
    equal = 0
    for (got, _), (want, gaps) in zip(vnni, floats):
        split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        equal += split is None
        assert split is None or gaps[split] < NEAR_TIE, (split, gaps[split])
    assert equal >= len(PROMPTS) // 2
