"""The two halves of a disaggregated server (SGLang's --disaggregation-mode prefill|decode), each
wrapping a Scheduler and offering what the scheduler process uses of one.

A request the router paired carries a Bootstrap: the prefill server's bootstrap address and a
room id that both servers got. The decode server reserves a row and slots for the prompt (its
prefix cache counts) and tells the prefill server, through the transfer backend, which position
it needs from; the prefill server waits for that reservation, runs the prompt, sends each chunk's
rows of every pool component as the chunk runs (Scheduler.on_prompt_rows), then the request-row
state and the first token's result, and ends the request there (Req.hands_off). The decode
server writes the rows into its reservation and decodes from the next step (start_prebuilt).

Each side waits for the other at most --disaggregation-bootstrap-timeout seconds from the last
word it heard (the prefill side says it is alive every HEARTBEAT_S while it holds a room), and a
room either side gives up is told to the other, so a dead or hung peer fails the request with a
clear error and both sides free every slot. A request without a Bootstrap runs colocated."""
from __future__ import annotations

import logging
import time
from collections import deque

from sparkserve.args import ServerArgs
from sparkserve.core.finish_reason import FINISH_ABORT, FINISH_LENGTH
from sparkserve.core.req import Req
from sparkserve.disaggregation.auth import derive
from sparkserve.disaggregation.backend import (
    Arrived,
    Cancelled,
    DecodeTransfer,
    Failed,
    Heard,
    PeerGone,
    PrefillTransfer,
    Reservation,
    decode_transfer,
    prefill_transfer,
)
from sparkserve.mem.transfer import check_shapes
from sparkserve.messages import Bootstrap, SchedulerLoad
from sparkserve.scheduler.scheduler import Scheduler
from sparkserve.scheduler.waiting_queue import urgency

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
POLL_IDLE_MS = 10        # wait for the peer this long per loop when there is nothing to run
MAX_UNCLAIMED_RESERVATIONS = 4096   # a peer cannot make this side hold reservations without bound


class _Paired:
    """What both halves share: the wrapped Scheduler's interface."""

    def __init__(self, inner: Scheduler, timeout: float):
        self.inner = inner
        self.timeout = timeout
        self.eos_ids = inner.eos_ids
        self.device = inner.device
        self.spec = inner.spec
        self.cache = inner.cache
        self.max_sequence_tokens = inner.max_sequence_tokens
        self.failed: list[Req] = []          # ended here outside a step: handed out by the next one

    def add_request(self, req: Req) -> bool:
        return self.inner.add_request(req)

    def flush_cache(self) -> bool:
        return self.inner.flush_cache()

    def _fail(self, req: Req, message: str, status: int) -> None:
        log.warning("request %s failed: %s", req.rid, message)
        req.finished_reason = FINISH_ABORT(message, status)
        self.failed.append(req)

    def _abort_failed(self, rid: str) -> bool:
        """Abort a request that failed here outside a step and waits in `failed` for the next
        one: the abort's output is then its last, and the step must not hand it out again (the
        scheduler loop, which dropped it at the abort, would not know it)."""
        for req in self.failed:
            if req.rid == rid:
                self.failed.remove(req)
                return True
        return False

    def _poll_ms(self) -> int:
        return 0 if self.inner.has_work() or self.failed else POLL_IDLE_MS

    def _step_inner(self) -> list[Req]:
        advanced = self.inner.step() if self.inner.has_work() else []
        failed, self.failed = self.failed, []
        return failed + advanced


