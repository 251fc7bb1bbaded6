"""The prefill attention kernel (kernels/prefill_attention.cpp): a request's queries in tiles of
48 rows on AVX-512, 24 on AVX2 (queries x the query heads of one kv head), K/V read in place from
the pool through slot ids, each tile reading only the keys its rows see. Each variant the CPU runs
must equal attention computed in float64 under the engine's causal rule (query i of a request at
position seq_len - q_len + i sees the keys from kv_start, or from its window's start, up to its own
position) for every tile shape the heads make, pool dtype, window and cached prefix; PagedAttention
must send prefill chunks to it (decodes beside them to the decode kernel) and give what its SDPA
path gives; and SPARKSERVE_KERNEL_VARIANTS_OFF must step down from the VNNI tiles (an int8 pool's
scores: test_kv_quant_vnni.py) to the zmm ones, to the ymm tiles, then to SDPA."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from attention_fixtures import last_tokens_batch, random_paged_kv

from sparkserve import kernels
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.layers import attention as attention_mod
from sparkserve.layers.attention import PagedAttention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = {"avx512vnni": 48, "avx512": 48, "avx2": 24}          # query rows per tile


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SPARKSERVE_DISABLE_KERNELS", "") not in ("", "0"):
        pytest.fail("SPARKSERVE_DISABLE_KERNELS is set: these tests check the kernels themselves")
    assert kernels.available(), "kernel build failed (see the logged warning)"
    return kernels.load_extension()


# (avx512vnni's tiles are avx512's but for an int8 pool's scores: test_kv_quant_vnni.py)
@pytest.fixture(params=["avx512", "avx2"])
def variant(request, ext):
    if request.param not in ext.prefill_attention_variants():
        pytest.skip(f"this CPU does not run the {request.param} tiles (or they are switched off)")
    return request.param


def float64_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, kv_start, window):
    """Softmax attention in float64, per request, under the engine's causal rule."""
    D = q.shape[-1]
    G = q.shape[1] // k_buf.shape[1]
    outs, off = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        keys = kv_indices[b, :s - kv_start]
        k = k_buf[keys].double().repeat_interleave(G, 1).transpose(0, 1)     # [H, L, D]
        v = v_buf[keys].double().repeat_interleave(G, 1).transpose(0, 1)
        qb = q[off:off + n].double().transpose(0, 1)                          # [H, n, D]
        qpos = torch.arange(s - n, s)[:, None]
        kpos = kv_start + torch.arange(s - kv_start)[None, :]
        seen = kpos <= qpos
        if window:
            seen &= qpos - kpos < window
        scores = (qb @ k.transpose(1, 2)) * D ** -0.5
        p = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
        outs.append((p @ v).transpose(0, 1).reshape(n, -1))
        off += n
    return torch.cat(outs).float()


def random_case(g, q_lens, prefixes, H, Hkv, D, kv_start, dtype):
    """A pool with each request's keys in scattered slots (slot 0 pads the table), q as the model
    slices it (strided rows)."""
    seq_lens = [kv_start + n + p for n, p in zip(q_lens, prefixes)]
    B, lmax = len(seq_lens), max(seq_lens) - kv_start
    slots = 1 + B * lmax
    k_buf = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    v_buf = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    perm = 1 + torch.randperm(slots - 1, generator=g).view(B, lmax)
    valid = torch.arange(lmax)[None, :] < (torch.tensor(seq_lens) - kv_start)[:, None]
    kv_indices = torch.where(valid, perm, torch.zeros((), dtype=torch.long))
    q = torch.randn(sum(q_lens), H + Hkv, D, generator=g)[:, :H]
    return q, k_buf, v_buf, kv_indices, seq_lens


# (query heads per kv head, head dim): a tile's queries are rows // G, so these cut a request's
# queries at 48 / 24, 16 / 8, 24 / 12, 12 / 6, 9 / 4 (spare rows), 6 / 3 and 2 / 1; head dims end
# on every 16-wide tail
HEADS = [(1, 64), (3, 64), (2, 16), (4, 32), (5, 48), (8, 128), (24, 16)]


