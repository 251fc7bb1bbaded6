"""`sparkserve serve`: start the scheduler process (model + scheduler), wait until it is ready,
serve the HTTP app in this process (tokenizer, no model), and stop both cleanly. The processes
talk over ZMQ on ipc:// sockets. SIGTERM/SIGINT end in-flight requests with an error, stop the
scheduler and exit 0; a scheduler that dies fails in-flight requests (500) and the server exits 1.
A worker rank (tensor / pipeline parallel) that exits during start-up ends the start at once, exit
1, with a message naming the rank and its last error (entrypoints/ranks.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

import uvicorn
import zmq
import zmq.asyncio

import sparkserve
from sparkserve.args import ServerArgs
from sparkserve.entrypoints.http_server import create_app
from sparkserve.entrypoints.metrics import Metrics
from sparkserve.entrypoints.ranks import EXIT_GRACE_S, WorkerRanks, serve_worker_node, start_worker_ranks
from sparkserve.entrypoints.tokenizer_manager import TokenizerManager
from sparkserve.frontend.hf_export import served_tokenizer_path
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.loader.gguf_file import close_gguf
from sparkserve.messages import SchedulerFailed, SchedulerReady, ShutdownReq

log = logging.getLogger("sparkserve.server")

STARTUP_TIMEOUT_S = 600.0
GRACEFUL_SHUTDOWN_S = 5.0


class StartupFailed(Exception):
    pass


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (which re-raises SIGTERM after shutdown, so the
    process would die of the signal instead of exiting 0): serve() handles signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def launch_server(args: ServerArgs) -> int:
    """Run the server until SIGTERM/SIGINT (returns 0) or a scheduler failure (returns 1)."""
    if args.node_rank > 0:
        return serve_worker_node(args)
    try:
        return asyncio.run(serve(args))
    except StartupFailed as e:
        log.error("%s", e)
        print(f"sparkserve: error: {e}", flush=True)
        return 1


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupFailed(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(False)
    return sock


def _scheduler_main(args: ServerArgs, recv_addr: str, send_addr: str, parent_pid: int) -> None:
    """The spawned process' entry: the scheduler (and torch) are imported there, not here."""
    from sparkserve.scheduler.process import run_scheduler_process
    run_scheduler_process(args, recv_addr, send_addr, parent_pid)