class PrefillScheduler(_Paired):
    def __init__(self, inner: Scheduler, transfer: PrefillTransfer, timeout: float):
        super().__init__(inner, timeout)
        self.transfer = transfer
        self.waiting: dict[int, tuple[Req, float]] = {}           # room -> request without a reservation
        self.reserved: dict[int, tuple[Reservation, float]] = {}  # room -> reservation without a request
        self.cancelled: dict[int, float] = {}                     # rooms given up before their request came
        self.active: dict[Req, Reservation] = {}                  # running here, rows going out
        self.sent: dict[Req, int] = {}                            # positions sent so far
        self.gone: list[Req] = []                                 # decode side unreachable mid-step
        self.next_heartbeat = 0.0
        inner.on_prompt_rows = self._send_rows
        self.shapes = inner.runner.pool_shapes(inner.pools())     # what this side sends

    def add_paired(self, req: Req, boot: Bootstrap) -> bool:
        if Scheduler.ends_at_once(req):
            return False
        req.hands_off = True
        room = boot.room
        if room in self.cancelled:
            self._fail(req, f"the decode server gave up room {room} before this request came", 502)
        elif room in self.reserved:
            self._start(req, self.reserved.pop(room)[0])
        else:
            self.waiting[room] = (req, time.monotonic() + self.timeout)
        return True

    def _start(self, req: Req, res: Reservation) -> None:
        self.active[req] = res
        self.inner.add_request(req)

    def _drop(self, req: Req) -> Reservation | None:
        self.sent.pop(req, None)
        return self.active.pop(req, None)

    def _send_rows(self, req: Req, lo: int) -> None:
        """Rows from where the decode side stands: on the first chunk that includes positions this
        side had from its own prefix cache (`lo` is where the chunk's computed rows begin)."""
        res = self.active[req]
        first, self.sent[req] = self.sent.get(req, res.start), req.kv_len
        try:
            self.transfer.send_rows(res, self.inner.request_rows(req, req.kv_len), min(first, lo),
                                    last=req.kv_len == len(req.fill_ids))
        except PeerGone:
            self.gone.append(req)

    def abort(self, rid: str) -> bool:
        if self._abort_failed(rid):
            return True
        for room, (req, _) in self.waiting.items():
            if req.rid == rid:
                del self.waiting[room]
                self.cancelled[room] = time.monotonic() + self.timeout
                return True
        for req, res in self.active.items():
            if req.rid == rid:
                self._drop(req)
                self.transfer.send_failure(res, "the prefill request was aborted")
                return self.inner.abort(rid)
        return self.inner.abort(rid)

    def has_work(self) -> bool:
        """Also reads what decode servers sent: a reservation can come while this side is idle
        (the scheduler process asks at least once a second)."""
        self._handle(self.transfer.poll(0))
        return bool(self.inner.has_work() or self.waiting or self.reserved or self.cancelled or self.failed)

    def step(self) -> list[Req]:
        self._handle(self.transfer.poll(self._poll_ms()))
        self._expire()
        advanced = self._step_inner()
        for req in self.gone:
            self._drop(req)
            if not req.finished:
                self.inner.abort(req.rid)
            req.finished_reason = FINISH_ABORT("the decode server went away during the transfer", 502)
            if req not in advanced:
                advanced.append(req)
        self.gone = []
        for req in advanced:
            res = self._drop(req)
            if res is not None and req.finished:
                self._hand_over(req, res)
        return advanced

    def _hand_over(self, req: Req, res: Reservation) -> None:
        """The prompt's rows went out as it ran; now the first token's result."""
        if isinstance(req.finished_reason, FINISH_ABORT):
            self.transfer.send_failure(res, f"prefill failed: {req.finished_reason.message}")
            return
        result = {"output_ids": req.output_ids, "output_logprobs": req.output_logprobs,
                  "output_top_logprobs": req.output_top_logprobs, "rng": req.sampling.rng_state(),
                  "hidden": req.hidden_parts}
        try:
            self.transfer.send_result(res, result)
        except PeerGone:
            req.finished_reason = FINISH_ABORT("the decode server went away during the transfer", 502)

    def _handle(self, events: list[Reservation | Cancelled]) -> None:
        now = time.monotonic()
        for ev in events:
            if isinstance(ev, Reservation):
                try:
                    check_shapes(self.shapes, ev.shapes)
                except ValueError as e:
                    self.transfer.send_failure(ev, f"transfer error: {e}")
                    ev = Cancelled(ev.room, f"transfer error: {e}")
            if isinstance(ev, Reservation):
                if ev.room in self.cancelled:           # its request was aborted here already
                    self.transfer.send_failure(ev, "the prefill request was aborted")
                elif ev.room in self.waiting:
                    self._start(self.waiting.pop(ev.room)[0], ev)
                elif len(self.reserved) >= MAX_UNCLAIMED_RESERVATIONS and ev.room not in self.reserved:
                    self.transfer.send_failure(ev, f"transfer error: the prefill server holds "
                                                   f"{len(self.reserved)} reservations whose requests have "
                                                   "not come; is the router sending it requests?")
                else:
                    self.reserved[ev.room] = (ev, now + self.timeout)
                continue
            self.reserved.pop(ev.room, None)
            held = self.waiting.pop(ev.room, None)
            if held is not None:
                self._fail(held[0], f"the decode server gave up: {ev.message}", 502)
                continue
            for req, res in list(self.active.items()):
                if res.room == ev.room:
                    self._drop(req)
                    self.inner.abort(req.rid)
                    self._fail(req, f"the decode server gave up: {ev.message}", 502)
                    break
            else:
                self.cancelled[ev.room] = now + self.timeout

    def _expire(self) -> None:
        now = time.monotonic()
        for room, (req, deadline) in list(self.waiting.items()):
            if now > deadline:
                del self.waiting[room]
                self._fail(req, f"no decode server reserved room {room} within {self.timeout:g} s: is it up, "
                                "and does its router send it this server's bootstrap port?", 504)
        for room, (res, deadline) in list(self.reserved.items()):
            if now > deadline:
                del self.reserved[room]
                self.transfer.send_failure(res, f"the prefill server got no request for room {room} "
                                                f"within {self.timeout:g} s")
        self.cancelled = {room: t for room, t in self.cancelled.items() if now <= t}
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_S
            held = list(self.active.values()) + [res for res, _ in self.reserved.values()]
            for res in self.transfer.heartbeat(held):
                self.reserved.pop(res.room, None)
                for req, r in list(self.active.items()):
                    if r is res:
                        self._drop(req)
                        self.inner.abort(req.rid)
                        self._fail(req, "the decode server went away", 502)

    def load(self) -> SchedulerLoad:
        load = self.inner.load()
        load.num_queue_reqs += len(self.waiting)
        return load

    def close(self) -> None:
        self.inner.close()
        self.transfer.close()


