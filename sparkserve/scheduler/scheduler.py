"""Scheduler: continuous batching over one model.

Each `step()` runs one forward: a prefill (EXTEND) batch when waiting requests fit (new ones
join between steps; long prompts go in chunks of --chunked-prefill-size), else one DECODE
step for every running request. With --enable-mixed-chunk the running requests decode inside
the prefill forward too (one-token extends), so their tokens keep coming while prompts prefill.
When KV slots run out, the newest running requests are retracted (their KV kept in the prefix
cache) and recomputed later, never failed; priority preemption does the same (preemption.py).
With every layer sliding-window, pages that leave the window go back after each forward
(KVCacheManager.slide_window), so a request holds about a window of KV however long it runs; with
full and windowed layers mixed, the windowed layers' pages do."""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from sparkserve.constrained.backend import GrammarBackend, attach_grammar
from sparkserve.constrained.bitmask import batch_mask
from sparkserve.core.finish_reason import FINISH_ABORT, FINISH_LENGTH, BaseFinishReason
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.core.req import Req
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.executor.sampler import Sampler
from sparkserve.layers.moe import expert_rank_tokens
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.mem.transfer import Shapes
from sparkserve.messages import SchedulerLoad
from sparkserve.scheduler import draft_pause
from sparkserve.scheduler.batch_log import BatchLog
from sparkserve.scheduler.hidden_rows import keep_hidden
from sparkserve.scheduler.prebuilt import PromptHandover
from sparkserve.scheduler.preemption import ensure_decode_memory, preempt_for, running_slot, slot_free
from sparkserve.scheduler.prompt_logprobs import collect_prompt_logprobs
from sparkserve.scheduler.waiting_queue import common_prefix_len, enqueue
from sparkserve.speculative.grammar_drafts import cut_drafts, verify_masks
from sparkserve.speculative.verify import VerifyLogits, accept_batch, first_rows, raw_logprobs

if TYPE_CHECKING:
    from sparkserve.speculative.worker import SpecWorker


@dataclass
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 512       # <= 0: no chunking
    max_prefill_tokens: int = 4096
    decode_log_interval: int = 40         # log one decode batch in this many (SGLang's default)
    mixed_chunk: bool = False             # decodes join prefill forwards (--enable-mixed-chunk)
    priority_scheduling: bool = False     # the queue orders by Req.priority (--enable-priority-scheduling)
    low_priority_first: bool = False      # lower values first (--schedule-low-priority-values-first)
    # a waiting request preempts running ones it outranks by more than this (None: never)
    preemption_threshold: int | None = None   # --priority-scheduling-preemption-threshold


IN_BATCH_PREFIX_MIN = 32     # shared prompt tokens worth waiting one step for