@pytest.mark.parametrize("G,D", HEADS)
@pytest.mark.parametrize("kv_start,window", [(0, None), (0, 7), (5, 40), (2, 1)])
def test_kernel_matches_float64_attention(ext, variant, G, D, kv_start, window):
    g = torch.Generator().manual_seed(G * 1000 + D + kv_start * 7 + (window or 0))
    Hkv = 2 if G < 8 else 1
    per_tile = ROWS[variant] // G
    q_lens = [max(1, per_tile - 1), per_tile, per_tile + 1, 17, 3 * per_tile + 5, 70]
    prefixes = [0, 33, 0, 70, 5, 1]          # fresh prompts and chunks after a cached prefix
    q, k_buf, v_buf, kv_indices, seq_lens = random_case(g, q_lens, prefixes, G * Hkv, Hkv, D, kv_start,
                                                        torch.float32)
    out = ext.prefill_attention(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window or 0, D ** -0.5,
                                q_lens, variant)
    ref = float64_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, kv_start, window)
    err = (out - ref).abs().max().item()
    assert err <= 1e-5, f"q_lens={q_lens} seq_lens={seq_lens}: max |diff| {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pool(ext, variant, dtype):
    """A float16 / bfloat16 pool is read as the float32 values it holds."""
    g = torch.Generator().manual_seed(3)
    q_lens, prefixes = [300, 20], [200, 0]
    q, k_buf, v_buf, kv_indices, seq_lens = random_case(g, q_lens, prefixes, 9, 3, 64, 0, dtype)
    out = ext.prefill_attention(q, k_buf, v_buf, kv_indices, seq_lens, 0, 0, 0.125, q_lens, variant)
    wide = ext.prefill_attention(q, k_buf.float(), v_buf.float(), kv_indices, seq_lens, 0, 0, 0.125, q_lens,
                                 variant)
    assert torch.equal(out, wide)
    ref = float64_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, 0, None)
    assert (out - ref).abs().max() <= 1e-5


def test_large_scores_and_a_one_key_window(ext, variant):
    """Scores far apart (the online softmax rescales the running sums as the maximum grows, and
    exps of masked or distant scores are 0, not NaN) and a window of one key (each row sees only its
    own: the output is its V row)."""
    g = torch.Generator().manual_seed(5)
    q_lens, prefixes = [130], [40]
    q, k_buf, v_buf, kv_indices, seq_lens = random_case(g, q_lens, prefixes, 6, 2, 64, 0, torch.float32)
    k_buf *= torch.linspace(0.1, 30, k_buf.shape[0])[:, None, None]
    out = ext.prefill_attention(q, k_buf, v_buf, kv_indices, seq_lens, 0, 0, 0.125, q_lens, variant)
    ref = float64_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, 0, None)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 1e-4
    own = ext.prefill_attention(q, k_buf, v_buf, kv_indices, seq_lens, 0, 1, 0.125, q_lens, variant)
    rows = kv_indices[0, 40:170]
    assert torch.equal(own.view(130, 6, 64), v_buf[rows].repeat_interleave(3, 1))


def test_a_row_does_not_depend_on_the_chunking(ext, variant):
    """Without a window the key blocks start at key 0 for every tile, so a query's row is the
    same bits whether its prompt came in one chunk or several, and whatever tile it fell in."""
    g = torch.Generator().manual_seed(8)
    q, k_buf, v_buf, kv_indices, seq_lens = random_case(g, [150], [0], 9, 3, 64, 0, torch.float32)
    whole = ext.prefill_attention(q, k_buf, v_buf, kv_indices, [150], 0, 0, 0.125, [150], variant)
    for start in (80, 37, 149):
        part = ext.prefill_attention(q[start:], k_buf, v_buf, kv_indices, [150], 0, 0, 0.125, [150 - start],
                                     variant)
        assert torch.equal(part, whole[start:]), start


