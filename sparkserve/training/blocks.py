"""The draft's training blocks over several cached sequences in one forward.

Each sequence's blocks attend to its own fused context before their anchor and to their own
block only: by default one boolean mask [B, 1, Q, L + Q] for the serving path's own attention
(SDPA), over rows padded to the longest sequence's, so every row computes what a forward of its
sequence alone computes, while a step's projections, attention and launches are shared (a GPU runs
a sequence's small kernels at a fraction of its rate). `dense=False` (TrainConfig.block_attention)
runs block_attention instead: scores against the context [Q, L], masked per row, and within each
block [G, G], one softmax over both, without the [Q, Q] part that is zero off the blocks' diagonal
and grows with the square of the anchors; the same values up to rounding."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparkserve.models.dspark_draft import DSparkDraft


@dataclass
class BlockSeq:
    """One sequence's rows for training: tokens [S], taps [S, n*d], anchors [A] (sorted), and
    what its losses read: final hidden rows [S, d] and the teacher's lse [S], or the teacher's
    top-k (an int8 cache), and the target's greedy choices [S] (prefill-labelled answers)."""
    tokens: torch.Tensor
    taps: torch.Tensor
    anchors: torch.Tensor
    final: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    greedy: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor] | None = None   # int8 cache: teacher ids, log-probs [S, k]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def blocks_forward(draft: DSparkDraft, seqs: list[BlockSeq], dropout: float = 0.0, dense: bool = True):
    """The draft's blocks at every sequence's anchors, Markov bias teacher-forced on the true
    previous tokens; `dropout` applies in training mode only. Rows are the sequences' blocks in
    order. Returns (h [R, d] after the final norm, logits [R, V_draft], Markov embeddings of the
    previous tokens [R, r], valid [sum A, G], target rows [R] as positions in the sequences'
    concatenated tokens), R = G * sum A."""
    G, B = draft.block_size, len(seqs)
    dev = seqs[0].tokens.device
    k = torch.arange(G, device=dev)
    lens = [s.tokens.shape[0] for s in seqs]
    n_blk = [s.anchors.shape[0] for s in seqs]
    ctx_lens = [int(s.anchors.max()) for s in seqs]                        # context rows < max anchor
    Q, L = G * max(n_blk), max(ctx_lens)
    offsets = [sum(lens[:b]) for b in range(B)]
    pos = [s.anchors[:, None] + k[None, :] for s in seqs]                  # [A, G] each
    valid = _cat([p + 1 < n for p, n in zip(pos, lens)])                   # target token exists
    tgt = _cat([(p + 1).clamp(max=n - 1).reshape(-1) + o for p, n, o in zip(pos, lens, offsets)])
    tokens = _cat([s.tokens for s in seqs])
    # padded block rows: ids, positions, the anchor each row's block may look before
    ids = torch.full((B, Q), draft.config.mask_token_id, dtype=torch.long, device=dev)
    qpos = torch.zeros(B, Q, dtype=torch.long, device=dev)
    q_anchor = torch.zeros(B, Q, dtype=torch.long, device=dev)
    for b, (s, p) in enumerate(zip(seqs, pos)):
        n = n_blk[b] * G
        ids[b, :n:G] = s.tokens[s.anchors]
        qpos[b, :n] = p.reshape(-1)
        q_anchor[b, :n] = s.anchors.repeat_interleave(G)
    # the fused context of every sequence in one projection, K/V padded to [B, L, Hkv, D]
    ctx = F.dropout(draft.context_hidden([_cat([s.taps[:c] for s, c in zip(seqs, ctx_lens)])]), dropout,
                    draft.training)
    ctx_pos = _cat([torch.arange(c, device=dev) for c in ctx_lens])
    ctx_dst = _cat([b * L + torch.arange(c, device=dev) for b, c in enumerate(ctx_lens)])
    cos_ctx = draft.rotary.cos_sin(ctx_pos)
    cos_blk = draft.rotary.cos_sin(qpos.reshape(-1))
    q_real = torch.arange(Q, device=dev)[None, :] < torch.tensor(n_blk, device=dev)[:, None] * G   # [B, Q]
    sees_ctx = torch.arange(L, device=dev)[None, None, :] < q_anchor[:, :, None]    # [B, Q, L]
    mask = dense_mask(sees_ctx, q_real, G) if dense else None
    x = draft.embed_tokens(ids)
    if draft.fuse_proj is not None:        # each block's context row before its anchor: a - 1
        ctx_off = torch.tensor([sum(ctx_lens[:b]) for b in range(B)], device=dev)
        prev = (ctx_off[:, None] + q_anchor - 1).clamp_min(0).reshape(-1)
        x = draft.fused_rows(x.view(B * Q, 1, -1), ctx[prev] * q_real.reshape(-1, 1)).view(B, Q, -1)
    x = x.reshape(B * Q, -1)
    for layer in draft.layers:
        kc, vc = layer.self_attn.kv(ctx, cos_ctx)
        kp = kc.new_zeros(B * L, *kc.shape[1:]).index_copy(0, ctx_dst, kc).view(B, L, *kc.shape[1:])
        vp = vc.new_zeros(B * L, *vc.shape[1:]).index_copy(0, ctx_dst, vc).view(B, L, *vc.shape[1:])
        if dense:
            x = layer(x, cos_blk, kp, vp, mask, B)
            continue
        x = x + block_attention(layer.self_attn, layer.input_layernorm(x), cos_blk, kp, vp, sees_ctx, G)
        x = x + layer.mlp(x)
    rows = q_real.reshape(-1).nonzero()[:, 0]
    h = draft.norm(F.dropout(x[rows], dropout, draft.training))
    prev = tokens[_cat([p.clamp(max=n - 1).reshape(-1) + o for p, n, o in zip(pos, lens, offsets)])]
    emb = draft.markov_head.prev_embedding(prev)                           # x_{a+k}: the anchor for k=0
    logits = draft.lm_head(h) + draft.markov_head.bias(emb, h)
    return h, logits, emb, valid, tgt


