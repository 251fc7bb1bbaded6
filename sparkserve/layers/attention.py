"""Paged attention on CPU with torch SDPA: write the new K/V into the pool, gather each
request's K/V through its slot table into a padded batch, attend under one mask. The gathered
positions start at `batch.kv_start` (the batch's earliest window start when every layer is
sliding-window), and the mask works on absolute positions. With full and windowed layers mixed
(a split pool) the windowed layers write and read their own slots (`batch.kv_view`).
Decode, VERIFY blocks and small extends (at most KERNEL_MAX_Q query tokens per request, fp32, no
grad) skip the gather: the C++ kernel (kernels/decode_attention.cpp) reads K/V in place through
the slot ids, causally per query token. Longer prefill chunks, and a context-parallel share's
queries (not at the end of their requests), do too through the prefill kernel
(kernels/prefill_attention.cpp), which also skips the masked half of a causal prompt and pads
nothing; SDPA takes them where it cannot run (kernels unavailable, or heads its tiles do not take:
a head_dim not a multiple of 16, more query heads per kv head than a tile's rows). A batch with
both (decodes riding a prefill chunk, a prefill of long and short prompts) runs each part its own
way, so a VERIFY row stays bit for bit the decode step at its position.
A quantized pool (--kv-cache-dtype int8 / fp8_*: mem/kv_quant.py) is written quantized with its
block scales, and read as it is: the kernels dequantize the rows they fetch, the torch paths the
rows they gather, so no dequantized copy of the pool is ever made."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.kernels.build import load_extension
from sparkserve.mem.kv_pool import KVPool
from sparkserve.mem.kv_quant import dequantize, is_quantized, quantize, scale_component

# Most query tokens per request for the decode kernel: it keeps every score of a request's block,
# so longer prefill chunks go to the prefill kernel's blocked, online-softmax tiles.
KERNEL_MAX_Q = 16
# What the kernels read from the pool (converting to fp32 as they load; the quantized ones with
# their block scales).
KERNEL_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn,
                    torch.float8_e5m2)

Scales = tuple[torch.Tensor, torch.Tensor] | None     # a quantized pool's K and V block scales


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None = None, scale: float | None = None, softcap: float | None = None):
        """`scale`: of q.k (default head_dim ** -0.5); `softcap`: scores pass through
        softcap * tanh(score / softcap) (Gemma 2). A soft-cap, or sinks given to forward (GPT-OSS:
        a logit per head that joins each softmax's denominator and attends to nothing), the prefill
        kernel and SDPA do not take: such a layer attends in torch ops (`_eager`), but for what
        the decode kernel runs (decode, VERIFY, small extends), which takes sinks."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H*D]; sinks: [H] (this rank's heads)."""
        pool = batch.kv_pool
        k_buf, v_buf = pool.layer(self.layer_id)
        if isinstance(pool, KVPool):
            sc = pool.layer_scales(self.layer_id)
        else:       # a hybrid model's K/V (MiniMax's full-attention layers)
            ks, vs = (pool_scales(pool, name, self.layer_id, k_buf) for name in ("k", "v"))
            sc = None if ks is None else (ks, vs)
        store_rows(batch, k_buf, None if sc is None else sc[0], k, self.window)
        store_rows(batch, v_buf, None if sc is None else sc[1], v, self.window)
        ext = self._kernel_extension(q, k_buf, v_buf, batch)
        if self.softcap is not None or sinks is not None:
            # the decode kernel takes sinks (a logit per head in each softmax's denominator)
            if (sinks is not None and self.softcap is None and ext is not None and batch.cp is None
                    and max(batch.extend_lens) <= KERNEL_MAX_Q):
                return self._decode(ext, q, k_buf, v_buf, batch, sc, sinks.detach().float().contiguous())
            return self._eager(q, k_buf, v_buf, batch, sinks, sc)
        if ext is None:
            return self._sdpa(q, k_buf, v_buf, batch, sc)
        # a context-parallel share's queries are not all at the end of their requests: only the
        # prefill kernel (by runs of positions) or SDPA takes them
        if batch.cp is None and max(batch.extend_lens) <= KERNEL_MAX_Q:   # decode, VERIFY
            return self._decode(ext, q, k_buf, v_buf, batch, sc)
        prefill = self._prefill_kernel(ext)
        if batch.cp is not None or min(batch.extend_lens) > KERNEL_MAX_Q:
            return self._long(prefill, q, k_buf, v_buf, batch, sc)
        # e.g. decodes riding a prefill chunk
        (short_rows, short), (long_rows, long) = batch.split_by_query_len(KERNEL_MAX_Q)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        out[short_rows] = self._decode(ext, q[short_rows], k_buf, v_buf, short, sc)
        out[long_rows] = self._long(prefill, q[long_rows], k_buf, v_buf, long, sc)
        return out

    def _long(self, prefill, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
              batch: ForwardBatch, sc: Scales) -> torch.Tensor:
        """Prefill chunks: the prefill kernel over each run of consecutive query positions as a
        request ending at its last query (`ForwardBatch.query_runs`), or SDPA where it cannot run."""
        if prefill is None:
            return self._sdpa(q, k_buf, v_buf, batch, sc)
        req, ends, lens = batch.query_runs()
        _, kv_indices, kv_start = batch.kv_view(self.window)
        return prefill(q, k_buf, v_buf, kv_indices[req], ends, kv_start, self.window or 0, self.scale, lens,
                       **_scale_args(sc))

    def _decode(self, ext, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                batch: ForwardBatch, sc: Scales, sinks: torch.Tensor | None = None) -> torch.Tensor:
        _, kv_indices, kv_start = batch.kv_view(self.window)
        return ext.decode_attention(q, k_buf, v_buf, kv_indices, batch.seq_lens, kv_start, self.window or 0,
                                    self.scale, batch.extend_lens, **_scale_args(sc),
                                    **({} if sinks is None else {"sinks": sinks}))

    def _prefill_kernel(self, ext):
        """The prefill kernel where it runs here and takes this layer's heads, else None."""
        if ext.prefill_attention_takes(self.num_heads, self.num_kv_heads, self.head_dim):
            return ext.prefill_attention
        return None

    def _sdpa(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
              batch: ForwardBatch, sc: Scales = None) -> torch.Tensor:
        """Gather each request's keys into a padded batch and attend under one mask."""
        qp, kp, vp, mask = self._gathered(q, k_buf, v_buf, batch, sc)
        out = torch.nn.functional.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return self._flat(out, batch)

    def _eager(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, batch: ForwardBatch,
               sinks: torch.Tensor | None, sc: Scales = None) -> torch.Tensor:
        """_sdpa's gather, the scores soft-capped before the mask and the sinks in the softmax."""
        qp, kp, vp, mask = self._gathered(q, k_buf, v_buf, batch, sc)
        group = self.num_heads // self.num_kv_heads
        kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        scores = qp @ kp.transpose(-1, -2) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return self._flat(torch.softmax(scores, dim=-1) @ vp, batch)
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return self._flat(probs @ vp, batch)

    def _gathered(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, batch: ForwardBatch,
                  sc: Scales = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries [B, H, Qmax, D], keys and values [B, Hkv, L, D] padded per request (a quantized
        pool's gathered rows dequantized), the mask."""
        _, kv_indices, _ = batch.kv_view(self.window)
        q_index, _ = batch.query_layout()
        qp = q.view(batch.batch_size, -1, *q.shape[1:]) if q_index is None else q[q_index]
        if sc is None:
            kp, vp = k_buf[kv_indices].to(q.dtype), v_buf[kv_indices].to(q.dtype)
        else:
            kp = dequantize(k_buf[kv_indices], sc[0][kv_indices], q.dtype)
            vp = dequantize(v_buf[kv_indices], sc[1][kv_indices], q.dtype)
        kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)
        return qp.transpose(1, 2), kp, vp, batch.attn_mask(self.window)

    def _flat(self, out: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[B, H, Qmax, D] -> the batch's flat rows [T, H*D]."""
        _, flat_index = batch.query_layout()
        B, _, qmax, _ = out.shape
        out = out.transpose(1, 2).reshape(B * qmax, self.num_heads * self.head_dim)
        return out if flat_index is None else out[flat_index]

    def _kernel_extension(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          batch: ForwardBatch):
        """The extension when its kernels can run this batch's requests (fp32 CPU tensors,
        contiguous pool buffers, no autograd), else None."""
        if (q.dtype != torch.float32 or k_buf.dtype not in KERNEL_KV_DTYPES
                or q.device.type != "cpu" or self.head_dim % 8 or torch.is_grad_enabled()
                or q.shape[0] != batch.num_tokens or not batch.extend_lens
                or not (k_buf.is_contiguous() and v_buf.is_contiguous())):
            return None
        return load_extension()


def store_rows(batch: ForwardBatch, buf: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor,
               window: int | None = None) -> None:
    """batch.store of a pool item's new rows; a quantized buffer takes them quantized, their block
    scales into `scale` (as bytes: a context-parallel gather over gloo has no float8)."""
    if scale is None:
        batch.store(buf, rows, window)
        return
    elems, scales = quantize(rows, buf.dtype)
    batch.store(buf.view(torch.uint8), elems.view(torch.uint8), window)
    batch.store(scale, scales, window)


def pool_scales(pool, name: str, layer_id: int, buf: torch.Tensor) -> torch.Tensor | None:
    """The block scales of a HybridPool buffer `name` of a quantized dtype (mem/kv_quant.py), else None."""
    return pool.get(scale_component(name, buf.dtype), layer_id) if is_quantized(buf.dtype) else None


def gather_rows(buf: torch.Tensor, scale: torch.Tensor | None, index) -> torch.Tensor:
    """buf[index] as float32: a quantized buffer's gathered rows dequantized (only those)."""
    return buf[index].float() if scale is None else dequantize(buf[index], scale[index])


def _scale_args(sc: Scales) -> dict[str, torch.Tensor]:
    """The kernels' keyword arguments for a quantized pool's scales (none for a float pool)."""
    return {} if sc is None else {"k_scale": sc[0], "v_scale": sc[1]}
