"""Multi-head latent attention (DeepSeek-V2 MLA) over the paged pool, as Kimi-Linear uses it.

What is cached: the latent, not per-head K/V. Per token and layer the pool keeps
[kv_a_layernorm(c_kv) (kv_lora_rank) | k_pe (qk_rope_head_dim)] (`kv_latent`, token_page), as
SGLang does: 576 floats for Kimi-Linear-48B against 32 x (192 + 128) = 10,240 for expanded K/V,
17.8x less memory per token, which is what long contexts and big batches are limited by. Attention
runs "absorbed": kv_b_proj's key half is folded into the query (q_nope W_uk: one latent query per
head), all heads attend to the one shared latent row per token (MQA), and the value half maps the
attended latent back per head. Nothing is expanded per cached token, in prefill or decode.

Positions: Kimi-Linear's MLA layers are NoPE, as the reference applies no rotary embedding: k_pe /
q_pe are plain (unrotated) dimensions (forward without `rope`); Kimi refuses a config asking for rope
(`mla_use_nope: false`). DeepSeek-V2 rotates them (`rope`: the cos/sin rows of the decoupled
rope_dim channels): k_pe once, before it is cached (one shared row per token), q_pe per head. The
reference turns channel pairs (2i, 2i+1); the rotary tables here turn halves (neox), so the loader
reorders the rope rows of the q and kv_a projections pairs -> halves (`rope_rows_to_halves`): q_pe
and k_pe are then the same vectors with their channels permuted alike, so every q . k is unchanged.
`scale`: the softmax scale where it is not qk_head_dim ** -0.5 (DeepSeek's YaRN mscale).

Tensor parallel (SGLang's split): each rank keeps its query heads' rows of q_proj / q_b_proj and
kv_b_proj, attends them to the whole latent (one shared MQA row per token, so kv_a_proj_with_mqa,
kv_a_layernorm and the pool's latent are replicated), and o_proj sums the heads' partial outputs
over the ranks."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed.sharding import heads_shard, shard_rows
from sparkserve.kernels.blocks import BlockWeight
from sparkserve.kernels.build import load_extension
from sparkserve.layers.attention import KERNEL_MAX_Q, store_rows
from sparkserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.rotary import apply_rotary
from sparkserve.layers.sharded import Sharded
from sparkserve.mem.kv_quant import SCALE_DTYPE, block_size, dequantize, is_quantized, scale_component


def latent_buffers(latent_dim: int, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The pool buffers of an MLA latent a token: the latent, and a quantized latent's block scales
    (--kv-cache-dtype int8 / fp8), each (name, shape, dtype)."""
    out = [("kv_latent", (latent_dim,), dtype)]
    if is_quantized(dtype):
        blocks = latent_dim // block_size(latent_dim)
        out.append((scale_component("kv_latent", dtype), (blocks,), SCALE_DTYPE))
    return out