def test_bad_arguments_are_refused(ext, variant):
    q = torch.randn(20, 4, 8)
    buf = torch.randn(30, 2, 8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.prefill_attention(q, buf, buf, torch.arange(20)[None], [20], 0, 0, 1.0, [20], variant)
    G = ROWS[variant]
    q, buf = torch.randn(20, G + 1, 16), torch.randn(30, 1, 16)
    with pytest.raises(RuntimeError, match=f"at most {G} query heads"):
        ext.prefill_attention(q, buf, buf, torch.arange(20)[None], [20], 0, 0, 1.0, [20], variant)
    q, buf = torch.randn(20, 2, 16), torch.randn(30, 1, 16)
    with pytest.raises(RuntimeError, match="slot id out of range"):
        ext.prefill_attention(q, buf, buf, torch.arange(20)[None] + 15, [20], 0, 0, 1.0, [20], variant)


def test_heads_it_takes(ext):
    """PagedAttention asks the kernel which heads its tiles take: the rows of the variant that runs."""
    rows = ROWS[ext.prefill_attention_variant()]
    assert ext.prefill_attention_takes(9, 3, 64) and ext.prefill_attention_takes(rows, 1, 16)
    assert not ext.prefill_attention_takes(rows + 1, 1, 16)
    assert not ext.prefill_attention_takes(4, 2, 8) and not ext.prefill_attention_takes(9, 2, 64)


def test_paged_attention_sends_prefill_chunks_to_it(ext, monkeypatch):
    """A batch of two prefill chunks (one after a cached prefix) and a decode through
    PagedAttention: the chunks go to the prefill kernel, the decode to the decode kernel, and the
    result is the SDPA path's."""
    g = torch.Generator().manual_seed(9)
    H, Hkv, D = 9, 3, 64
    seq_lens, q_lens = [60, 25, 90], [60, 1, 40]
    pool, table = random_paged_kv(seq_lens, Hkv, D, g, slots=400)
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    calls = []

    class Counting:      # the extension, noting which kernel attends how many query rows
        def decode_attention(self, q, *args):
            calls.append(("decode", q.shape[0]))
            return ext.decode_attention(q, *args)

        def prefill_attention(self, q, *args):
            calls.append(("prefill", q.shape[0]))
            return ext.prefill_attention(q, *args)

        def prefill_attention_takes(self, *heads):
            return ext.prefill_attention_takes(*heads)

    for window in (None, 20):
        batch = last_tokens_batch(ForwardMode.EXTEND, seq_lens, q_lens, table, pool)
        with torch.inference_mode():
            monkeypatch.setattr(attention_mod, "load_extension", Counting)
            out = PagedAttention(0, H, Hkv, D, window)(q, k, v, batch)
            monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
            ref = PagedAttention(0, H, Hkv, D, window)(q, k, v, batch)
        assert (out - ref).abs().max() <= 1e-5
    assert calls == [("decode", 1), ("prefill", 100)] * 2


_SWITCHED_OFF = r"""
import json
import torch
from sparkserve.kernels import load_extension
ext = load_extension()
x = torch.randn(4, 1, 16)
try:
    ext.prefill_attention(x, x, x, torch.arange(4)[None], [4], 0, 0, 1.0, [4])
    refused = ""
except RuntimeError as e:
    refused = str(e)
print(json.dumps({"variant": ext.prefill_attention_variant(), "refused": refused,
                  "takes": ext.prefill_attention_takes(9, 3, 64)}))
"""


@pytest.mark.parametrize("off,expected", [("avx512vnni", "avx512"), ("amx,avx512vnni,avx512", "avx2"),
                                          ("avx512,avx2", "")])
def test_variants_switched_off(ext, off, expected):
    if expected and expected not in ext.prefill_attention_variants():
        pytest.skip(f"this CPU does not run the {expected} tiles")
    env = {**os.environ, "SPARKSERVE_KERNEL_VARIANTS_OFF": off, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _SWITCHED_OFF], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["variant"] == expected
    assert ("no variant runs here" in got["refused"]) == (expected == "")
    assert got["takes"] == (expected != "")
