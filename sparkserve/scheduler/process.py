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
from sparkserve.scheduler.data_parallel import DataParallelScheduler, build_driver_scheduler
from sparkserve.scheduler.disaggregated import DecodeScheduler, PrefillScheduler, disaggregated
from sparkserve.scheduler.req_outputs import OutputTracker, req_from_message, req_output
from sparkserve.scheduler.runtime import context_length
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
        loop.scheduler.close()
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


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler | DataParallelScheduler | PrefillScheduler | DecodeScheduler,
                 recv: zmq.Socket, send: zmq.Socket,
                 parent_pid: int):
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.parent_pid = parent_pid
        self.tracker = OutputTracker()       # requests held, with the output tokens sent so far
        self.pending: list[ReqOutput] = []   # outputs made outside a step (aborts)
        self.stopped = False

    @classmethod
    def build(cls, args: ServerArgs, recv: zmq.Socket, send: zmq.Socket, parent_pid: int) -> "SchedulerLoop":
        driver, cfg = build_driver_scheduler(args, load_tokenizer_for(args))
        scheduler = disaggregated(args, driver) if isinstance(driver, Scheduler) else driver
        loop = cls(scheduler, recv, send, parent_pid)
        spec = None
        if scheduler.spec is not None:
            spec = {"draft_model_path": args.speculative_draft_model_path, **scheduler.spec.describe()}
        send.send_pyobj(SchedulerReady(
            pid=os.getpid(), vocab_size=cfg.vocab_size, context_length=context_length(args, cfg),
            max_total_num_tokens=scheduler.cache.num_slots, max_running_requests=args.max_running_requests,
            eos_token_ids=sorted(scheduler.eos_ids), architecture=cfg.architecture,
            bos_token_id=cfg.bos_token_id, max_sequence_tokens=scheduler.max_sequence_tokens,
            speculative=spec, device=str(scheduler.device)))
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
                outputs += [self.tracker.output(req) for req in self.scheduler.step()]
            if outputs:
                self.send.send_pyobj(BatchOut(outputs, self.load()))

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
            req = req_from_message(msg, self.scheduler.eos_ids)
            if (self.scheduler.add_paired(req, msg.bootstrap) if self._paired(msg)
                    else self.scheduler.add_request(req)):
                self.tracker.hold(req)
            else:
                self.pending.append(req_output(req, 0))
        elif isinstance(msg, AbortReq):
            held = self.tracker.drop(msg.rid)
            if held is not None and self.scheduler.abort(msg.rid):
                held[0].finished_reason = FINISH_ABORT(msg.reason)
                self.pending.append(req_output(*held))
        elif isinstance(msg, FlushCacheReq):
            if self.scheduler.has_work():
                out = FlushCacheOut(msg.cid, False, "cannot flush the cache while requests are running")
            else:
                ok = self.scheduler.flush_cache()
                out = FlushCacheOut(msg.cid, ok, "" if ok else "the prefix cache is in use")
            self.send.send_pyobj(out)
        elif isinstance(msg, LoadReq):
            load = self.load()
            load.cid = msg.cid
            self.send.send_pyobj(load)
        elif isinstance(msg, ShutdownReq):
            for rid in self.tracker.rids():
                self.tracker.drop(rid)
                self.scheduler.abort(rid)
            self.stopped = True
        else:
            log.error("unknown message %r", type(msg).__name__)

    def _paired(self, msg: GenerateReq) -> bool:
        """A request the PD router paired, on a disaggregated server (else it runs colocated)."""
        return msg.bootstrap is not None and isinstance(self.scheduler, (PrefillScheduler, DecodeScheduler))

    def load(self) -> SchedulerLoad:
        return self.scheduler.load()
