"""DSpark draft side of one speculative cycle: inject committed target taps into the draft's
KV, then propose a block per request — one parallel backbone pass, a serial Markov loop that
samples the slots, and a confidence per slot — and pick each request's verify length."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkserve.executor.sampler import processed_probs, sample_from_probs
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.dspark_draft import DSparkDraft
from sparkserve.scheduler.req import Req
from sparkserve.speculative.planner import VerifyPlanner


@dataclass
class Proposal:
    tokens: list[int]                    # drafts d_1..d_G (the verify length cuts them)
    confidence: torch.Tensor | None      # [G] P(slot accepted | prefix accepted)
    q_probs: torch.Tensor | None         # [G, V] distributions the drafts were sampled from (target vocab)
    verify_len: int = 0


class DSparkWorker:
    def __init__(self, draft: DSparkDraft, pool: KVPool, planner: VerifyPlanner, req_to_token: torch.Tensor):
        self.draft = draft
        self.pool = pool
        self.planner = planner
        self.req_to_token = req_to_token
        self.shift = 1 if draft.config.sample_from_anchor else 0   # speculators: slot j -> anchor+j
        self.num_drafts = draft.block_size - self.shift

    def inject(self, aux: list[torch.Tensor], rows: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor) -> None:
        if rows.numel():
            self.draft.inject([a[rows] for a in aux], positions[rows], slots[rows], self.pool)

    @torch.inference_mode()
    def propose(self, reqs: list[Req], plain_tokens: int = 0) -> list[Proposal]:
        d = self.draft
        anchors = torch.tensor([r.output_ids[-1] for r in reqs])
        anchor_pos = torch.tensor([r.kv_len for r in reqs])
        ctx_lens = [r.kv_len for r in reqs]
        kv_indices = self.req_to_token[torch.tensor([r.row for r in reqs]), :max(ctx_lens)]
        hidden = d.block_hidden(anchors, anchor_pos, kv_indices, ctx_lens, self.pool)[:, self.shift:]
        base = d.lm_head(hidden.reshape(-1, hidden.shape[-1])).float().view(len(reqs), self.num_drafts, -1)
        G = self.num_drafts
        tokens = torch.empty(len(reqs), G, dtype=torch.long)
        conf = torch.empty(len(reqs), G) if d.confidence_head is not None else None
        greedy = [r.params.is_greedy for r in reqs]
        q_probs = [torch.empty(G, d.config.vocab_size) if not g else None for g in greedy]
        prev = anchors
        for k in range(G):
            emb = d.markov_head.prev_embedding(prev)
            logits = base[:, k] + d.markov_head.bias(emb, hidden[:, k])
            if conf is not None:
                conf[:, k] = d.confidence_head(hidden[:, k], emb)
            nxt = logits.argmax(-1)
            for i, r in enumerate(reqs):
                if not greedy[i]:
                    q = processed_probs(logits[i:i + 1], r.params)
                    q_probs[i][k] = d.to_target_probs(q[0])
                    nxt[i] = sample_from_probs(q, r.sampling.generator(q.device))[0]
            nxt = d.to_target_ids(nxt)
            tokens[:, k] = nxt
            prev = nxt
        caps = [max(0, min(G, r.params.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]
        confs = [conf[i] if conf is not None else None for i in range(len(reqs))]
        lens = self.planner.plan(confs, caps, plain_tokens)
        return [Proposal(tokens[i].tolist(), confs[i], q_probs[i], lens[i]) for i in range(len(reqs))]
