"""The DSpark draft's block pass, its context injection and its whole greedy draft pass, each as
one native call (kernels/native_draft.cpp; the block pass is NativeLlama's non-causal forward).

At batch 1 the draft runs once per speculative cycle, beside a target step that is already
native, so its small torch calls weigh on every cycle: ~15 per layer in the block pass, ~10 to
inject the cycle's committed rows, and those of the LM head, Markov loop and confidence head after
the block pass. The native step runs the same layers: the block rows' own K/V go to `block_slots`
(rows of the draft pool past the allocator's slots, so no request's context is touched) and each
block attends to its injected context and to all of its own rows. The Python path
(DSparkDraft.block_hidden / inject, DSparkWorker._draft_pass) stays the reference and the
fallback: a draft without half-precision / GGUF block weights, context with gaps (slots a
sliding-window target gave up, which the Python path masks), more block rows than `block_slots`,
or autograd. The draft's architecture options run around the native calls: per-tap norms in
Python before the native inject, the fused rows (prev_context_fusion) added to the block's input
rows before the native block pass, and handed to the one-call greedy pass as each request's
anchor and mask rows."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sparkserve.kernels import BlockWeight
from sparkserve.kernels.build import load_extension

if TYPE_CHECKING:
    from sparkserve.mem.kv_pool import KVPool
    from sparkserve.models.dspark_draft import DSparkDraft

log = logging.getLogger(__name__)


class NativeDraftStep:
    def __init__(self) -> None:
        self._step = None
        self._cos = None            # the rotary table the step was built with
        self._pool = None
        self._unsupported: str | None = None
        self._w2: tuple[torch.Tensor, torch.Tensor] | None = None     # (W2, packed for the kernel)
        self._int8 = False          # the activation mode the step was built under
        self._heads_of = None       # the step whose heads are set (propose_greedy)

    def ready(self, draft: DSparkDraft) -> bool:
        """Whether this draft runs natively (building the step on first use, and again after a
        change of its rotary table or activation mode)."""
        if torch.is_grad_enabled():
            return False
        int8 = _int8(draft)         # a switch changes the blocks' form: rebuild
        if self._unsupported is None and (self._step is None or self._cos is not draft.rotary.cos
                                          or self._int8 != int8):
            self._unsupported = unsupported(draft)
            if self._unsupported is None:
                self._step, self._cos, self._pool, self._int8 = build(draft), draft.rotary.cos, None, int8
            else:
                log.info("native draft step off: %s (the draft runs from Python)", self._unsupported)
        return self._unsupported is None

    def applies(self, draft: DSparkDraft, kv_indices: torch.Tensor, ctx_lens: list[int],
                block_slots: torch.Tensor | None) -> bool:
        """Whether this block pass runs natively."""
        B, G = kv_indices.shape[0], draft.block_size
        if block_slots is None or block_slots.numel() < B * G:
            return False
        if min(ctx_lens) == kv_indices.shape[1]:         # every row is context
            gaps = bool((kv_indices == 0).any())
        else:
            live = torch.arange(kv_indices.shape[1])[None, :] < torch.tensor(ctx_lens)[:, None]
            gaps = bool((kv_indices[live] == 0).any())
        return not gaps and self.ready(draft)           # gaps: the Python path masks them

    def _use_pool(self, pool: KVPool) -> None:
        if pool is not self._pool:
            self._step.set_pool(pool.k, pool.v, [])
            if pool.quantized:     # the step stores its K/V quantized and attends through the scales
                self._step.set_pool_scales(pool.k_scale, pool.v_scale)
            self._pool = pool

    def inject(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: KVPool) -> None:
        """taps [T, taps * hidden] side by side; after ready()."""
        self._use_pool(pool)
        self._step.inject(taps, positions.contiguous(), slots.contiguous(), self._int8)

    def block_hidden(self, draft: DSparkDraft, x: torch.Tensor, positions: torch.Tensor,
                     kv_indices: torch.Tensor, ctx_lens: list[int], pool: KVPool,
                     block_slots: torch.Tensor) -> torch.Tensor:
        """x [B*G, d] block embeddings at `positions`; returns the normed hidden rows [B*G, d]."""
        self._use_pool(pool)
        B, G = kv_indices.shape[0], draft.block_size
        own = block_slots[:B * G].view(B, G)
        # request b's keys: its context, then its block rows' slots
        if min(ctx_lens) == kv_indices.shape[1]:
            table = torch.cat([kv_indices, own], 1)
        else:
            table = torch.cat([kv_indices, torch.zeros(B, G, dtype=torch.long)], 1)
            table.scatter_(1, torch.tensor(ctx_lens)[:, None] + torch.arange(G)[None, :], own)
        return self._step.forward(x, positions, own.reshape(-1), table, 0, None, None, 0,
                                  [n + G for n in ctx_lens], [G] * B, [], self._int8, False)[0]

    def propose_greedy(self, draft: DSparkDraft, anchors: torch.Tensor, kv_indices: torch.Tensor,
                       ctx_lens: list[int], pool: KVPool, block_slots: torch.Tensor | None,
                       anchor_pos: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A greedy draft pass in one call: the block at positions `anchor_pos` (default ctx_lens:
        no row left out of a context), the LM head over the drafts' rows, the Markov loop, the
        confidence head. Returns (target ids [B, G], P(slot accepted | prefix accepted) [B, G] or
        None without a confidence head); None where it does not apply (the Python path runs the
        pieces then). A fused draft's (prev_context_fusion) fused row of each request rides on its
        anchor's row and on its own mask row, which the call takes one of per request."""
        G, B = draft.block_size, len(ctx_lens)
        anchor_pos = list(ctx_lens) if anchor_pos is None else anchor_pos
        draft.rotary.cover(max(anchor_pos) + G)
        if (block_slots is None or block_slots.numel() < B * G or not self.ready(draft)
                or not self._set_heads(draft)):
            return None
        emb, masks = draft.embed_tokens(anchors).float(), None
        if draft.fuse_proj is not None:     # as DSparkDraft.block_hidden: each context's last row
            n = torch.tensor(ctx_lens)
            last = kv_indices[torch.arange(B), (n - 1).clamp_min(0)] * (n > 0)
            u = draft.fuse_proj(pool.context[last].float())
            emb, masks = emb + u, (self._mask_row(draft)[None] + u).contiguous()
        self._use_pool(pool)
        tokens, conf = self._step.propose(anchors, emb.contiguous(), kv_indices, ctx_lens, block_slots,
                                          self._int8, masks, anchor_pos)
        if tokens is None:                      # a gap in a context (the call checks it)
            return None
        return tokens, conf if draft.confidence_head is not None else None

    @staticmethod
    def _mask_row(draft: DSparkDraft) -> torch.Tensor:
        return draft.embed_tokens(torch.tensor([draft.config.mask_token_id]))[0].float()

    def _set_heads(self, draft: DSparkDraft) -> bool:
        """Hand the heads to the step (once per step built); False where the step cannot run them:
        a gated Markov head (its gate reads the hidden state) or an LM head without block weights
        (an fp32 checkpoint's, or the target's whole vocab under activations in fp32)."""
        head, lm = draft.markov_head, draft.lm_head.inference_blocks()
        if head.gate_proj is not None or lm is None:
            return False
        if self._heads_of is not self._step:
            c, conf = draft.config, draft.confidence_head
            mask = self._mask_row(draft).contiguous()
            conf_w = conf_b = None
            if conf is not None:
                conf_w, conf_b = conf.proj.weight.detach().reshape(-1).contiguous(), float(conf.proj.bias)
            bias = None if draft.lm_head.bias is None else draft.lm_head.bias.detach()
            self._step.set_heads(mask, lm.blocks, lm.qtype, bias, head.markov_w1.weight.detach().contiguous(),
                                 self._packed_w2(draft), draft.d2t, conf_w, conf_b or 0.0, c.block_size,
                                 1 if c.sample_from_anchor else 0)
            self._heads_of = self._step
        return True

    def _packed_w2(self, draft: DSparkDraft) -> torch.Tensor:
        w2 = draft.markov_head.markov_w2.weight
        if self._w2 is None or self._w2[0] is not w2:
            self._w2 = (w2, load_extension().markov_pack(w2.detach()))
        return self._w2[1]

    def markov_greedy(self, draft: DSparkDraft, base: torch.Tensor,
                      anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The Markov loop of greedy requests in one call (kernels/markov_greedy.cpp): target ids
        [B, G] and each slot's previous-token code [B, G, r]; None for a gated head (its gate
        reads the slot's hidden state) or without the kernels."""
        head, ext = draft.markov_head, load_extension()
        if head.gate_proj is not None or ext is None or torch.is_grad_enabled():
            return None
        w1 = head.markov_w1.weight.detach()
        return ext.markov_greedy(base, w1, self._packed_w2(draft), draft.d2t, anchors)


def _int8(draft: DSparkDraft) -> bool:
    """Whether the backbone's projections serve int8 activations (their blocks then packed)."""
    return draft.layers[0].self_attn.q_proj.activation_quant == "int8"


def unsupported(draft: DSparkDraft) -> str | None:
    """Why this draft's backbone cannot run natively, or None."""
    if load_extension() is None:
        return "the C++ kernels are unavailable"
    if draft.fc.inference_blocks() is None:
        return "the fc projection has no block weights (an fp32 checkpoint)"
    for layer in draft.layers:
        attn = layer.self_attn
        if any(lin.inference_blocks() is None
               for lin in (attn.q_proj, attn.kv_proj, attn.o_proj, layer.gate_up_proj, layer.down_proj)):
            return "a projection has no block weights (an fp32 checkpoint)"
        if BlockWeight.cat([attn.q_proj.inference_blocks(), attn.kv_proj.inference_blocks()]) is None:
            return "q and k|v hold different block formats"
    return None


def build(draft: DSparkDraft):
    c = draft.config
    fc = draft.fc.inference_blocks()
    step = load_extension().NativeDraft(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                        c.head_dim, c.intermediate_size, c.rms_norm_eps, draft.rotary.cos,
                                        draft.rotary.sin, draft.norm.weight.detach(), fc.blocks, fc.qtype,
                                        None if draft.fc.bias is None else draft.fc.bias.detach(),
                                        draft.hidden_norm.weight.detach())
    for layer in draft.layers:
        attn = layer.self_attn
        qkv = BlockWeight.cat([attn.q_proj.inference_blocks(), attn.kv_proj.inference_blocks()])
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.kv_proj.bias]).detach()
        o, gate_up, down = (lin.inference_blocks()
                            for lin in (attn.o_proj, layer.gate_up_proj, layer.down_proj))
        step.add_layer(qkv.blocks, qkv.qtype, bias, o.blocks, o.qtype, gate_up.blocks, gate_up.qtype,
                       down.blocks, down.qtype, layer.input_layernorm.weight.detach(),
                       layer.post_attention_layernorm.weight.detach(), attn.q_norm.weight.detach(),
                       attn.k_norm.weight.detach(), 0)
    return step