class DecodeScheduler(_Paired):
    def __init__(self, inner: Scheduler, transfer: DecodeTransfer, timeout: float):
        super().__init__(inner, timeout)
        self.transfer = transfer
        self.vocab_size = inner.runner.model.config.vocab_size
        self.prealloc: deque[tuple[Req, Bootstrap, float]] = deque()   # waiting for memory here
        self.transferring: dict[int, tuple[Req, Bootstrap, float]] = {}

    def add_paired(self, req: Req, boot: Bootstrap) -> bool:
        if Scheduler.ends_at_once(req):
            return False
        cfg, i = self.inner.cfg, len(self.prealloc)
        while cfg.priority_scheduling and i and (urgency(self.prealloc[i - 1][0], cfg.low_priority_first)
                                                 < urgency(req, cfg.low_priority_first)):
            i -= 1                        # by priority, as the waiting queue (waiting_queue.enqueue)
        self.prealloc.insert(i, (req, boot, time.monotonic() + self.timeout))
        self._reserve()
        return True

    def _reserve(self) -> None:
        """Reserve, in arrival order (by priority under priority scheduling), for the requests
        memory now allows (preempting running ones they outrank under priority preemption)."""
        while self.prealloc:
            req, boot, deadline = self.prealloc[0]
            start = self.inner.reserve_prebuilt(req)
            if start is None:
                if time.monotonic() > deadline:
                    self.prealloc.popleft()
                    self._fail(req, f"no room for the prompt's {len(req.input_ids)} tokens on the decode "
                                    f"server within {self.timeout:g} s", 503)
                    continue
                return
            self.prealloc.popleft()
            self.transfer.reserve(boot, self.inner.request_rows(req, len(req.input_ids)), start)
            self.transferring[boot.room] = (req, boot, time.monotonic() + self.timeout)

    def abort(self, rid: str) -> bool:
        if self._abort_failed(rid):
            return True
        for item in list(self.prealloc):
            if item[0].rid == rid:
                self.prealloc.remove(item)
                return True
        for room, (req, boot, _) in list(self.transferring.items()):
            if req.rid == rid:
                self._give_up(room, "the client went away")
                return True
        return self.inner.abort(rid)

    def _give_up(self, room: int, message: str) -> Req:
        req, boot, _ = self.transferring.pop(room)
        self.transfer.cancel(boot, message)
        self.inner.cache.release(req)
        return req

    def has_work(self) -> bool:
        return bool(self.inner.has_work() or self.prealloc or self.transferring or self.failed)

    def step(self) -> list[Req]:
        arrived = []
        for ev in self.transfer.poll(self._poll_ms()):
            held = self.transferring.get(ev.room)
            if held is None:
                continue
            req, boot, _ = held
            if isinstance(ev, Heard):
                self.transferring[ev.room] = (req, boot, time.monotonic() + self.timeout)
            elif isinstance(ev, Arrived):
                del self.transferring[ev.room]
                if self._arrive(req, ev.result):
                    arrived.append(req)
            elif isinstance(ev, Failed):
                del self.transferring[ev.room]
                self.inner.cache.release(req)
                self._fail(req, ev.message, 502)
        now = time.monotonic()
        for room, (req, boot, deadline) in list(self.transferring.items()):
            if now > deadline:
                self._give_up(room, f"no word from the prefill server within {self.timeout:g} s")
                self._fail(req, f"the prefill server {boot.host}:{boot.port} did not answer for room {room} "
                                f"within {self.timeout:g} s", 504)
        self._reserve()
        return arrived + self._step_inner()

    def _arrive(self, req: Req, result: dict) -> bool:
        """Start decoding `req` from the prefill side's result; False (the request failed) when the
        result names tokens this model does not have."""
        if max(result["output_ids"]) >= self.vocab_size:
            self.inner.cache.release(req)
            self._fail(req, f"transfer error: the prefill server sent token ids outside this model's "
                            f"{self.vocab_size}: the two sides run different models", 502)
            return False
        req.output_ids = list(result["output_ids"])
        req.output_logprobs = list(result["output_logprobs"])
        req.output_top_logprobs = list(result["output_top_logprobs"])
        req.sampling.resume_rng(result["rng"])
        if req.hidden_parts is not None and result["hidden"] is not None:
            req.hidden_parts = list(result["hidden"])
        if req.prefill_only:
            self.inner.cache.release(req)
            req.finished_reason = FINISH_LENGTH(0)
            return True
        self.inner.start_prebuilt(req)
        return True

    def load(self) -> SchedulerLoad:
        load = self.inner.load()
        load.num_queue_reqs += len(self.prealloc) + len(self.transferring)
        return load

    def close(self) -> None:
        self.inner.close()
        self.transfer.close()


def disaggregated(args: ServerArgs, inner: Scheduler) -> Scheduler | PrefillScheduler | DecodeScheduler:
    """The scheduler a server with --disaggregation-mode runs (the plain one in null mode)."""
    mode, timeout = args.disaggregation_mode, args.disaggregation_bootstrap_timeout
    if mode == "null":
        return inner
    secret = args.disaggregation_secret()
    auth = None if secret is None else derive(secret)
    if mode == "prefill":
        transfer = prefill_transfer(args.disaggregation_transfer_backend, args.disaggregation_bootstrap_port,
                                    args.bootstrap_host, auth)
        return PrefillScheduler(inner, transfer, timeout)
    return DecodeScheduler(inner, decode_transfer(args.disaggregation_transfer_backend, auth), timeout)
