"""A scheduler's side of prefill/decode disaggregation: where a request's prompt state lives, how
it is read and written as one process would hold it (through the runner under tensor/pipeline
parallel), and how a request whose prompt ran on another server joins the running batch: a row
and slots reserved first (reserve_prebuilt), the rows written, then decoding from the next step
(start_prebuilt). Scheduler inherits it; the PD schedulers (disaggregated.py) drive it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sparkserve.constrained.backend import attach_grammar
from sparkserve.core.pool import Pool
from sparkserve.core.req import Req
from sparkserve.mem.transfer import RequestPages, RequestRows, Rows
from sparkserve.scheduler.preemption import preempt_for

if TYPE_CHECKING:
    from sparkserve.scheduler.scheduler import Scheduler


class PromptHandover:
    def pools(self: "Scheduler") -> list[Pool]:
        """Every pool a request's state lives in: the model's, and the DSpark draft's KV."""
        return [self.runner.kv_pool] + (self.spec.draft_pools() if self.spec is not None else [])

    def request_pages(self: "Scheduler", req: Req, n: int) -> RequestPages:
        """Where the first n positions of a running request live."""
        slots = self.cache.req_to_token.table[req.row, :n].clone()
        swa = self.cache.full_to_swa[slots] if self.cache.full_to_swa is not None else None
        return RequestPages(slots, swa, req.row)

    def request_rows(self: "Scheduler", req: Req, n: int) -> RequestRows:
        """The first n positions of a running request's state, to send or to receive (PD)."""
        pools, pages, runner = self.pools(), self.request_pages(req, n), self.runner
        if self._shapes is None:
            self._shapes = runner.pool_shapes(pools)
        return RequestRows(pools, pages, lambda lo, state: runner.read_rows(pools, pages, lo, state),
                           lambda rows, lo, start: runner.write_rows(pools, pages, rows, lo, start),
                           self._shapes)

    def add_prebuilt(self: "Scheduler", req: Req, data: Rows) -> bool:
        """Decode side: `req`'s prompt ran elsewhere; `data` is every pool component's rows for
        it from position 0 (mem/transfer.py), and req.output_ids holds the token sampled there.
        The request decodes from its next step without computing the prompt. False when memory
        is short now (nothing held)."""
        start = self.reserve_prebuilt(req)
        if start is None:
            return False
        self.request_rows(req, len(req.input_ids)).write(data, 0, start)
        self.start_prebuilt(req)
        return True

    def reserve_prebuilt(self: "Scheduler", req: Req) -> int | None:
        """A row and slots for `req`'s whole prompt (a cached prefix is reused): the first
        position the other side must send, or None when memory is short now (nothing held).
        Under priority preemption a request short of memory preempts running ones it outranks,
        as a waiting one does for admission (preemption.py)."""
        while not self.cache.admit(req):
            if not preempt_for(self, req, (), 0, slot=False):
                return None
        n, start = len(req.input_ids), req.kv_len
        need = self.cache.pages_needed(req, n - start) * self.cache.allocator.page_size
        while n > start:
            running = [(r, r.params.max_new_tokens - len(r.output_ids)) for r in self.running]
            if self.cache.room(need, running) and self.cache.alloc(req, n - start) is not None:
                break
            if not preempt_for(self, req, (), need, slot=False):
                self.cache.release(req)
                return None
        req.kv_len = n
        return start

    def start_prebuilt(self: "Scheduler", req: Req) -> None:
        """The prompt's state is in place and req.output_ids holds the first token: decode."""
        for tok in req.output_ids:
            req.sampling.observe(tok)
        # Positions that had left the sender's sliding window arrived as padding: give them up
        # before the prefix cache takes the rest.
        self.cache.slide_window(req)
        self.cache.cache_prefix(req)
        # a constrained request's matcher replays the first token (its compile is waited for here)
        if req.params.grammar is None or attach_grammar(req, self.grammar):
            req.check_finished(self.eos_ids, self._tail_text(req))
        if req.finished:
            self.cache.release(req)
        else:
            self.running.append(req)
