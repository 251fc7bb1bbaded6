"""The scheduler process of the HTTP server: model + scheduler behind two ZMQ sockets.

Loop: block on the socket while idle (waking every second to notice a dead frontend), else drain
whatever arrived without blocking, run one `scheduler.step()`, and send what the requests it
advanced produced (plus aborts since the last step and the current load) as one BatchOut.
Messages are the dataclasses of `sparkserve/messages.py`. Any exception at start-up or inside a
step is reported as SchedulerFailed and ends the process: the frontend fails the requests it
holds, never hangs."""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

import zmq

from sparkserve.args import ServerArgs
from sparkserve.core.finish_reason import FINISH_ABORT
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.messages import (
    AbortReq,
    BatchOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    LoadReq,
    ReqOutput,
    SchedulerFailed,
    SchedulerLoad,
    SchedulerReady,
    ShutdownReq,
)
from sparkserve.scheduler.runtime import build_scheduler, context_length
from sparkserve.scheduler.scheduler import Scheduler

log = logging.getLogger("sparkserve.scheduler")

IDLE_POLL_MS = 1000
PARENT_CHECK_S = 1.0


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str, parent_pid: int) -> None:
    """Entry point of the spawned process (must stay importable at module level)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C goes to the frontend, which stops us
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.SNDHWM, 0)
    send.connect(send_addr)
    code, loop = 0, None
    try:
        loop = SchedulerLoop.build(args, recv, send, parent_pid)
        loop.run()
        loop.scheduler.runner.close()
    except BaseException as e:  # noqa: BLE001 - reported to the frontend, then the process exits
        if loop is None and isinstance(e, ValueError):   # a start-up check: its message says it all
            log.error("scheduler failed: %s", e)
        else:
            log.exception("scheduler failed")
        send.send_pyobj(SchedulerFailed(f"{type(e).__name__}: {e}", traceback.format_exc()))
        code = 1
    finally:
        send.close(linger=2000)
        recv.close(linger=0)
        ctx.term()
    sys.exit(code)


def req_output(req: Req, sent: int) -> ReqOutput:
    """What `req` produced since its first `sent` output tokens went out; its hidden rows once
    it finished (the only copy: the rows are large)."""
    out = ReqOutput(req.rid, req.output_ids[sent:], req.finished_reason, len(req.input_ids),
                    len(req.output_ids), req.cached_tokens, req.output_logprobs[sent:],
                    req.output_top_logprobs[sent:], req.spec_verify_ct, req.spec_draft_token_num,
                    req.spec_accept_token_num)
    rows = req.pop_hidden_states() if req.finished else None
    if rows is not None:
        out.hidden_states = rows[0].tolist()
        out.aux_hidden_states = None if rows[1] is None else rows[1].tolist()
    return out


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, recv: zmq.Socket, send: zmq.Socket, parent_pid: int):
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.parent_pid = parent_pid
        self.sent: dict[str, tuple[Req, int]] = {}   # rid -> (request, output tokens sent), while held
        self.pending: list[ReqOutput] = []   # outputs made outside a step (aborts)
        self.stopped = False

    @classmethod
    def build(cls, args: ServerArgs, recv: zmq.Socket, send: zmq.Socket, parent_pid: int) -> "SchedulerLoop":
        scheduler, cfg = build_scheduler(args, load_tokenizer_for(args))
        loop = cls(scheduler, recv, send, parent_pid)
        spec = None
        if scheduler.spec is not None:
            spec = {"draft_model_path": args.speculative_draft_model_path, **scheduler.spec.describe()}
        send.send_pyobj(SchedulerReady(
            pid=os.getpid(), vocab_size=cfg.vocab_size, context_length=context_length(args, cfg),
            max_total_num_tokens=scheduler.cache.num_slots, max_running_requests=args.max_running_requests,
            eos_token_ids=sorted(scheduler.eos_ids), architecture=cfg.architecture,
            bos_token_id=cfg.bos_token_id, max_sequence_tokens=scheduler.max_sequence_tokens,
            speculative=spec))
        return loop

    # ---- loop -------------------------------------------------------------------------------
    def run(self) -> None:
        last_check = time.monotonic()
        while not self.stopped:
            if time.monotonic() - last_check > PARENT_CHECK_S:
                last_check = time.monotonic()
                self._check_parent()
            for msg in self._receive(block=not self.scheduler.has_work()):
                self._handle(msg)
            if self.stopped:
                break
            outputs, self.pending = self.pending, []
            if self.scheduler.has_work():
                outputs += [self._output(req) for req in self.scheduler.step()]
            if outputs:
                self.send.send_pyobj(BatchOut(outputs, self.load()))

    def _output(self, req: Req) -> ReqOutput:
        _, sent = self.sent.pop(req.rid) if req.finished else self.sent[req.rid]
        if not req.finished:
            self.sent[req.rid] = (req, len(req.output_ids))
        return req_output(req, sent)

    def _receive(self, block: bool) -> list:
        msgs = []
        if block and not self.recv.poll(IDLE_POLL_MS):
            self._check_parent()
            return msgs
        while True:
            try:
                msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:            # frontend gone (killed): do not linger
            log.warning("frontend process exited; scheduler stops")
            self.stopped = True

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            req = Req(msg.rid, list(msg.input_ids), msg.params,
                      RequestSamplingState(msg.params, msg.input_ids, self.scheduler.eos_ids),
                      hidden_parts=[] if msg.return_hidden_states else None)
            if self.scheduler.add_request(req):
                self.sent[msg.rid] = (req, 0)
            else:
                self.pending.append(req_output(req, 0))
        elif isinstance(msg, AbortReq):
            held = self.sent.pop(msg.rid, None)
            if held is not None and self.scheduler.abort(msg.rid):
                held[0].finished_reason = FINISH_ABORT(msg.reason)
                self.pending.append(req_output(*held))
        elif isinstance(msg, FlushCacheReq):
            if self.scheduler.has_work():
                out = FlushCacheOut(msg.cid, False, "cannot flush the cache while requests are running")
            else:
                ok = self.scheduler.cache.flush()
                out = FlushCacheOut(msg.cid, ok, "" if ok else "the prefix cache is in use")
            self.send.send_pyobj(out)
        elif isinstance(msg, LoadReq):
            load = self.load()
            load.cid = msg.cid
            self.send.send_pyobj(load)
        elif isinstance(msg, ShutdownReq):
            for rid in list(self.sent):
                self.scheduler.abort(rid)
            self.sent.clear()
            self.stopped = True
        else:
            log.error("unknown message %r", type(msg).__name__)

    def load(self) -> SchedulerLoad:
        return scheduler_load(self.scheduler)


def scheduler_load(scheduler: Scheduler) -> SchedulerLoad:
    """The scheduler's load and KV usage, for /metrics and /server_info."""
    cache = scheduler.cache
    by_requests = cache.num_slots - cache.available_tokens
    return SchedulerLoad(
        num_running_reqs=scheduler.num_running, num_queue_reqs=len(scheduler.waiting),
        num_used_tokens=by_requests, num_cached_tokens=max(0, cache.used_tokens - by_requests),
        max_total_num_tokens=cache.num_slots, num_retractions=scheduler.num_retractions,
        spec_accept_hist=dict(scheduler.accept_hist))