def rope_rows_to_halves(w: torch.Tensor, rope_dim: int, head_width: int) -> torch.Tensor:
    """Output rows of a projection [heads * head_width, ...] whose last `rope_dim` rows per head
    are rope channels in pairs (x0 y0 x1 y1 ...), reordered to halves (x0 x1 ... y0 y1 ...)."""
    rows = w.reshape(-1, head_width, *w.shape[1:])
    rope = rows[:, head_width - rope_dim:]
    rope = rope.reshape(rows.shape[0], rope_dim // 2, 2, *w.shape[1:]).transpose(1, 2)
    return torch.cat([rows[:, :head_width - rope_dim], rope.reshape(rows.shape[0], rope_dim, *w.shape[1:])],
                     1).reshape(w.shape)


class AbsorbedKvB(Sharded):
    """kv_b_proj: only used absorbed (its key half folded into the query, its value half applied
    to the attended latent), so it is not a Linear. Held as the fp32 `weight` [heads * (nope + v),
    r], or, from a GGUF's split halves (models/split_kv_b.py: hold_halves), as their blocks (`k_b` [heads * r,
    nope]: W_uk^T's rows per head, `v_b` [heads * v, r]) with `weight` a meta stand-in: a Q4_K_M
    file's halves then take their 4-8 bits a weight, not 32 (at DeepSeek-V2-Lite's shapes fp32
    halves are ~14% of what a decoded token reads), and the native step reads the same blocks
    (kernels/native_mla.cpp). Rows are per head: a rank keeps its heads' rows."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int, part: tuple[int, int]):
        super().__init__()
        self.index, self.parts = part
        self.r, self.nope, self.vd = kv_lora_rank, nope_dim, v_dim
        self.h = num_heads // self.parts
        self.weight = nn.Parameter(torch.empty(self.h * (nope_dim + v_dim), kv_lora_rank),
                                   requires_grad=False)
        self.k_b: BlockWeight | None = None
        self.v_b: BlockWeight | None = None

    def local_shard(self, tensor: torch.Tensor, blocks=None) -> tuple[torch.Tensor, None]:
        """This rank's heads' rows of an fp32 kv_b (held from then on instead of any halves)."""
        if self.k_b is not None:
            self.k_b = self.v_b = None
            self.weight = nn.Parameter(torch.empty(self.weight.shape), requires_grad=False)
        return tensor[shard_rows(tensor.shape[0], self.index, self.parts)], None

    def hold_halves(self, k_b: BlockWeight, v_b: BlockWeight) -> None:
        """A GGUF's split halves as blocks, rows per head (k_b [heads * r, nope], v_b [heads * v,
        r]): this rank's heads' rows kept, the fp32 weight dropped (a meta stand-in)."""
        self.k_b, self.v_b = self._heads(k_b.unpacked()), self._heads(v_b.unpacked())
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)

    def _heads(self, b: BlockWeight) -> BlockWeight:
        """This rank's heads' rows of a half (rows per head, head-major)."""
        if self.parts == 1:
            return b
        per = b.out_features // (self.h * self.parts)
        return b.rows(torch.arange(self.index * self.h * per, (self.index + 1) * self.h * per))

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> the latent queries W_uk^T q_nope [T, H, r]."""
        if self.k_b is not None:
            return _head_rows(q_nope, self.k_b)
        w = self.weight.view(self.h, self.nope + self.vd, self.r)
        return torch.einsum("thn,hnr->thr", q_nope, w[:, :self.nope])

    def expand_values(self, latent: torch.Tensor) -> torch.Tensor:
        """[T, H, r] attended latents -> per-head values W_uv latent [T, H, v]."""
        if self.v_b is not None:
            return _head_rows(latent, self.v_b)
        w = self.weight.view(self.h, self.nope + self.vd, self.r)
        return torch.einsum("thr,hvr->thv", latent, w[:, self.nope:])

    def held_bytes(self) -> int:
        """Bytes this layer's kv_b is held in (blocks, or the fp32 weight)."""
        if self.k_b is not None:
            return self.k_b.blocks.numel() + self.v_b.blocks.numel()
        return self.weight.numel() * self.weight.element_size()


def _head_rows(x: torch.Tensor, b: BlockWeight) -> torch.Tensor:
    """Per (token, head) head h's rows of `b` . x[t, h] with fp32 activations, on the code the
    native step runs (kernels/native_mla.cpp absorbed_head_rows); through the fp32 values where
    autograd or a tensor the kernel does not take needs them."""
    ext = load_extension()
    if ext is None or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32:
        w = b.dequantize().to(x.device, x.dtype)
        return torch.einsum("thk,hjk->thj", x, w.view(x.shape[1], -1, x.shape[2]))
    return ext.absorbed_head_rows(x.contiguous(), b.blocks, b.qtype)


