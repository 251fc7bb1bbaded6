"""Scheduler: continuous batching over one model.

Each `step()` runs one forward: a prefill (EXTEND) batch when waiting requests fit (new ones
join between steps; long prompts go in chunks of --chunked-prefill-size), else one DECODE
step for every running request. When KV slots run out, the newest running requests are
retracted (their KV kept in the prefix cache) and recomputed later, never failed."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from sparkserve.executor.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.executor.sampler import Sampler
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.scheduler.req import Req


@dataclass
class StepOutput:
    """New tokens of one request after a step (empty for a prefill chunk)."""
    rid: str
    new_token_ids: list[int]
    finished_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 512       # <= 0: no chunking
    max_prefill_tokens: int = 4096


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: KVCacheManager, cfg: SchedulerConfig,
                 eos_ids: set[int], decode_tail: Callable[[list[int]], str] | None = None):
        self.runner = runner
        self.cache = cache
        self.cfg = cfg
        self.eos_ids = eos_ids
        self.decode_tail = decode_tail
        self.sampler = Sampler()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.num_retractions = 0
        self.forward_count = {m: 0 for m in ForwardMode}

    # ---- queue ------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, {"type": "abort"})
                    return True
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._finish(req, {"type": "abort"})
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        prefill = self._schedule_prefill()
        if prefill:
            return self._run_prefill(prefill)
        if self.running:
            return self._run_decode()
        return []

    def _schedule_prefill(self) -> list[tuple[Req, torch.Tensor, int]]:
        chunk = self.cfg.chunked_prefill_size
        budget = chunk if chunk > 0 else self.cfg.max_prefill_tokens
        batch: list[tuple[Req, torch.Tensor, int]] = []
        while budget > 0:
            from_chunk = self.chunked is not None
            if from_chunk:
                req = self.chunked
            elif self.waiting and len(self.running) + len(batch) < self.cfg.max_running_requests:
                req = self.waiting[0]
                if req.row is None and not self.cache.admit(req):
                    break
            else:
                break
            remaining = len(req.fill_ids) - req.kv_len
            if chunk <= 0 and batch and remaining > budget:
                break                     # chunking is off: whole prompts only
            n = remaining if chunk <= 0 else min(remaining, budget)
            # Keep one decode slot per running request so admitting this one cannot stall them.
            page = self.cache.allocator.page_size
            reserve = (len(self.running) + len(batch)) * page
            fits = self.cache.pages_needed(req, n) * page + reserve <= self.cache.available_tokens
            slots = self.cache.alloc(req, n) if fits else None
            if slots is None:
                if batch or self.running:
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

    def _run_prefill(self, batch: list[tuple[Req, torch.Tensor, int]]) -> list[StepOutput]:
        sched = [ScheduledReq(r.row, r.kv_len, r.fill_ids[r.kv_len:r.kv_len + n], slots,
                              want_logits=r.kv_len + n == len(r.fill_ids)) for r, slots, n in batch]
        fb = self.runner.build_batch(ForwardMode.EXTEND, sched)
        logits = self.runner.forward(fb)
        self.forward_count[ForwardMode.EXTEND] += 1
        done = []
        for (req, _, n) in batch:
            req.kv_len += n
            self.cache.cache_prefix(req)
            if req.kv_len == len(req.fill_ids):
                done.append(req)
        outputs = []
        if done:
            outputs = self._sample_and_commit(done, logits)
        for req in done:
            if not req.finished:
                self.running.append(req)
        return outputs

    def _run_decode(self) -> list[StepOutput]:
        self._ensure_decode_memory()
        sched = []
        for req in self.running:
            slots = self.cache.alloc(req, 1)
            assert slots is not None, "decode memory was reserved"
            sched.append(ScheduledReq(req.row, req.kv_len, [req.fill_ids[-1]], slots, True))
        fb = self.runner.build_batch(ForwardMode.DECODE, sched)
        logits = self.runner.forward(fb)
        self.forward_count[ForwardMode.DECODE] += 1
        for req in self.running:
            req.kv_len += 1
        reqs = list(self.running)
        outputs = self._sample_and_commit(reqs, logits)
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def _ensure_decode_memory(self) -> None:
        """Retract the newest requests until every running one can take one more token."""
        page = self.cache.allocator.page_size
        while True:
            need = sum(self.cache.pages_needed(r, 1) for r in self.running) * page
            if need <= self.cache.available_tokens or len(self.running) <= 1:
                return
            victim = self.running.pop()
            self.cache.release(victim)
            victim.num_retractions += 1
            self.num_retractions += 1
            self.waiting.appendleft(victim)

    def _sample_and_commit(self, reqs: list[Req], logits: torch.Tensor) -> list[StepOutput]:
        out = self.sampler.sample(logits, [r.sampling for r in reqs])
        results = []
        for i, req in enumerate(reqs):
            tok = out.next_token_ids[i]
            req.output_ids.append(tok)
            req.sampling.observe(tok)
            lps, tops = [], []
            if req.params.return_logprob:
                lps = [out.logprobs[i]]
                tops = [out.top_logprobs[i] or []]
                req.output_logprobs += lps
                req.output_top_logprobs += tops
            tail = (lambda n, r=req: self.decode_tail(r.output_ids[-n:])) if self.decode_tail else None
            req.check_finished(self.eos_ids, tail)
            if req.finished:
                self.cache.release(req)
            results.append(self._output(req, [tok], lps, tops))
        return results

    def _finish(self, req: Req, reason: dict) -> None:
        req.finished_reason = reason
        self.cache.release(req)

    @staticmethod
    def _output(req: Req, toks: list[int], lps: list[float], tops: list) -> StepOutput:
        return StepOutput(req.rid, toks, req.finished_reason, len(req.input_ids),
                          len(req.output_ids), req.cached_tokens, lps, tops)
