"""PD disaggregation: orderings of a request's events that a server meets only by chance, forced
here. The prefill scheduler runs inside the real scheduler-process loop (scheduler/process.py)
with a real decode scheduler across a localhost ZMQ connection: the decode side reserves a room
and gives it up (its client left) before the prefill side has the room's request, and the prefill
server's frontend sends that request and its abort together (the client left there too). The
abort is the request's one output, no slot stays held on either side, and the loop serves the
next request as a plain engine does. (Before, the room's failure waited for the next step after
the abort had already dropped the request: the step handed out a request the loop no longer held,
and the scheduler process, and with it the server, ended on a KeyError.)"""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import zmq
from conftest import assert_no_kv_leak
from server_harness import free_port

from sparkserve import Engine
from sparkserve.core.finish_reason import FINISH_ABORT
from sparkserve.disaggregation.backend import decode_transfer, prefill_transfer
from sparkserve.frontend.prepare import params_list
from sparkserve.messages import AbortReq, BatchOut, Bootstrap, GenerateReq, ReqOutput, ShutdownReq
from sparkserve.scheduler.disaggregated import DecodeScheduler, PrefillScheduler
from sparkserve.scheduler.process import SchedulerLoop
from sparkserve.scheduler.req_outputs import req_from_message

KW = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=1024)
SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
IDS = list(range(5, 45))


class LoopUnderTest:
    """A SchedulerLoop around `scheduler` in a thread, fed and read through inproc sockets as
    the HTTP frontend does."""

    def __init__(self, scheduler: PrefillScheduler | DecodeScheduler):
        self.ctx = zmq.Context()
        self.to_loop, loop_recv = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        loop_send, self.from_loop = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        name = f"inproc://loop-{random.getrandbits(32)}"
        self.to_loop.bind(name + "-in")
        loop_recv.connect(name + "-in")
        self.from_loop.bind(name + "-out")
        loop_send.connect(name + "-out")
        self.loop = SchedulerLoop(scheduler, loop_recv, loop_send, os.getppid())
        self.error: BaseException | None = None
        self.sockets = [self.to_loop, loop_recv, loop_send, self.from_loop]

    def start(self) -> None:
        def run():
            try:
                self.loop.run()
            except BaseException as e:  # noqa: BLE001 - the test reports it
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def send(self, *msgs) -> None:
        for msg in msgs:
            self.to_loop.send_pyobj(msg)

    def outputs_until_finished(self, rid: str, timeout: float = 20.0) -> list[ReqOutput]:
        """Every output of `rid` until its finishing one (the loop must stay up meanwhile)."""
        got: list[ReqOutput] = []
        end = time.monotonic() + timeout
        while not (got and got[-1].finished_reason is not None):
            assert self.error is None, f"the scheduler loop failed: {self.error!r}"
            assert time.monotonic() < end, f"no finishing output for {rid}: {got}"
            if self.from_loop.poll(50):
                msg = self.from_loop.recv_pyobj()
                if isinstance(msg, BatchOut):
                    got += [o for o in msg.outputs if o.rid == rid]
        return got

    def stop(self) -> None:
        self.send(ShutdownReq())
        self.thread.join(10)
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def sides(tiny_dirs):
    """A prefill scheduler and a decode scheduler on their own engines, joined over tcp."""
    path = tiny_dirs["llama"]
    port = free_port()
    prefill_engine, decode_engine = Engine(path, **KW), Engine(path, **KW)
    prefill = PrefillScheduler(prefill_engine.scheduler, prefill_transfer("tcp", port), 30.0)
    decode = DecodeScheduler(decode_engine.scheduler, decode_transfer("tcp"), 30.0)
    yield prefill, decode, port, path
    decode.close()
    prefill.transfer.close()


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_request_and_abort_after_the_decode_side_gave_up(sides):
    prefill, decode, port, path = sides
    boot = Bootstrap("127.0.0.1", port, random.getrandbits(63))
    params = params_list(SP, 1)[0]
    msg = GenerateReq(f"r{boot.room}", list(IDS), params, bootstrap=boot)
    rd = req_from_message(msg, decode.eos_ids)
    assert decode.add_paired(rd, boot)               # the reservation goes out
    assert decode.abort(rd.rid)                      # the decode side's client left: its cancel follows
    # The prefill side reads both before its frontend's messages (has_work reads the channel).
    _wait(lambda: prefill.has_work() and boot.room in prefill.cancelled, "the cancel never came")
    loop = LoopUnderTest(prefill)
    loop.send(msg, AbortReq(msg.rid, "the client went away"))   # one batch: the request, then its abort
    loop.start()
    try:
        outs = loop.outputs_until_finished(msg.rid)
        assert len(outs) == 1 and outs[0].new_token_ids == [], outs
        reason = outs[0].finished_reason
        assert isinstance(reason, FINISH_ABORT) and reason.message == "the client went away", reason
        # The loop serves on: a plain request gets what a plain engine gives.
        want = Engine(path, **KW).generate(input_ids=IDS, sampling_params=SP)["output_ids"]
        loop.send(GenerateReq("plain", list(IDS), params))
        outs = loop.outputs_until_finished("plain")
        assert [t for o in outs for t in o.new_token_ids] == want
    finally:
        loop.stop()
    assert loop.error is None, repr(loop.error)
    assert not loop.thread.is_alive()
    assert not prefill.failed and not prefill.waiting and not prefill.active
    assert_no_kv_leak(prefill.inner.cache)
    decode.step()
    assert not decode.has_work()
    assert_no_kv_leak(decode.inner.cache)