class MLAttention(nn.Module):
    def __init__(self, layer_id: int, hidden: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int, bias: bool = False,
                 scale: float | None = None):
        super().__init__()
        self.layer_id = layer_id
        index, parts, self.h = heads_shard(num_heads)
        self.r, self.nope, self.rope, self.vd = kv_lora_rank, nope_dim, rope_dim, v_dim
        qk = nope_dim + rope_dim
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * qk, part=(index, parts))
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)      # the reference's default eps
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk, part=(index, parts))
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(hidden, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        self.kv_b_proj = AbsorbedKvB(kv_lora_rank, num_heads, nope_dim, v_dim, (index, parts))
        self.o_proj = RowParallelLinear(num_heads * v_dim, hidden, bias=bias)
        self.scale = qk ** -0.5 if scale is None else scale

    @property
    def latent_dim(self) -> int:
        return self.r + self.rope

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`rope`: cos, sin [T, 1, rope_dim] (halves layout) turning q_pe and k_pe; None: NoPE."""
        T, H, r = x.shape[0], self.h, self.r
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(T, H, self.nope + self.rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope], -1)
        if rope is not None:
            q = torch.cat([q[..., :self.nope], apply_rotary(q[..., self.nope:], *rope)], -1)
            k_pe = apply_rotary(k_pe.unsqueeze(1), *rope).squeeze(1)
        buf = batch.kv_pool.get("kv_latent", self.layer_id)
        scale = (batch.kv_pool.get(scale_component("kv_latent", buf.dtype), self.layer_id)
                 if is_quantized(buf.dtype) else None)     # --kv-cache-dtype int8 / fp8
        store_rows(batch, buf, scale, torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1))
        q_lat = self.kv_b_proj.absorb_query(q[..., :self.nope])
        q = torch.cat([q_lat, q[..., self.nope:]], -1)                      # [T, H, r + rope]
        out = self._latent_kernel(q, buf, scale, batch)
        if out is None:
            q_index, flat_index = batch.query_layout()
            B = batch.batch_size
            qp = (q.view(B, -1, H, self.latent_dim) if q_index is None else q[q_index]).transpose(1, 2)
            idx = batch.kv_indices          # a quantized latent: only the gathered rows dequantized
            kv = buf[idx] if scale is None else dequantize(buf[idx], scale[idx])
            kv = kv.unsqueeze(1)                                                 # [B, 1, L, r + rope]
            out = torch.nn.functional.scaled_dot_product_attention(
                qp, kv, kv[..., :r], attn_mask=batch.attn_mask(None), scale=self.scale, enable_gqa=True)
            out = out.transpose(1, 2).reshape(-1, H, r)                          # [B*Qmax, H, r]
            if flat_index is not None:
                out = out[flat_index]
        out = self.kv_b_proj.expand_values(out)
        return self.o_proj(out.reshape(T, H * self.vd))

    def _latent_kernel(self, q: torch.Tensor, buf: torch.Tensor, scale: torch.Tensor | None,
                       batch: ForwardBatch) -> torch.Tensor | None:
        """Decode, VERIFY and small extends through the paged decode attention kernel (as
        PagedAttention's), the latent pool read in place as one shared K = V head of width r + rope:
        the first r channels of what it attends are what V = the latent's first r channels gives.
        [T, H, r], or None where SDPA over the gathered rows runs instead (a quantized latent,
        context parallel, long extends)."""
        if (scale is not None or batch.cp is not None or not batch.extend_lens
                or max(batch.extend_lens) > KERNEL_MAX_Q or q.shape[0] != batch.num_tokens
                or q.dtype != torch.float32 or buf.dtype != torch.float32 or q.device.type != "cpu"
                or self.latent_dim % 8 or torch.is_grad_enabled() or not buf.is_contiguous()):
            return None
        ext = load_extension()
        if ext is None:
            return None
        _, kv_indices, kv_start = batch.kv_view(None)
        kv = buf.view(buf.shape[0], 1, self.latent_dim)
        out = ext.decode_attention(q.contiguous(), kv, kv, kv_indices, batch.seq_lens, kv_start, 0,
                                   self.scale, batch.extend_lens)
        return out.view(q.shape[0], self.h, self.latent_dim)[..., :self.r]
