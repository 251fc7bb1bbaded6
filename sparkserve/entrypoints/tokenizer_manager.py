"""TokenizerManager: the frontend's side of the scheduler process.

Tokenizes, sends each sequence to the scheduler, and turns the scheduler's BatchOut messages into
per-request `SeqOut`s (text deltas cut at stop strings by OutputStream) on an asyncio queue per
request group. A group that stops being consumed (client gone, handler cancelled) aborts its
sequences at once, which frees their KV in the scheduler. Also: admission (--max-queued-requests),
request/reply control calls (load, flush), metrics hooks, shutdown and scheduler-death handling."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import zmq
import zmq.asyncio

from sparkserve.args import ServerArgs
from sparkserve.core.finish_reason import FINISH_ABORT, FINISH_MATCHED_STR, BaseFinishReason
from sparkserve.entrypoints.metrics import Metrics
from sparkserve.frontend.output_stream import OutputStream, stop_token
from sparkserve.frontend.prepare import Limits
from sparkserve.frontend.tokenizer import Tokenizer
from sparkserve.messages import (
    AbortReq,
    BatchOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    LoadReq,
    SchedulerFailed,
    SchedulerLoad,
    SchedulerReady,
    ShutdownReq,
)

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Admission refused: too many requests in flight (503 + Retry-After)."""


class Unavailable(Exception):
    """The server is shutting down or its scheduler is gone (503)."""


@dataclass
class SeqOut:
    """What one step produced for one sequence."""
    index: int
    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: BaseFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float = 0.0
    spec: tuple[int, int, int] = (0, 0, 0)    # verify cycles, drafts verified, drafts accepted
    hidden_states: list[list[float]] | None = None
    aux_hidden_states: list[list[float]] | None = None
    # prompt logprobs (logprob_start_len / echo), on the first output that carries them
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    input_logprob_ids: list[int] | None = None     # the prompt tokens they are of

    @property
    def error_status(self) -> int | None:
        """HTTP status when the sequence ended in an error (scheduler gone, shutdown)."""
        fr = self.finish_reason
        return fr.status_code if isinstance(fr, FINISH_ABORT) else None

    @property
    def error_message(self) -> str:
        fr = self.finish_reason
        return fr.message if isinstance(fr, FINISH_ABORT) else "aborted"


@dataclass
class _SeqState:
    seq: GenerateReq
    queue: asyncio.Queue
    stream: OutputStream | None
    created: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    prompt_counted: bool = False