class SchedulerProcess:
    """The scheduler process and the two sockets to it (send: plain, so aborts never await)."""

    def __init__(self, args: ServerArgs):
        self.ipc_dir = tempfile.mkdtemp(prefix="sparkserve-")
        to_sched, from_sched = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.actx, self.sctx = zmq.asyncio.Context(), zmq.Context()
        self.recv = self.actx.socket(zmq.PULL)
        self.recv.bind(from_sched)
        self.send = self.sctx.socket(zmq.PUSH)
        self.send.setsockopt(zmq.SNDHWM, 0)
        self.send.bind(to_sched)
        self.proc = mp.get_context("spawn").Process(target=_scheduler_main, name="sparkserve-scheduler",
                                                    args=(args, to_sched, from_sched,
                                                          os.getpid()), daemon=True)
        self.proc.start()

    async def wait_ready(self, stop: asyncio.Event, workers: WorkerRanks) -> SchedulerReady | None:
        """The scheduler's facts once its model is loaded; None when signalled meanwhile.
        StartupFailed when the scheduler fails, or a worker rank exits (the scheduler, rank 0,
        would wait for it in the rendezvous or a collective)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if stop.is_set():
                return None
            if await self.recv.poll(200):
                msg = await self.recv.recv_pyobj()
                if isinstance(msg, SchedulerReady):
                    return msg
                if isinstance(msg, SchedulerFailed):
                    raise StartupFailed(await self._failed(msg, workers))
                log.warning("unexpected message before ready: %r", type(msg).__name__)
            elif not self.proc.is_alive():
                raise StartupFailed(f"the scheduler process exited during start-up (code "
                                    f"{self.proc.exitcode})")
            elif (why := workers.failure()) is not None:
                raise StartupFailed(await self._worker_died(why))
        raise StartupFailed(f"the scheduler was not ready after {STARTUP_TIMEOUT_S:.0f}s")

    @staticmethod
    async def _failed(msg: SchedulerFailed, workers: WorkerRanks) -> str:
        """The scheduler's start-up error; when a worker rank has died, that first (the cause of
        the scheduler's gloo error), unless the scheduler's is a start-up check of the flags."""
        failed = f"the scheduler failed to start: {msg.message}"
        if msg.message.startswith("ValueError"):
            return failed
        why = await asyncio.to_thread(workers.wait_failure, EXIT_GRACE_S)
        return failed if why is None else f"{why} (then {failed})"

    async def _worker_died(self, why: str) -> str:
        """A worker rank's death, unless the scheduler reports a start-up check of the flags
        (which every rank makes: a worker that fails it may exit first)."""
        if await self.recv.poll(int(EXIT_GRACE_S * 1000)):
            msg = await self.recv.recv_pyobj()
            if isinstance(msg, SchedulerFailed) and msg.message.startswith("ValueError"):
                return f"the scheduler failed to start: {msg.message}"
        return why

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the process to exit (after ShutdownReq), then terminate or kill it."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("scheduler did not stop; terminating it")
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def close(self) -> None:
        self.recv.close(linger=0)
        self.send.close(linger=0)
        self.actx.term()
        self.sctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _load_frontend_tokenizer(args: ServerArgs):
    """(tokenizer or None, HF tokenizer directory for load generators or None). This process reads
    no weights, so a GGUF file's parse goes once the tokenizer is built (the scheduler's has its own)."""
    tokenizer = load_tokenizer_for(args)
    close_gguf(args.tokenizer_path)
    return tokenizer, served_tokenizer_path(args.tokenizer_path, tokenizer)


async def serve(args: ServerArgs) -> int:
    sock = bind(args.host, args.port)         # before the model loads: a busy port fails fast
    workers = start_worker_ranks(args)         # the driver is the scheduler process (rank 0)
    sched = SchedulerProcess(args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    state: dict[str, Any] = {"code": 0, "server": None, "tm": None, "failed": False}

    def on_signal(sig: int) -> None:
        log.info("received %s: shutting down", signal.Signals(sig).name)
        server, tm = state["server"], state["tm"]
        if server is not None and server.should_exit:
            server.force_exit = True               # second signal: stop waiting for connections
        if tm is not None:
            tm.begin_shutdown()
        if server is not None:
            server.should_exit = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    tokenizer_job = asyncio.ensure_future(asyncio.to_thread(_load_frontend_tokenizer, args))
    try:
        try:
            ready = await sched.wait_ready(stop, workers)
        except StartupFailed:
            state["failed"] = True      # nothing to wait for: the processes may be stuck in the rendezvous
            raise
        if ready is None:                           # signalled during start-up
            return 0
        try:
            tokenizer, tokenizer_dir = await tokenizer_job
        except Exception as e:  # noqa: BLE001 - reported as a start-up error
            raise StartupFailed(f"cannot load the tokenizer from {args.tokenizer_path}: "
                                f"{type(e).__name__}: {e}") from None
        tm = TokenizerManager(args, tokenizer, ready, sched.send, sched.recv, Metrics(args.served_model_name),
                              lambda: _process_failure(sched, workers))
        state["tm"] = tm
        return await _run_http(args, tm, tokenizer_dir, sock, stop, state)
    finally:
        if not tokenizer_job.done():
            tokenizer_job.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if state["tm"] is not None:
            state["tm"].stop_scheduler()
        else:
            with contextlib.suppress(zmq.ZMQError):
                sched.send.send_pyobj(ShutdownReq(), zmq.NOBLOCK)
        grace = 0.0 if state["failed"] else 10.0
        await asyncio.to_thread(sched.stop, grace)
        await asyncio.to_thread(workers.stop, grace)
        sock.close()
        sched.close()


def _process_failure(sched: SchedulerProcess, workers: WorkerRanks) -> str | None:
    """Why the server cannot serve any more: its scheduler process or one of its ranks has ended
    (an idle server notices too, instead of answering /health until the next request fails)."""
    if not sched.proc.is_alive():
        return f"scheduler process exited (code {sched.proc.exitcode})"
    why = workers.failure("while serving")
    return None if why is None else f"the scheduler lost a rank: {why}"


async def _run_http(args: ServerArgs, tm: TokenizerManager, tokenizer_dir: str | None, sock: socket.socket,
                    stop: asyncio.Event, state: dict[str, Any]) -> int:
    config = uvicorn.Config(create_app(args, tm, tokenizer_dir), log_config=None, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            timeout_keep_alive=5)
    server = _Server(config)
    state["server"] = server

    def fatal() -> None:
        state["code"] = 1
        server.should_exit = True
    tm.on_fatal = fatal
    tm.start()
    log.info("sparkserve %s serving %s on http://%s:%d (pid %d, scheduler pid %d)", sparkserve.__version__,
             args.served_model_name, args.host, args.port, os.getpid(), tm.info.pid)
    if stop.is_set():
        return 0
    await server.serve(sockets=[sock])
    return state["code"]
