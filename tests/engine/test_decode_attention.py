"""The paged decode-attention kernel (kernels/decode_attention.cpp): one query token per request,
K/V read in place from the pool through slot ids. It must equal torch SDPA on the gathered,
padded K/V under the engine's mask rule (keys kv_start.. below seq_len, inside the window) up
to summation order; PagedAttention must take it in decode and give what its SDPA path gives;
and the engine's greedy tokens must not change when SPARKSERVE_DISABLE_KERNELS=1 turns it off.
With q_lens (VERIFY blocks, small extends) each request has several query tokens, each seeing the
keys up to its own position (causal), and it must equal SDPA under the engine's causal mask."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from attention_fixtures import last_tokens_batch, random_paged_kv

from sparkserve import kernels
from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.layers import attention as attention_mod
from sparkserve.layers.attention import PagedAttention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SPARKSERVE_DISABLE_KERNELS", "") not in ("", "0"):
        pytest.fail("SPARKSERVE_DISABLE_KERNELS is set: these tests check the kernels themselves")
    assert kernels.available(), "kernel build failed (see the logged warning)"
    return kernels.load_extension()


VARIANTS = ["avx512", "avx2"]


def runs(ext, variant: str) -> str:
    """`variant` where this CPU runs it (the AVX-512 chunk kernels need AVX-512), else a skip."""
    if variant not in ext.decode_attention_variants():
        pytest.skip(f"this CPU does not run the {variant} decode attention")
    return variant


def random_case(g: torch.Generator, B: int, H: int, Hkv: int, D: int, kv_start: int):
    """A random pool, q as the model slices it (non-contiguous rows), per-request lengths
    (1 and the maximum always among them) and distinct random slot ids padded with 0."""
    seq_lens = (kv_start + torch.randint(1, 40, (B,), generator=g)).tolist()
    seq_lens[0] = kv_start + 1
    seq_lens[-1] = kv_start + 40
    lmax = max(seq_lens) - kv_start
    slots = 1 + B * lmax + 7
    k_buf = torch.randn(slots, Hkv, D, generator=g)
    v_buf = torch.randn(slots, Hkv, D, generator=g)
    perm = 1 + torch.randperm(slots - 1, generator=g)[:B * lmax].view(B, lmax)
    valid = torch.arange(lmax)[None, :] < (torch.tensor(seq_lens) - kv_start)[:, None]
    kv_indices = torch.where(valid, perm, torch.zeros((), dtype=torch.long))
    q = torch.randn(B, H + Hkv, D, generator=g)[:, :H]
    return q, k_buf, v_buf, kv_indices, seq_lens


def sdpa_reference(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window):
    """Gather the padded K/V and attend under the engine's mask (query position seq_len - 1)."""
    B, H, D = q.shape
    lmax = kv_indices.shape[1]
    kpos = kv_start + torch.arange(lmax)
    seq = torch.tensor(seq_lens)[:, None]
    qpos = seq - 1
    mask = (kpos[None, :] <= qpos) & (kpos[None, :] < seq)
    if window is not None:
        mask &= qpos - kpos[None, :] < window
    out = F.scaled_dot_product_attention(
        q[:, :, None], k_buf[kv_indices].transpose(1, 2), v_buf[kv_indices].transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=D ** -0.5, enable_gqa=H != k_buf.shape[1])
    return out.reshape(B, H * D)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("D", [64, 16])
@pytest.mark.parametrize("kv_start,window", [(0, None), (0, 5), (6, 9)])
def test_kernel_matches_sdpa(ext, variant, ratio, D, kv_start, window):
    variant = runs(ext, variant)
    g = torch.Generator().manual_seed(ratio * 100 + D + kv_start)
    for B in (1, 2, 5, 8):
        Hkv = 1 if B == 1 else 3
        q, k_buf, v_buf, kv_indices, seq_lens = random_case(g, B, Hkv * ratio, Hkv, D, kv_start)
        out = ext.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window or 0, D ** -0.5,
                                   [], variant)
        ref = sdpa_reference(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window)
        err = (out - ref).abs().max().item()
        assert err <= 1e-5, f"B={B} lens={seq_lens}: max |diff| {err:.3g}"