def dense_mask(sees_ctx: torch.Tensor, q_real: torch.Tensor, G: int) -> torch.Tensor:
    """[B, 1, Q, L + Q]: each row sees its context rows and its own block (a pad row itself)."""
    q = torch.arange(q_real.shape[1], device=q_real.device)
    same_blk = (q[:, None] // G == q[None, :] // G)[None] & q_real[:, None, :]
    same_blk = same_blk | ~q_real[:, :, None] & (q[:, None] == q[None, :])[None]
    return torch.cat([sees_ctx, same_blk], dim=2)[:, None]


def block_attention(attn, x: torch.Tensor, cos_sin, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                    sees_ctx: torch.Tensor, G: int) -> torch.Tensor:
    """The serving block pass's attention (DSparkAttention.forward) for training's many blocks:
    x [B*Q, d] normed rows of B sequences' blocks of G rows, ctx_k/v [B, L, Hkv, D] their padded
    context, sees_ctx [B, Q, L] which context rows each row sees (those before its anchor). Each
    row attends to those and to its own block's G rows, one softmax over both."""
    B, L, Hkv, D = ctx_k.shape
    rep = attn.h // Hkv                       # query head h reads KV head h // rep (GQA)
    Q, nb = x.shape[0] // B, x.shape[0] // B // G
    q = attn.queries(x, cos_sin).view(B, Q, Hkv, rep, D) * D ** -0.5
    k, v = (t.view(B, nb, G, Hkv, D) for t in attn.kv(x, cos_sin))
    s_ctx = torch.einsum("bqkrd,blkd->bkrql", q, ctx_k).masked_fill(~sees_ctx[:, None, None], float("-inf"))
    s_blk = torch.einsum("bngkrd,bnmkd->bkrngm", q.view(B, nb, G, Hkv, rep, D), k).reshape(B, Hkv, rep, Q, G)
    p = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1)
    out = torch.einsum("bkrql,blkd->bqkrd", p[..., :L], ctx_v)
    p_blk = p[..., L:].reshape(B, Hkv, rep, nb, G, G)
    out = out + torch.einsum("bkrngm,bnmkd->bngkrd", p_blk, v).reshape(B, Q, Hkv, rep, D)
    return attn.o_proj(out.reshape(B * Q, attn.h * D))