class Submission:
    """The outputs of one request's sequences, in arrival order, until all are finished.
    Closing it (or abandoning its iterator) aborts the unfinished ones: their KV is freed now."""

    def __init__(self, tm: "TokenizerManager", seqs: Sequence[GenerateReq]):
        self.tm = tm
        self.count = len(seqs)
        self.open = {s.rid for s in seqs}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None   # --request-timeout

    async def __aiter__(self) -> AsyncIterator[SeqOut]:
        try:
            while self.open:
                out: SeqOut = await self.queue.get()
                if out.finish_reason is not None:
                    self.open.discard(out.rid)
                yield out
        finally:
            self.close()

    def close(self) -> None:
        """Synchronous, so it also works from a cancelled task."""
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.tm.inflight -= self.count
        for rid in self.open:
            if self.tm.states.pop(rid, None) is not None:
                self.tm.metrics.aborted.inc()
                try:
                    self.tm._send(AbortReq(rid, "client disconnected"))
                except Exception:  # noqa: BLE001 - best effort: the others must still be aborted
                    log.exception("cannot send the abort of %s", rid)
        self.open.clear()


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer: Tokenizer | None, ready: SchedulerReady,
                 send: zmq.Socket, recv: zmq.asyncio.Socket, metrics: Metrics,
                 process_failure: Callable[[], str | None]):
        self.args = args
        self.tokenizer = tokenizer
        self.info = ready
        # requests are checked against the longest sequence the scheduler can run (the pool, or
        # more when a sliding window frees pages as it goes), as the offline Engine does
        self.limits = Limits(ready.vocab_size, ready.context_length, ready.sequence_limit)
        self._send_sock = send               # plain (blocking-free: SNDHWM 0) so aborts never await
        self._recv_sock = recv
        self.metrics = metrics
        self._failure = process_failure      # why the scheduler process or a rank has ended, or None
        self.states: dict[str, _SeqState] = {}
        self.inflight = 0                    # sequences admitted and not yet returned
        self.capacity = (None if args.max_queued_requests is None
                         else ready.max_running_requests + args.max_queued_requests)
        # DP-attention groups a request may name (routed_dp_rank); 1 without DP attention
        self.dp_groups = args.parallel_config().dp_size
        self.load = SchedulerLoad(max_total_num_tokens=ready.max_total_num_tokens)
        self.dead: str | None = None         # why the scheduler is gone
        self.shutting_down = False
        self.on_fatal: Callable[[], None] = lambda: None
        self._calls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._token_cache: dict[int, tuple[str, bytes]] = {}

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watch_loop())]

    @property
    def healthy(self) -> bool:
        return self.dead is None and not self.shutting_down

    def begin_shutdown(self, message: str = "server is shutting down") -> None:
        """Refuse new work; end every in-flight sequence with an abort (503)."""
        self.shutting_down = True
        for rid in list(self.states):
            self._end(rid, FINISH_ABORT(message, 503))
            self._send(AbortReq(rid, message))

    def stop_scheduler(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.dead is None:
            self._send(ShutdownReq())

    # ---- generation ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.need_tokenizer().encode(text, add_special_tokens=True)

    def need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer (--skip-tokenizer-init or no tokenizer files): "
                             "send token ids")
        return self.tokenizer

    def check_capacity(self, count: int) -> None:
        """A request that could never be admitted is the client's error, not an overload."""
        if self.capacity is not None and count > self.capacity:
            raise ValueError(f"n: {count} sequences exceed what this server admits at once ({self.capacity}: "
                             f"--max-running-requests + --max-queued-requests)")

    def submit(self, seqs: Sequence[GenerateReq]) -> "Submission":
        """Admit and send `seqs` (raises Unavailable, Overloaded, or ValueError for a bad rid).
        Iterate the result for their outputs; `close()` it in every case (idempotent)."""
        if not self.healthy:
            raise Unavailable(self.dead or "server is shutting down")
        if self.capacity is not None and self.inflight + len(seqs) > self.capacity:
            self.metrics.rejected.inc()
            raise Overloaded(f"server is at capacity ({self.inflight} sequences in flight, "
                             f"--max-queued-requests {self.args.max_queued_requests}); retry later")
        rids = [s.rid for s in seqs]
        if len(set(rids)) != len(rids) or any(r in self.states for r in rids):
            raise ValueError(f"rid: {rids[0]!r} is already in use")
        sub = Submission(self, seqs)
        self.inflight += len(seqs)
        try:
            for s in seqs:
                stream = OutputStream(self.tokenizer, s.params) if self.tokenizer is not None else None
                self.states[s.rid] = _SeqState(s, sub.queue, stream)
                self._send(s)
        except BaseException:
            sub.close()                      # no state or admission left behind
            raise
        if self.args.request_timeout is not None:
            sub.timer = asyncio.get_running_loop().call_later(self.args.request_timeout, self._time_out, sub)
        return sub

    def _time_out(self, sub: Submission) -> None:
        """--request-timeout: the submission's unfinished sequences end with a 504 (a stream's
        error event) and the scheduler frees their KV."""
        message = f"request timed out after {self.args.request_timeout:g} s (--request-timeout)"
        for rid in list(sub.open):
            if rid in self.states:
                self._end(rid, FINISH_ABORT(message, 504))
                self._send(AbortReq(rid, "request timed out"))

    def abort(self, rid: str, message: str = "aborted by request") -> int:
        """Abort `rid` and its fanned-out children (rid-0, rid-1, ...); returns how many."""
        hits = [r for r in self.states
                if r == rid or (r.startswith(rid + "-") and r[len(rid) + 1:].replace("-", "").isdigit())]
        for r in hits:
            self._end(r, FINISH_ABORT(message))
            self._send(AbortReq(r, message))
        return len(hits)

    def abort_all(self, message: str = "aborted by request") -> int:
        return sum(self.abort(r, message) for r in list(self.states))

    # ---- control calls ------------------------------------------------------------------------
    async def get_load(self, timeout: float = 5.0) -> SchedulerLoad:
        if self.dead is None:
            try:
                self.load = await self._call(LoadReq, timeout)
            except (asyncio.TimeoutError, Unavailable):
                pass                               # the last known load is still an answer
        return self.load

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheOut:
        return await self._call(FlushCacheReq, timeout)

    async def _call(self, make, timeout: float):
        if self.dead is not None:
            raise Unavailable(self.dead)
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        self._send(make(cid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(cid, None)

    # ---- token strings (logprobs) -------------------------------------------------------------
    def token_piece(self, tid: int) -> tuple[str, bytes]:
        """(text, raw bytes) of one token as OpenAI's logprobs show it."""
        hit = self._token_cache.get(tid)
        if hit is None:
            raw = self.need_tokenizer().token_bytes(tid)
            hit = (raw.decode("utf-8", errors="replace"), raw)
            if len(self._token_cache) < 1 << 16:
                self._token_cache[tid] = hit
        return hit

    # ---- scheduler messages -------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        if self.dead is not None:
            return
        try:
            self._send_sock.send_pyobj(msg, zmq.NOBLOCK)
        except zmq.ZMQError as e:               # cannot happen with SNDHWM 0 unless the socket is gone
            log.error("cannot send %s to the scheduler: %s", type(msg).__name__, e)

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self._recv_sock.recv_pyobj()
            except zmq.ZMQError as e:                # socket gone: nothing more will arrive
                self._on_dead(f"lost the scheduler socket: {e}")
                return
            except Exception:  # noqa: BLE001 - e.g. a message that does not unpickle: skip it
                log.exception("cannot read a scheduler message")
                continue
            try:
                if isinstance(msg, BatchOut):
                    self._on_batch(msg)
                elif isinstance(msg, (SchedulerLoad, FlushCacheOut)):
                    if isinstance(msg, SchedulerLoad):
                        self.load = msg
                        self.metrics.set_load(msg)
                    fut = self._calls.pop(msg.cid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, SchedulerFailed):
                    log.error("scheduler failed: %s\n%s", msg.message, msg.traceback)
                    self._on_dead(f"scheduler failed: {msg.message}")
                else:
                    log.error("unexpected message from the scheduler: %r", type(msg).__name__)
            except Exception:  # noqa: BLE001 - one bad output must not stop every stream
                log.exception("error handling a scheduler message")

    async def _watch_loop(self) -> None:
        while self.dead is None:
            await asyncio.sleep(0.5)
            why = self._failure()
            if why is not None and self.dead is None:
                await asyncio.sleep(0.2)           # let a SchedulerFailed message land first
                if self.dead is None:
                    self._on_dead(why)

    def _on_dead(self, message: str) -> None:
        if self.dead is not None:
            return
        for rid in list(self.states):
            self._end(rid, FINISH_ABORT(message, 500))
        self.dead = message
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(Unavailable(message))
        if not self.shutting_down:
            log.error("%s; the server stops", message)
            self.on_fatal()

    def _on_batch(self, batch: BatchOut) -> None:
        self.load = batch.load
        self.metrics.set_load(batch.load)
        now = time.monotonic()
        for o in batch.outputs:
            st = self.states.get(o.rid)
            if st is None:
                continue                             # aborted here already
            finished = o.finished_reason
            text = ""
            if st.stream is not None:
                text = st.stream.push(o.new_token_ids, finished is not None, stop_token(finished))
                if st.stream.done and finished is None:  # stop string seen here first
                    finished = FINISH_MATCHED_STR(st.stream.matched_stop)
                    self._send(AbortReq(o.rid, "stop string"))
            self._metrics_step(st, o.new_token_ids, o.prompt_tokens, o.cached_tokens, now, finished)
            st.queue.put_nowait(SeqOut(st.seq.index, o.rid, text, list(o.new_token_ids), list(o.new_logprobs),
                                       list(o.new_top_logprobs), finished, o.prompt_tokens,
                                       o.completion_tokens, o.cached_tokens, now - st.created,
                                       (o.spec_verify_ct, o.spec_draft_token_num, o.spec_accept_token_num),
                                       o.hidden_states, o.aux_hidden_states, o.input_logprobs,
                                       o.input_top_logprobs, None if o.input_logprobs is None else
                                       st.seq.input_ids[max(0, st.seq.params.logprob_start_len):]))
            if finished is not None:
                del self.states[o.rid]

    def _end(self, rid: str, reason: FINISH_ABORT) -> None:
        """Finish `rid` here (abort, error): its consumer sees a final SeqOut with `reason`."""
        st = self.states.pop(rid, None)
        if st is None:
            return
        self.metrics.aborted.inc()
        st.queue.put_nowait(SeqOut(st.seq.index, rid, "", [], [], [], reason, len(st.seq.input_ids),
                                   st.num_tokens, 0, time.monotonic() - st.created))

    def _metrics_step(self, st: _SeqState, new_ids: list[int], prompt_tokens: int, cached: int,
                      now: float, finished: BaseFinishReason | None) -> None:
        m = self.metrics
        if not st.prompt_counted:
            st.prompt_counted = True
            m.prompt_tokens.inc(prompt_tokens)
            m.cached_tokens.inc(cached)
        if new_ids:
            st.num_tokens += len(new_ids)
            m.generation_tokens.inc(len(new_ids))
            if st.first_token is None:
                st.first_token = now
                m.ttft.observe(now - st.created)
            elif st.last_token is not None:
                gap = (now - st.last_token) / len(new_ids)
                for _ in new_ids:
                    m.itl.observe(gap)
            st.last_token = now
        if finished is not None:
            m.requests.inc()
            m.e2e.observe(now - st.created)
            if st.first_token is not None and st.num_tokens > 1:
                m.tpot.observe((st.last_token - st.first_token) / (st.num_tokens - 1))