# ---- the same at the scheduler: a failure waiting for the next step, then the request's abort ----

def _aborted_before_the_step(side: PrefillScheduler | DecodeScheduler, req) -> None:
    """The abort takes the failed request back (the loop hands out the abort's output), and the
    step does not hand it out again."""
    assert req in side.failed
    assert side.abort(req.rid)
    assert req not in side.step() and req not in side.failed


def test_prefill_abort_after_the_decode_side_gave_up(sides):
    """The prefill side holds the request when the decode side's reservation and its cancel come
    (the reservation starts the request, the cancel fails it); the request's abort comes before
    the next step."""
    prefill, decode, port, _ = sides
    boot = Bootstrap("127.0.0.1", port, random.getrandbits(63))
    msg = GenerateReq(f"r{boot.room}", list(IDS), params_list(SP, 1)[0], bootstrap=boot)
    rp, rd = req_from_message(msg, prefill.eos_ids), req_from_message(msg, decode.eos_ids)
    prefill.add_paired(rp, boot)
    decode.add_paired(rd, boot)
    decode.abort(rd.rid)
    _wait(lambda: prefill.has_work() and rp in prefill.failed, "the cancel never came")
    _aborted_before_the_step(prefill, rp)
    assert not prefill.active and not prefill.waiting
    assert_no_kv_leak(prefill.inner.cache)


def test_decode_abort_after_its_wait_for_memory_ran_out(tiny_dirs):
    """A request waiting for memory on the decode side fails (its timeout) when the next request
    comes; its abort comes before the next step."""
    engine = Engine(tiny_dirs["llama"], **{**KW, "max_total_tokens": 64})
    decode = DecodeScheduler(engine.scheduler, decode_transfer("tcp"), 0.2)
    try:
        port = free_port()
        reqs = []
        for i in range(3):
            boot = Bootstrap("127.0.0.1", port, i + 1)
            msg = GenerateReq(f"d{i}", list(IDS), params_list(SP, 1)[0])
            reqs.append(req_from_message(msg, decode.eos_ids))
            decode.add_paired(reqs[-1], boot)
            time.sleep(0.3 * (i == 1))
        _aborted_before_the_step(decode, reqs[1])
        for req in (reqs[0], reqs[2]):     # (the first has failed at the step: no prefill server answers)
            assert req.finished or decode.abort(req.rid)
        decode.step()
        assert not decode.has_work()
        assert_no_kv_leak(decode.inner.cache)
    finally:
        decode.close()