def test_paged_attention_takes_kernel_in_decode(ext, monkeypatch):
    """PagedAttention.forward in a decode batch: writes the new K/V, calls the kernel, and
    returns what its SDPA path returns (windowed and not)."""
    g = torch.Generator().manual_seed(7)
    H, Hkv, D = 9, 3, 64
    seq_lens = [1, 17, 33, 4]
    B = len(seq_lens)
    pool, table = random_paged_kv(seq_lens, Hkv, D, g)
    batch = ForwardBatch(ForwardMode.DECODE, torch.zeros(B, dtype=torch.long), torch.tensor(seq_lens) - 1,
                         table[torch.arange(B), torch.tensor(seq_lens) - 1], [1] * B, seq_lens, table, pool)
    q = torch.randn(B, H, D, generator=g)
    k, v = torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
    calls = []
    monkeypatch.setattr(attention_mod, "load_extension", lambda: calls.append(1) or ext)
    for window in (None, 6):
        attn = PagedAttention(0, H, Hkv, D, window)
        with torch.inference_mode():
            out = attn(q, k, v, batch)
            monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
            ref = attn(q, k, v, batch)
            monkeypatch.setattr(attention_mod, "load_extension", lambda: calls.append(1) or ext)
        assert torch.equal(pool.k[0][batch.out_cache_loc], k)
        assert (out - ref).abs().max() <= 1e-5
    assert len(calls) == 2


def causal_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, kv_start, window):
    """SDPA per request on its gathered K/V, query i at position seq_len - q_len + i seeing the
    keys kv_start.. up to its own position (and inside the window)."""
    D = q.shape[-1]
    outs, off = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        qpos = torch.arange(s - n, s)[:, None]
        kpos = kv_start + torch.arange(kv_indices.shape[1])[None, :]
        mask = (kpos <= qpos) & (kpos < s)
        if window is not None:
            mask &= qpos - kpos < window
        qb = q[off:off + n].transpose(0, 1)[None]                      # [1, H, n, D]
        kb = k_buf[kv_indices[b]].transpose(0, 1)[None]
        vb = v_buf[kv_indices[b]].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[None, None], scale=D ** -0.5,
                                           enable_gqa=q.shape[1] != k_buf.shape[1])
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
        off += n
    return torch.cat(outs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("kv_start,window", [(0, None), (0, 5), (6, 9), (3, 1)])
def test_multi_query_kernel_matches_causal_sdpa(ext, variant, ratio, kv_start, window):
    """Several query tokens per request (1..12, varied, a whole sequence among them when
    kv_start is 0), causal, GQA 1 and 3, windows narrower and wider than the query block."""
    variant = runs(ext, variant)
    g = torch.Generator().manual_seed(ratio * 10 + kv_start + (window or 0))
    D = 64
    for B in (1, 3, 6):
        Hkv = 1 if B == 1 else 2
        H = Hkv * ratio
        q_lens = torch.randint(1, 13, (B,), generator=g).tolist()
        seq_lens = [kv_start + n + int(torch.randint(0, 30, (), generator=g)) for n in q_lens]
        if kv_start == 0:
            seq_lens[0] = q_lens[0]                                    # no cached prefix at all
        lmax = max(seq_lens) - kv_start
        slots = 1 + B * lmax
        k_buf = torch.randn(slots, Hkv, D, generator=g)
        v_buf = torch.randn(slots, Hkv, D, generator=g)
        perm = 1 + torch.randperm(slots - 1, generator=g).view(B, lmax)
        valid = torch.arange(lmax)[None, :] < (torch.tensor(seq_lens) - kv_start)[:, None]
        kv_indices = torch.where(valid, perm, torch.zeros((), dtype=torch.long))
        q = torch.randn(sum(q_lens), H + Hkv, D, generator=g)[:, :H]   # strided rows, as the model slices q
        out = ext.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window or 0, D ** -0.5,
                                   q_lens, variant)
        ref = causal_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, kv_start, window)
        err = (out - ref).abs().max().item()
        assert err <= 1e-5, f"B={B} q_lens={q_lens} seq_lens={seq_lens}: max |diff| {err:.3g}"


