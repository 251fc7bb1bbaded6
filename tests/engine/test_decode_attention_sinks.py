"""Attention sinks in the paged decode-attention kernel (GPT-OSS: a logit per head that joins each
softmax's denominator and attends to nothing; PagedKV.sinks): equal to the torch reference (the
softmax over the keys' scores and the sink, the sink's column dropped), on both chunk variants, for
rows whose keys fit one chunk and rows merged from several, and PagedAttention takes the kernel
for a decode batch with sinks where it used to attend in torch ops (`_eager`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_fixtures import random_paged_kv
from test_decode_attention import VARIANTS, ext, runs  # noqa: F401  (ext: the module fixture)

from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.layers import attention as attention_mod
from sparkserve.layers.attention import PagedAttention


def sinks_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, kv_start, window, sinks):
    """Per request, query i at position seq_len - q_len + i sees keys kv_start.. up to its own
    position (inside the window); softmax over [scores, sink] per head, the sink's share dropped."""
    H, D = q.shape[1], q.shape[2]
    outs, off = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        qpos = torch.arange(s - n, s)[:, None]
        kpos = kv_start + torch.arange(kv_indices.shape[1])[None, :]
        mask = (kpos <= qpos) & (kpos < s)
        if window is not None:
            mask &= qpos - kpos < window
        kb = k_buf[kv_indices[b]].repeat_interleave(H // k_buf.shape[1], 1)      # [L, H, D]
        vb = v_buf[kv_indices[b]].repeat_interleave(H // k_buf.shape[1], 1)
        scores = torch.einsum("nhd,lhd->hnl", q[off:off + n], kb) * D ** -0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        logits = torch.cat([scores, sinks[:, None, None].expand(H, n, 1)], -1)
        p = logits.softmax(-1)[..., :-1]
        outs.append(torch.einsum("hnl,lhd->nhd", p, vb).reshape(n, H * D))
        off += n
    return torch.cat(outs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv_start,window", [(0, None), (0, 7), (5, 300)])
def test_kernel_with_sinks_matches_reference(ext, variant, kv_start, window):  # noqa: F811
    variant = runs(ext, variant)
    g = torch.Generator().manual_seed(kv_start + (window or 0))
    D = 64
    for B, Hkv, ratio in ((1, 1, 4), (4, 2, 2), (3, 1, 1)):
        H = Hkv * ratio
        q_lens = torch.randint(1, 5, (B,), generator=g).tolist()
        seq_lens = [kv_start + n + int(torch.randint(0, 700, (), generator=g)) for n in q_lens]
        lmax = max(seq_lens) - kv_start
        slots = 1 + B * lmax
        k_buf = torch.randn(slots, Hkv, D, generator=g)
        v_buf = torch.randn(slots, Hkv, D, generator=g)
        perm = 1 + torch.randperm(slots - 1, generator=g).view(B, lmax)
        valid = torch.arange(lmax)[None, :] < (torch.tensor(seq_lens) - kv_start)[:, None]
        kv_indices = torch.where(valid, perm, torch.zeros((), dtype=torch.long))
        q = torch.randn(sum(q_lens), H, D, generator=g) * 2
        sinks = 6 + 2 * torch.randn(H, generator=g)       # near and above the rows' best scores
        out = ext.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window or 0, D ** -0.5,
                                   q_lens, variant, sinks=sinks)
        ref = sinks_reference(q, k_buf, v_buf, kv_indices, seq_lens, q_lens, kv_start, window, sinks)
        plain = ext.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, kv_start, window or 0, D ** -0.5,
                                     q_lens, variant)
        assert (plain - ref).abs().max() > 1e-3, "the sinks changed nothing: the case tests nothing"
        err = (out - ref).abs().max().item()
        assert err <= 1e-5, f"B={B} q_lens={q_lens} seq_lens={seq_lens}: max |diff| {err:.3g}"


def test_paged_attention_takes_kernel_with_sinks(ext, monkeypatch):  # noqa: F811
    """A decode batch through a layer given sinks: the kernel runs (windowed and not) and returns
    what the torch-ops path (`_eager`, kernels unavailable) returns."""
    g = torch.Generator().manual_seed(3)
    H, Hkv, D = 8, 2, 64
    seq_lens = [1, 17, 150, 4]
    B = len(seq_lens)
    pool, table = random_paged_kv(seq_lens, Hkv, D, g, slots=1 + B * max(seq_lens))
    batch = ForwardBatch(ForwardMode.DECODE, torch.zeros(B, dtype=torch.long), torch.tensor(seq_lens) - 1,
                         table[torch.arange(B), torch.tensor(seq_lens) - 1], [1] * B, seq_lens, table, pool)
    q = torch.randn(B, H, D, generator=g)
    k, v = torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
    sinks = torch.randn(H, generator=g)
    calls = []

    def decode_attention(*args, **kw):
        calls.append(kw["sinks"])
        return ext.decode_attention(*args, **kw)
    counting = SimpleNamespace(decode_attention=decode_attention)
    for window in (None, 6):
        attn = PagedAttention(0, H, Hkv, D, window)
        with torch.inference_mode():
            monkeypatch.setattr(attention_mod, "load_extension", lambda: counting)
            out = attn(q, k, v, batch, sinks)
            monkeypatch.setattr(attention_mod, "load_extension", lambda: None)
            ref = attn(q, k, v, batch, sinks)
        assert (out - ref).abs().max() <= 1e-5
    assert len(calls) == 2 and all(torch.equal(c, sinks) for c in calls)