class Scheduler(PromptHandover):
    def __init__(self, runner: ModelRunner, cache: KVCacheManager, cfg: SchedulerConfig,
                 eos_ids: set[int], decode_tail: Callable[[list[int]], str] | None = None,
                 spec: "SpecWorker | None" = None, grammar: GrammarBackend | None = None):
        self.runner = runner
        self.device = runner.device
        self.cache = cache
        self.cfg = cfg
        self.eos_ids = eos_ids
        self.decode_tail = decode_tail
        self.sampler = Sampler()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.num_retractions = 0
        self.num_preemptions = 0
        self.forward_count = {m: 0 for m in ForwardMode}
        self.spec = spec
        self.grammar = grammar                    # constrained decoding (None: off)
        self.accept_hist: dict[int, int] = {}     # accepted drafts per verify -> count
        self.spec_idle = self.spec_batch = 0      # the latest proposal's streak of empty budgets, its batch
        self.batch_log = BatchLog(cfg.decode_log_interval)
        # PD prefill side: called after each forward that computed prompt rows of a request that
        # hands off (`Req.hands_off`), with the rows' first position, before any leave a window.
        self.on_prompt_rows: Callable[[Req, int], None] | None = None
        self._shapes: Shapes | None = None

    # ---- queue ------------------------------------------------------------------------------
    def add_request(self, req: Req) -> bool:
        """Queue `req` (a constrained one's grammar starts compiling: it waits in the queue until
        that is done); False when it ended at once (max_new_tokens 0, or a grammar and no grammar
        backend), for the caller to hand out. One that asks for hidden states with max_new_tokens 0
        runs its prompt (prefill only) and ends there."""
        if self.ends_at_once(req) or (req.params.grammar and not attach_grammar(req, self.grammar)):
            return False
        req.spec_idle, req.spec_batch = min(self.spec_idle, draft_pause.DARK_IDLE - 1), self.spec_batch
        draft_pause.back_off(req)
        enqueue(self.waiting, req, self.cfg.priority_scheduling, self.cfg.low_priority_first)
        return True

    @staticmethod
    def ends_at_once(req: Req) -> bool:
        """max_new_tokens 0 without hidden states: finished (length 0) before it is queued."""
        if req.params.max_new_tokens == 0 and not req.prefill_only:
            req.finished_reason = FINISH_LENGTH(0)
            return True
        return False

    def abort(self, rid: str) -> bool:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, FINISH_ABORT())
                    return True
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._finish(req, FINISH_ABORT())
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    @property
    def num_forwards(self) -> int:
        return sum(self.forward_count.values())

    def flush_cache(self) -> bool:
        return self.cache.flush()

    def close(self) -> None:
        """Stop the ranks that mirror this scheduler's forwards, if any."""
        self.runner.close()

    def load(self) -> SchedulerLoad:
        """The load and KV usage, for /metrics and /server_info."""
        cache, by_requests = self.cache, self.cache.num_slots - self.cache.available_tokens
        experts = self.runner.moe_token_counts(idle=not self.has_work())
        return SchedulerLoad(
            num_running_reqs=self.num_running, num_queue_reqs=len(self.waiting),
            num_used_tokens=by_requests, num_cached_tokens=max(0, cache.used_tokens - by_requests),
            max_total_num_tokens=cache.num_slots, num_retractions=self.num_retractions,
            num_preemptions=self.num_preemptions,
            spec_accept_hist=dict(self.accept_hist), moe_expert_tokens=experts,
            moe_rank_tokens=expert_rank_tokens(experts))

    @property
    def max_sequence_tokens(self) -> int:
        """Most prompt + output tokens one request can reach: the pool, unless its pages leave a
        sliding window as it goes (then prefill chunks and the window must fit, not the sequence)."""
        if self.cache.window is not None and self.cfg.chunked_prefill_size > 0:
            return sys.maxsize
        return self.cache.num_slots

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; returns the requests it advanced (new tokens, or finished)."""
        prefill = self._schedule_prefill()
        if prefill:
            self.batch_log.prefill(self, prefill)
            return self._run_prefill(prefill, self._mixed_decodes())
        if not self.running:
            return []
        before = sum(len(r.output_ids) for r in self.running)
        decoded = self._run_decode()
        self.batch_log.decode(self, sum(len(r.output_ids) for r in decoded) - before)
        return decoded

    def _schedule_prefill(self) -> list[tuple[Req, torch.Tensor, int]]:
        batch: list[tuple[Req, torch.Tensor, int]] = []
        deferred: list[Req] = []
        try:
            return self._fill_prefill_batch(batch, deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))   # they keep their place in the queue

    def _shares_prefix_in_batch(self, req: Req, batch) -> bool:
        """In-batch prefix caching (SGLang's rule): a request whose prompt shares at least
        IN_BATCH_PREFIX_MIN tokens with what a request of this batch computes now waits one step
        and then reads them from the prefix cache instead of computing them again."""
        if self.cache.radix.disabled or req.row is not None:
            return False
        ids = req.fill_ids
        for other, _, _ in batch:
            n = common_prefix_len(ids, other.fill_ids)
            if n - other.cached_len >= IN_BATCH_PREFIX_MIN:
                return True
        return False

    def _fill_prefill_batch(self, batch, deferred: list[Req]) -> list[tuple[Req, torch.Tensor, int]]:
        chunk = self.cfg.chunked_prefill_size
        budget = chunk if chunk > 0 else self.cfg.max_prefill_tokens
        if self.cfg.mixed_chunk:
            budget -= len(self.running)       # the decodes that join this forward
        while budget > 0:
            from_chunk = self.chunked is not None
            if from_chunk:
                req = self.chunked
            elif self.waiting and running_slot(self, self.waiting[0], batch):
                req = self.waiting[0]
                compiling = req.grammar is not None and not req.grammar.ready
                if compiling or self._shares_prefix_in_batch(req, batch):
                    deferred.append(self.waiting.popleft())
                    if len(deferred) >= self.cfg.max_running_requests:
                        break           # bounded work per step, however long the queue
                    continue
                if req.row is None and not self.cache.admit(req):
                    if preempt_for(self, req, batch, 0):      # a table row (and a running slot)
                        continue
                    break
            else:
                break
            remaining = req.prefill_end - req.kv_len
            if chunk <= 0 and batch and remaining > budget:
                self.cache.release(req)   # un-admit: a waiting request must not pin KV
                break                     # chunking is off: whole prompts only
            n = remaining if chunk <= 0 else min(remaining, budget)
            # Keep decode room for every running request so admitting this one cannot stall them
            # (one page each; a sliding-window request's room to fill its window).
            page = self.cache.allocator.page_size
            need = self.cache.pages_needed(req, n) * page
            fits = (from_chunk or slot_free(self, batch)) and self.cache.room(
                need, [(r, r.params.max_new_tokens - len(r.output_ids))
                       for r in self.running + [item[0] for item in batch]])
            slots = self.cache.alloc(req, n) if fits else None
            if slots is None:
                if preempt_for(self, req, batch, need, slot=not from_chunk):
                    continue              # their KV went to the prefix cache: try again
                if batch or self.running or self._held_by_others(req):
                    if not from_chunk:    # un-admit: a waiting request must not pin its cached
                        self.cache.release(req)   # prefix, or running ones cannot decode
                    break                 # wait for memory; the request keeps its place
                raise RuntimeError(f"request {req.rid} needs {n} KV slots but the pool holds "
                                   f"{self.cache.num_slots}; raise --max-total-tokens")
            if from_chunk:
                self.chunked = None
            else:
                self.waiting.popleft()
            batch.append((req, slots, n))
            budget -= n
            if n < remaining:
                self.chunked = req
                break
        return batch

    def _held_by_others(self, req: Req) -> bool:
        """Whether KV slots other than `req`'s are held outside the prefix cache while nothing runs:
        a PD decode server's reservations for prompts on their way (a request it preempted or
        retracted then waits for them to run, rather than failing for want of memory)."""
        return self.cache.available_tokens + self.cache.freed_by([req])[0] < self.cache.num_slots

    def _mixed_decodes(self) -> list[tuple[Req, torch.Tensor]]:
        """With --enable-mixed-chunk: each running request and the slot of its next token, when all
        of them fit (admission kept that room); else none, and they decode in the next step."""
        if not self.cfg.mixed_chunk or not self.running:
            return []
        page = self.cache.allocator.page_size
        if not self.cache.room(sum(self.cache.pages_needed(r, 1) for r in self.running) * page):
            return []
        return [(r, self.cache.alloc(r, 1)) for r in self.running]

    def _run_prefill(self, batch: list[tuple[Req, torch.Tensor, int]],
                     decoding: list[tuple[Req, torch.Tensor]] = ()) -> list[Req]:
        """One EXTEND forward over the prefill batch's chunks and, mixed in after them, the next
        token of each request in `decoding`. A request that resumes (Req.prefill_end) joins the
        running ones without sampling: its next decode step reads its last output token."""
        sched = [ScheduledReq(r.row, r.kv_len, r.fill_ids[r.kv_len:r.kv_len + n], slots,
                              logit_rows=int(r.kv_len + n == len(r.fill_ids))) for r, slots, n in batch]
        sched += [ScheduledReq(r.row, r.kv_len, [r.fill_ids[-1]], slots, logit_rows=1)
                  for r, slots in decoding]
        fb = self.runner.build_batch(ForwardMode.EXTEND, sched)
        logits = self.runner.forward(fb)
        self.forward_count[ForwardMode.EXTEND] += 1
        if self.spec is not None:       # every prompt row becomes draft context
            self.spec.inject(fb.aux_hidden, fb.positions, fb.out_cache_loc)
            draft_pause.recomputed(req for req, _, _ in batch)
        starts = list(accumulate((n for _, _, n in batch), initial=0))
        keep_hidden(fb, ((req, range(o, o + n)) for (req, _, n), o in zip(batch, starts)))
        keep_hidden(fb, ((req, [starts[-1] + j]) for j, (req, _) in enumerate(decoding)))
        collect_prompt_logprobs(self.runner.compute_logits, fb.final_hidden,
                                ((req, o, n) for (req, _, n), o in zip(batch, starts)))
        done, resumed = [], []
        for (req, _, n) in batch:
            req.kv_len += n
            if req.hands_off and self.on_prompt_rows is not None:
                self.on_prompt_rows(req, req.kv_len - n)
            self.cache.cache_prefix(req)
            self.cache.slide_window(req)
            if req.kv_len == req.prefill_end:
                (resumed if req.resumes else done).append(req)
        decoded = [req for req, _ in decoding]
        for req in decoded:
            req.kv_len += 1
            self.cache.slide_window(req)
        if done or decoded:
            self._sample_and_commit(done + decoded, logits)     # the logits rows' order
        self.running = ([r for r in self.running if not r.finished] + resumed
                        + [r for r in done if not r.finished])
        return done + decoded

    def _run_decode(self) -> list[Req]:
        """One DECODE step; with DSpark, one VERIFY step: speculating requests score their
        anchor + drafts, the others their next token, in the same forward."""
        draft_pause.wake(self.spec, self.running)
        speculating = ensure_decode_memory(self, {r for r in self.running if self._speculates(r)})
        spec_reqs = [r for r in self.running if r in speculating]
        props = {}
        if spec_reqs and not self.spec.may_pay(spec_reqs, len(self.running) - len(spec_reqs)):
            spec_reqs = []      # no draft pass: in this batch even drafts sure to pass would not pay
        if spec_reqs:
            self.spec.flush()               # context kept back: owed whether or not drafting pays
            t0 = time.perf_counter()
            proposals = self.spec.propose(spec_reqs, len(self.running) - len(spec_reqs))
            self.spec.observe_draft(time.perf_counter() - t0, len(spec_reqs))
            for r, p in zip(spec_reqs, proposals):
                cut_drafts(r, p)            # drafts a grammar rejects are not verified
                if self.spec.backs_off:
                    self._note_verify_budget(r, p.verify_len)
                if p.verify_len:            # a request verifying nothing decodes as plain ones do
                    props[r] = p
        t0 = time.perf_counter()
        toks_of = [[req.fill_ids[-1]] + (p.tokens[:p.verify_len] if (p := props.get(req)) else [])
                   for req in self.running]
        slots_of = self.cache.alloc_decode([(r, len(t)) for r, t in zip(self.running, toks_of)])
        sched = []
        for req, toks, slots in zip(self.running, toks_of, slots_of):
            assert slots is not None, "decode memory was reserved"
            sched.append(ScheduledReq(req.row, req.kv_len, toks, slots, logit_rows=len(toks)))
        mode = ForwardMode.VERIFY if props else ForwardMode.DECODE
        fb = self.runner.build_batch(mode, sched)
        with self.runner.taps(bool(props) or not draft_pause.all_dark(self.spec, self.running)):
            logits = self._verify_forward(fb, sched) if props else self.runner.forward(fb)
        self.forward_count[mode] += 1
        reqs = list(self.running)
        if not props:
            self._inject_rows(fb, [(req, [i]) for i, req in enumerate(reqs)], ())
            keep_hidden(fb, ((req, [i]) for i, req in enumerate(reqs)))
            for req in reqs:
                req.kv_len += 1
            self.cache.slide_windows(reqs)
            self._sample_and_commit(reqs, logits)
            if self.spec is not None and not spec_reqs:    # (a step that drafted in vain is neither)
                self.spec.observe_plain(time.perf_counter() - t0, len(reqs))
        else:
            self._verify_and_commit(reqs, sched, props, fb, logits)
            self.spec.observe_cycle(time.perf_counter() - t0, len(reqs), len(props), fb.num_tokens)
        self.running = [r for r in self.running if not r.finished]
        return reqs

    def _speculates(self, req: Req) -> bool:
        # Penalties change the target distribution with every drafted token, logit_bias and
        # min_new_tokens move logits that verify (raw target logits) would not: plain decode.
        return (self.spec is not None and not req.sampling.has_penalty and not req.sampling.has_bias
                and not req.sampling.min_tokens_active
                and len(req.output_ids) + 1 < req.params.max_new_tokens
                and len(req.output_ids) >= req.spec_resume_at)

    def _note_verify_budget(self, req: Req, verify_len: int) -> None:
        """Drafting costs a draft pass even when the planner then verifies nothing: a request
        whose budget comes out 0 twice in a row backs off drafting, then goes dark (draft_pause.py;
        threshold / adaptive modes; full always verifies). The
        latest proposal's streak is kept, and a new request starts from it (add_request): a draft
        that does not pay on this traffic is not tried afresh at every request's first tokens."""
        self.spec_idle = req.spec_idle = 0 if verify_len > 0 else req.spec_idle + 1
        self.spec_batch = req.spec_batch = len(self.running)
        draft_pause.back_off(req)

    def _inject_rows(self, fb, groups: Iterable[tuple[Req, range | list[int]]], drafted) -> None:
        """The committed rows of this forward become draft context: at once where a request drafted
        in it (with every row kept back so far, in one projection); else they are kept back until
        some request drafts or leaves, so that steps in which none drafts (backed off, or a batch
        too large to pay) cost one batched projection instead of one each. Not under a sliding
        window, which may free the rows' pages meanwhile."""
        if self.spec is None:
            return
        later = self.cache.window is None and not self.cache.split
        groups = draft_pause.lit_groups(fb, list(groups)) if self.spec.backs_off else groups   # not dark ones
        rows = [i for _, r in groups for i in r]
        if rows:    # consecutive rows (one request's, or a whole batch's) as views
            i = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else torch.as_tensor(rows)
            self.spec.defer([a[i] for a in fb.aux_hidden], fb.positions[i], fb.out_cache_loc[i])
        if not later or any(req in drafted for req, _ in groups):
            self.spec.flush()

    def _release(self, req: Req) -> None:
        """A running request leaves (finished, aborted, retracted): its KV goes to the prefix
        cache, so the draft context kept back (its rows among them) is written first."""
        if self.spec is not None:
            self.spec.flush()
        self.cache.release(req)

    @torch.inference_mode()
    def _verify_forward(self, fb, sched: list[ScheduledReq]) -> VerifyLogits:
        """The VERIFY forward without the LM head: acceptance asks for the logits rows it reads,
        the ones after a rejection are skipped."""
        hidden = self.runner.hidden_states(fb)
        lens = [len(sr.tokens) for sr in sched]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        return VerifyLogits(self.runner.compute_logits, hidden, starts, lens)

    def _verify_and_commit(self, reqs: list[Req], sched: list[ScheduledReq], props: dict,
                           fb, logits: VerifyLogits) -> None:
        starts = logits.starts
        logits.masks = verify_masks(reqs, props)      # constrained rows verify the masked target
        plain = [i for i, r in enumerate(reqs) if r not in props]
        items = {i: (r, p.tokens[:p.verify_len], p.q_probs, first_rows(p.confidence, p.verify_len))
                 for i, r in enumerate(reqs) if (p := props.get(r)) is not None}
        verdicts = accept_batch(items, logits, plain)
        plain_out = (self.sampler.sample(torch.cat([logits.rows[i][:1] for i in plain]),
                                         [reqs[i].sampling for i in plain]) if plain else None)
        plain_pos = {i: j for j, i in enumerate(plain)}
        kept_rows: list[tuple[Req, range]] = []
        kept: list[int] = []
        results: list[tuple[Req, list[int], list[float], list, int | None]] = []
        for i, req in enumerate(reqs):
            if i not in items:
                j = plain_pos[i]
                toks, n_acc, accepted = [plain_out.next_token_ids[j]], 0, None
                lps = [plain_out.logprobs[j]] if req.params.return_logprob else []
                tops = [plain_out.top_logprobs[j] or []] if req.params.return_logprob else []
            else:
                n_acc, toks = verdicts[i]
                accepted = n_acc
                lps, tops = raw_logprobs(logits.rows[i][:n_acc + 1], toks, req.params)
                req.spec_verify_ct += 1
                req.spec_draft_token_num += len(items[i][1])
                self.accept_hist[n_acc] = self.accept_hist.get(n_acc, 0) + 1
            kept_rows.append((req, range(starts[i], starts[i] + n_acc + 1)))
            kept.append(n_acc + 1)
            alloc_end = req.kv_len + len(sched[i].tokens)
            req.kv_len += n_acc + 1
            self.cache.truncate(req, alloc_end)
            self.cache.slide_window(req)      # after the truncate: only committed tokens count
            results.append((req, toks, lps, tops, accepted))
        self._inject_rows(fb, kept_rows, props)
        keep_hidden(fb, kept_rows)
        self.runner.commit_verify(fb, kept)
        for req, toks, lps, tops, accepted in results:
            self._commit(req, toks, lps, tops, accepted)

    def _commit(self, req: Req, toks: list[int], lps: list[float], tops: list,
                accepted: int | None = None) -> None:
        """Append tokens one by one, stopping exactly where the request finishes; `accepted`:
        how many of them are verified drafts (None: not a verify). A prefill-only request
        (max_new_tokens 0 with hidden states) ends here."""
        if req.prefill_only:
            self._finish(req, FINISH_LENGTH(0))
            return
        taken = []
        for n, tok in enumerate(toks):
            req.output_ids.append(tok)
            req.sampling.observe(tok)
            taken.append(tok)
            if req.params.return_logprob:
                req.output_logprobs.append(lps[n])
                req.output_top_logprobs.append(tops[n])
            req.check_finished(self.eos_ids, self._tail_text(req))
            if req.finished:
                break
        if accepted is not None:               # drafts kept; a stop inside the block keeps fewer
            req.spec_accept_token_num += min(accepted, len(taken))
        if req.hands_off and not req.finished:
            req.finished_reason = FINISH_LENGTH(len(req.output_ids))
        if req.finished:
            if req.kv_len > len(req.fill_ids):    # stopped inside an accepted block: drop the
                end, req.kv_len = req.kv_len, len(req.fill_ids)   # KV of drafts after the stop
                self.cache.truncate(req, end)
            self._release(req)

    def _tail_text(self, req: Req) -> Callable[[int], str] | None:
        """Decodes the last k output tokens of `req` (stop strings need text), if a tokenizer is known."""
        if self.decode_tail is None:
            return None
        return lambda k: self.decode_tail(req.output_ids[-k:])

    def _sample_and_commit(self, reqs: list[Req], logits: torch.Tensor) -> None:
        out = self.sampler.sample(logits, [r.sampling for r in reqs], batch_mask(reqs))
        for i, r in enumerate(reqs):
            lp = r.params.return_logprob
            self._commit(r, [out.next_token_ids[i]], [out.logprobs[i]] if lp else [],
                         [out.top_logprobs[i] or []] if lp else [])

    def _finish(self, req: Req, reason: BaseFinishReason) -> None:
        req.finished_reason = reason
        self._release(req)