def test_paged_attention_takes_kernel_in_verify(ext, monkeypatch):
    """A VERIFY-shaped batch (several query tokens per request, unequal) through PagedAttention:
    the kernel is called, with the result of the SDPA path; above KERNEL_MAX_Q it is not."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D = 9, 3, 64
    seq_lens, q_lens = [8, 30, 13], [8, 5, 1]
    pool, table = random_paged_kv(seq_lens, Hkv, D, g)
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    calls = []
    for window in (None, 4):
        batch = last_tokens_batch(ForwardMode.VERIFY, seq_lens, q_lens, table, pool)
        attn = PagedAttention(0, H, Hkv, D, window)
        with torch.inference_mode():
            monkeypatch.setattr(attention_mod, "load_extension", lambda: calls.append(1) or ext)
            out = attn(q, k, v, batch)
            monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
            ref = attn(q, k, v, batch)
        assert (out - ref).abs().max() <= 1e-5
    assert len(calls) == 2
    # above KERNEL_MAX_Q a request goes to SDPA (on a CPU without the prefill kernel, as this
    # extension says), padded only to the longest such request, while the short ones in the same
    # batch still take the kernel
    monkeypatch.setattr(attention_mod, "KERNEL_MAX_Q", 4)
    kernel_rows = []

    class Counting:      # the extension, noting how many query rows each kernel call attends
        def decode_attention(self, q, *args):
            kernel_rows.append(q.shape[0])
            return ext.decode_attention(q, *args)

        def prefill_attention_takes(self, *heads):
            return False
    counting = lambda: Counting()
    for window in (None, 4):
        with torch.inference_mode():
            batch = last_tokens_batch(ForwardMode.VERIFY, seq_lens, q_lens, table, pool)
            monkeypatch.setattr(attention_mod, "load_extension", counting)
            out = PagedAttention(0, H, Hkv, D, window)(q, k, v, batch)
            monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
            ref = PagedAttention(0, H, Hkv, D, window)(q, k, v, batch)
        assert (out - ref).abs().max() <= 1e-5
        (short_rows, short), (long_rows, long) = batch.split_by_query_len(4)
        assert short.extend_lens == [1] and long.extend_lens == [8, 5]
        assert short_rows.tolist() == [T - 1] and long_rows.tolist() == list(range(T - 1))
    assert kernel_rows == [1, 1]


_DISABLED_SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(1)
from sparkserve import Engine, kernels
engine = Engine(max_total_tokens=4096, max_running_requests=8)
out = engine.generate(input_ids=json.loads(sys.argv[1]),
                      sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
print(json.dumps({"available": kernels.available(), "ids": [o["output_ids"] for o in out]}))
"""


