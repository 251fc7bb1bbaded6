"""DSpark draft side of one speculative cycle: inject committed target taps into the draft's
KV, then propose a block per request — one parallel backbone pass, a serial Markov loop that
samples the slots, and a confidence per slot — and pick each request's verify length."""
from __future__ import annotations

import operator
from itertools import accumulate

import torch

from sparkserve.core.device import on_device
from sparkserve.core.req import Req
from sparkserve.executor.sampler import processed_probs, sample_from_probs
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.dspark_draft import DSparkDraft
from sparkserve.speculative.grammar_drafts import DraftMasks
from sparkserve.speculative.planner import VerifyPlanner
from sparkserve.speculative.worker import Proposal, SpecWorker

# Most rows kept back (defer) before they are injected anyway: bounds the memory of requests that
# do not draft (penalties, a batch too large to pay) and still batches the projections.
MAX_BACKLOG_ROWS = 256


class DSparkWorker(SpecWorker):
    backs_off = True        # a draft pass that comes to nothing costs a forward of the draft
    def __init__(self, draft: DSparkDraft, pool: KVPool, planner: VerifyPlanner, req_to_token: torch.Tensor,
                 block_slots: torch.Tensor | None = None, device: torch.device = torch.device("cpu")):
        """`block_slots`: rows of `pool` no request uses, for the native block pass
        (DSparkDraft.block_hidden). `device`: where the draft and its pool live; `req_to_token`
        is the host's request table."""
        self.draft = draft
        self.device = device
        self.pool = pool
        self.block_slots = block_slots
        self.planner = planner
        self.req_to_token = req_to_token
        self.shift = 1 if draft.config.sample_from_anchor else 0   # speculators: slot j -> anchor+j
        self.num_drafts = draft.block_size - self.shift
        # draft context not injected yet (defer): (taps rows, positions, slots) of several steps
        self.backlog: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]] = []
        self.backlog_rows = 0
        # the latest proposals planned on confidences, with their requests' accepted drafts then
        self._planned: list[tuple[Req, int, Proposal]] = []

    def describe(self) -> dict:
        """What /server_info reports of the drafter."""
        return {"verify_mode": self.planner.mode, "block_size": self.draft.block_size,
                "num_layers": self.draft.config.num_hidden_layers}

    def draft_pools(self) -> list[KVPool]:
        """The draft's KV: prompt rows computed on a PD prefill server travel with the target's."""
        return [self.pool]

    @torch.inference_mode()
    def inject(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Target rows (their taps, positions and slots) become draft context now."""
        if positions.numel():
            with on_device(self.device):
                self.draft.inject(taps, positions, slots, self.pool)

    def defer(self, taps: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep committed rows back from the draft context: one projection of every row kept back,
        whichever requests' they are, when a request drafts or leaves (flush) costs a fraction of
        one per step in which none drafts."""
        self.backlog.append((taps, positions, slots))
        self.backlog_rows += len(positions)
        if self.backlog_rows >= MAX_BACKLOG_ROWS:
            self.flush()

    def flush(self) -> None:
        """Inject every row kept back."""
        if len(self.backlog) == 1:
            self.inject(*self.backlog[0])
        elif self.backlog:
            parts = self.backlog
            taps = [torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0]))]
            self.inject(taps, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
        self.backlog, self.backlog_rows = [], 0

    def observe_draft(self, seconds: float, requests: int) -> None:
        """A draft pass (propose) for `requests` requests took `seconds`."""
        self.planner.observe_draft(seconds, requests)

    def observe_cycle(self, seconds: float, requests: int, drafting: int, tokens: int) -> None:
        """A verify cycle after its draft pass (forward, acceptance, commits) took `seconds`: the
        planner charges what it cost beyond a plain step to the next plans."""
        self.planner.observe_cycle(seconds, requests, drafting, tokens)
        self._observe_acceptance()

    def _observe_acceptance(self) -> None:
        """The cycle just committed: drafts its requests accepted vs the survivals their plans
        summed (the planner's calibration of the confidence head)."""
        planned = [(r, before, p) for r, before, p in self._planned if p.verify_len]
        self._planned = []
        if planned:
            expected = sum(sum(accumulate(p.confidence[:p.verify_len].tolist(), operator.mul))
                           for _, _, p in planned)
            self.planner.observe_acceptance(expected, sum(r.spec_accept_token_num - b for r, b, _ in planned))

    def observe_plain(self, seconds: float, requests: int) -> None:
        """A plain decode step (no request drafted) of `requests` requests took `seconds`: what a
        step costs beyond its forward, which a cycle's cost is measured against."""
        self.planner.observe_plain(seconds, requests)

    def caps(self, reqs: list[Req]) -> list[int]:
        """Most drafts each request may verify: one token of its budget is the bonus."""
        return [max(0, min(self.num_drafts, r.params.max_new_tokens - len(r.output_ids) - 1)) for r in reqs]

    def may_pay(self, reqs: list[Req], plain_tokens: int = 0) -> bool:
        """Whether drafting for `reqs` (beside `plain_tokens` plain rows) can pay at all now."""
        return self.planner.may_pay(self.caps(reqs), plain_tokens)

    @torch.inference_mode()
    def propose(self, reqs: list[Req], plain_tokens: int = 0) -> list[Proposal]:
        positions = [r.kv_len for r in reqs]        # of the anchors
        rows = slice(reqs[0].row, reqs[0].row + 1) if len(reqs) == 1 else torch.tensor([r.row for r in reqs])
        kv_indices, ctx_lens = self.req_to_token[rows, :max(positions)], positions
        if any(r.draft_gaps for r in reqs):
            kv_indices, ctx_lens = without_gaps(kv_indices, reqs)
        with on_device(self.device):
            return self._propose(reqs, ctx_lens, kv_indices.to(self.device), plain_tokens, positions)

    def _propose(self, reqs: list[Req], ctx_lens: list[int], kv_indices: torch.Tensor,
                 plain_tokens: int, positions: list[int]) -> list[Proposal]:
        d, B = self.draft, len(reqs)
        anchors = torch.tensor([r.output_ids[-1] for r in reqs])
        fast = [i for i, r in enumerate(reqs) if r.params.is_greedy and r.grammar is None]
        fused = None
        if d.native is not None and fast:
            f_anchors, f_kv, f_lens, f_pos = _rows(fast, B, anchors, kv_indices, ctx_lens, positions)
            fused = d.native.propose_greedy(d, f_anchors, f_kv, f_lens, self.pool, self.block_slots, f_pos)
        if fused is not None and len(fast) == B:
            tokens, conf = fused
            q_probs = [None] * B
        elif fused is not None:
            tokens, conf, q_probs = self._mixed_pass(reqs, fast, fused, anchors, kv_indices, ctx_lens,
                                                     positions)
        else:
            tokens, conf, q_probs = self._draft_pass(reqs, anchors, kv_indices, ctx_lens, positions)
        caps = self.caps(reqs)
        confs = [conf[i] if conf is not None else None for i in range(B)]
        lens = self.planner.plan(confs, caps, plain_tokens)
        toks = tokens.tolist()
        props = [Proposal(toks[i], confs[i], q_probs[i], lens[i]) for i in range(B)]
        self._planned = [(r, r.spec_accept_token_num, p) for r, p in zip(reqs, props)
                         if p.confidence is not None]
        return props

    def _mixed_pass(self, reqs: list[Req], fast: list[int], fused, anchors: torch.Tensor,
                    kv_indices: torch.Tensor, ctx_lens: list[int], positions: list[int]):
        """A batch whose greedy unconstrained rows (`fast`) drafted in the native pass (`fused`):
        the other rows (sampled or constrained) draft piece by piece, and the two merge back in
        batch order. Each row's drafts depend on its own context only, so the split changes none."""
        rest = [i for i in range(len(reqs)) if i not in set(fast)]
        r_anchors, r_kv, r_lens, r_pos = _rows(rest, len(reqs), anchors, kv_indices, ctx_lens, positions)
        r_tokens, r_conf, r_q = self._draft_pass([reqs[i] for i in rest], r_anchors, r_kv, r_lens, r_pos)
        f_tokens, f_conf = fused
        tokens = torch.empty(len(reqs), f_tokens.shape[1], dtype=f_tokens.dtype)
        tokens[fast], tokens[rest] = f_tokens, r_tokens
        conf = None
        if f_conf is not None and r_conf is not None:
            conf = torch.empty(len(reqs), f_conf.shape[1], dtype=f_conf.dtype)
            conf[fast], conf[rest] = f_conf, r_conf
        q_probs = [None] * len(reqs)
        for j, i in enumerate(rest):
            q_probs[i] = r_q[j]
        return tokens, conf, q_probs

    def _draft_pass(self, reqs: list[Req], anchors: torch.Tensor, kv_indices: torch.Tensor,
                    ctx_lens: list[int], positions: list[int] | None = None):
        """The draft pass piece by piece (the reference of the native propose_greedy): tokens
        [B, G], confidences [B, G] or None, per request the distributions sampled from. The
        anchors sit at `positions` (default ctx_lens: no row left out of a context)."""
        d, B, G = self.draft, len(reqs), self.num_drafts
        pos = torch.tensor(ctx_lens if positions is None else positions)
        hidden = d.block_hidden(anchors, pos, kv_indices, ctx_lens, self.pool, self.block_slots)
        hidden = hidden[:, self.shift:]
        base = d.lm_head(hidden.reshape(B * G, -1)).float().view(B, G, -1)
        tokens, embs, q_probs = self._markov_loop(reqs, anchors, hidden, base)
        conf = None
        if d.confidence_head is not None:   # not needed by the loop: one call for every slot
            conf = d.confidence_head(hidden.reshape(B * G, -1), embs.view(B * G, -1)).view(B, G)
        return tokens, conf, q_probs

    def _markov_loop(self, reqs: list[Req], anchors: torch.Tensor, hidden: torch.Tensor, base: torch.Tensor):
        """Sample the G slots in order, slot k's logits = base + Markov bias of token k-1 (serial in
        the sampled token). Returns tokens [B, G] (target ids), the W1 embeddings of each slot's
        previous token [B, G, r], and per request the distributions sampled from (None: greedy)."""
        d, (B, G) = self.draft, base.shape[:2]
        head = d.markov_head
        sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        masks = DraftMasks.of(reqs, d.to_target_ids(torch.arange(base.shape[-1], device=base.device)).cpu())
        if not sampled and d.native is not None and masks is None:
            native = d.native.markov_greedy(d, base, anchors)
            if native is not None:
                return *native, [None] * B
        tokens = torch.empty(B, G, dtype=torch.long)
        embs = torch.empty(B, G, d.config.markov_rank)
        q_probs = [None if r.params.is_greedy else torch.empty(G, base.shape[-1])   # draft vocab
                   for r in reqs]
        prev = anchors
        for k in range(G):
            emb = embs[:, k] = head.prev_embedding(prev)
            logits = base[:, k] + head.bias(emb, hidden[:, k])
            if masks is not None:           # constrained rows draft what their grammar allows
                logits = masks.apply(logits)
            nxt = logits.argmax(-1)
            for i in sampled:
                r = reqs[i]
                q = processed_probs(logits[i:i + 1], r.params)
                q_probs[i][k] = q[0]
                nxt[i] = sample_from_probs(q, r.sampling.generator(q.device))[0]
            prev = tokens[:, k] = d.to_target_ids(nxt)
            if masks is not None:
                masks.take(prev)
        return tokens, embs, [q if q is None else d.to_target_probs(q) for q in q_probs]


def _rows(pick: list[int], batch: int, anchors: torch.Tensor, kv_indices: torch.Tensor, ctx_lens: list[int],
          positions: list[int]):
    """The `pick` rows of a draft batch's inputs (all of them as they are when it is every row)."""
    if len(pick) == batch:
        return anchors, kv_indices, ctx_lens, positions
    at = torch.tensor(pick)
    return (anchors[at], kv_indices[at.to(kv_indices.device)], [ctx_lens[i] for i in pick],
            [positions[i] for i in pick])


def without_gaps(kv_indices: torch.Tensor, reqs: list[Req]) -> tuple[torch.Tensor, list[int]]:
    """Each request's context slots [B, L] (its first kv_len) without the rows it committed while
    dark (Req.draft_gaps: their draft K/V were never written), and how many are left per request.
    The draft's K/V carry their positions, so a context with rows left out is its kept rows."""
    out = torch.zeros_like(kv_indices)
    lens = []
    for b, r in enumerate(reqs):
        keep = torch.ones(r.kv_len, dtype=torch.bool)
        for start, end in r.draft_gaps:
            keep[start:end] = False
        row = kv_indices[b, :r.kv_len][keep]
        out[b, :len(row)] = row
        lens.append(len(row))
    return out, lens