def test_engine_greedy_same_with_kernels_disabled(ext, smollm2_engine, monkeypatch):
    tok = smollm2_engine.tokenizer
    texts = ["Hi", "The three primary colors are",
             "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that",
             "List four planets:"]
    prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
    calls = []
    monkeypatch.setattr(attention_mod, "load_extension", lambda: calls.append(1) or ext)
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    model = smollm2_engine.scheduler.runner.model
    model.enable_native_step(False)       # the layer path, whose attention this file is about
    try:
        ours = [o["output_ids"] for o in smollm2_engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        model.enable_native_step(True)
    assert calls, "the decode kernel was not used"
    native = [o["output_ids"] for o in smollm2_engine.generate(input_ids=prompts, sampling_params=params)]
    assert native == ours
    env = dict(os.environ, SPARKSERVE_DISABLE_KERNELS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _DISABLED_SCRIPT, json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["available"] is False
    assert res["ids"] == ours


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("window", [None, 6, 200])
def test_block_rows_equal_one_query_calls_bit_for_bit(ext, variant, window):
    """Each query row of a multi-query call (a VERIFY block, a small extend) is bit-identical to a
    one-query call at its position, whatever the block's size and the thread count: speculative
    verify must score exactly what plain decoding would, or greedy outputs could part on near-ties.
    Contexts past the kernel's 256-key chunks and blocks straddling a chunk edge included, and
    each block equals SDPA."""
    variant = runs(ext, variant)
    g = torch.Generator().manual_seed(5 + (window or 0))
    H, Hkv, D, L = 9, 3, 64, 600
    k_buf, v_buf = torch.randn(L + 1, Hkv, D, generator=g), torch.randn(L + 1, Hkv, D, generator=g)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(16, H, D, generator=g)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for seq, n in ((L, 16), (262, 8), (258, 3), (513, 9), (70, 5), (9, 9)):
                block = ext.decode_attention(q[:n], k_buf, v_buf, kv_indices, [seq], 0, window or 0,
                                             D ** -0.5, [n], variant)
                ref = causal_reference(q[:n], k_buf, v_buf, kv_indices[:, :seq], [seq], [n], 0, window)
                assert (block - ref).abs().max() <= 1e-5, f"seq {seq} block {n}"
                for i in range(n):
                    one = ext.decode_attention(q[i:i + 1], k_buf, v_buf, kv_indices, [seq - n + 1 + i], 0,
                                               window or 0, D ** -0.5, [], variant)
                    assert torch.equal(block[i], one[0]), f"seq {seq} block {n} row {i} (threads {threads})"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pool_reads_as_its_float32_values(ext, variant, dtype):
    """A float16 / bfloat16 pool (--kv-cache-dtype) is read by converting each value exactly, so
    the kernel gives, bit for bit, what it gives on the same values held as float32: decode,
    causal blocks, windows, contexts past a key chunk. Another dtype is refused by name."""
    variant = runs(ext, variant)
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, L = 9, 3, 64, 600
    k16 = torch.randn(L + 1, Hkv, D, generator=g).to(dtype)
    v16 = torch.randn(L + 1, Hkv, D, generator=g).to(dtype)
    kv_indices = (1 + torch.randperm(L, generator=g))[None]
    q = torch.randn(16, H, D, generator=g)
    for seq, n, window in ((L, 1, 0), (L, 16, 0), (300, 8, 0), (40, 5, 7), (L, 3, 200)):
        args = (kv_indices, [seq], 0, window, D ** -0.5, [n], variant)
        half = ext.decode_attention(q[:n], k16, v16, *args)
        full = ext.decode_attention(q[:n], k16.float(), v16.float(), *args)
        assert torch.equal(half, full), (seq, n, window)
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16, int8, float8_e4m3fn or float8_e5m2"):
        ext.decode_attention(q[:1], k16.double(), v16.double(), kv_indices, [L], 0, 0, D ** -0.5)


def test_variants_by_head_dim(ext):
    """The AVX-512 chunk kernels take head dims that are multiples of 16; others run on ymm (what
    decode_attention picks unasked), and naming avx512 for them is refused; both variants agree
    with each other to summation order."""
    g = torch.Generator().manual_seed(9)
    assert ext.decode_attention_variants()[-1] == "avx2"
    for D in (24, 64):
        q, k_buf, v_buf, kv_indices, seq_lens = random_case(g, 3, 6, 2, D, 0)
        args = (q, k_buf, v_buf, kv_indices, seq_lens, 0, 0, D ** -0.5, [])
        best = ext.decode_attention(*args)
        expected = "avx2" if D % 16 else ext.decode_attention_variants()[0]
        assert torch.equal(best, ext.decode_attention(*args, expected))
        if "avx512" not in ext.decode_attention_variants():
            continue
        if D % 16:
            with pytest.raises(RuntimeError, match="no variant avx512 for head dim 24"):
                ext.decode_attention(*args, "avx512")
        else:
            zmm, ymm = ext.decode_attention(*args, "avx512"), ext.decode_attention(*args, "avx2")
            assert (zmm - ymm).abs().max() < 1e-5


_SWITCHED_OFF = r"""
import json
import torch
from sparkserve.kernels import load_extension
ext = load_extension()
q, kv = torch.randn(1, 2, 64), torch.randn(5, 2, 64)
try:
    ext.decode_attention(q, kv, kv, torch.arange(1, 5)[None], [4], 0, 0, 0.125, [], "avx512")
    refused = ""
except RuntimeError as e:
    refused = str(e)
print(json.dumps({"variants": ext.decode_attention_variants(), "refused": refused}))
"""


def test_avx512_switched_off_steps_down_to_ymm(ext):
    """SPARKSERVE_KERNEL_VARIANTS_OFF=avx512 (read at load, a fresh process) leaves the ymm form,
    the baseline every CPU the kernels build for runs, and naming the zmm form is refused."""
    env = {**os.environ, "SPARKSERVE_KERNEL_VARIANTS_OFF": "avx512", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _SWITCHED_OFF], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["variants"] == ["avx2"]
    assert "no variant avx512 for head dim 64" in got["refused"]
