"""The processes of the ranks other than the driver (tensor, pipeline, expert parallel): started
by the offline Engine or by `sparkserve serve` on node 0 (whose scheduler process is the driver,
rank 0), or, on a node above 0, they are all that `sparkserve serve` runs there.

The process that starts them watches them while the engine starts: a rank that exits then (an
import error, an OOM kill, a user script without the `__main__` guard that spawn re-imports)
fails the start within moments, naming the rank, how it ended and the last error it printed,
instead of leaving the driver waiting for it in the rendezvous. Each rank's stderr passes through
this process (copied on as it comes), which keeps its tail for that message."""
from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Callable, Iterator

from sparkserve.args import ServerArgs

log = logging.getLogger("sparkserve.server")

STDERR_TAIL_BYTES = 16384
STARTING = "while the engine was starting"
EXIT_GRACE_S = 2.0        # how long an error that a rank's death may have caused waits for its exit
POLL_S = 0.02             # the driver's rendezvous waits look at the ranks this often
# What multiprocessing's spawn says when a rank re-imports a script that starts an Engine at import.
BOOTSTRAP_ERROR = "before the current process has finished its bootstrapping phase"
GUARD_HINT = ("Put the code that starts the Engine under `if __name__ == \"__main__\":` (spawn starts "
              "each rank by importing your script again, and the script started an Engine while being "
              "imported)")
OOM_HINT = ("SIGKILL is what the kernel's out-of-memory killer sends (see `dmesg`): give the ranks more "
            "memory, or need less (a smaller model or KV pool: --max-total-tokens, "
            "--mem-fraction-static)")


class RankDiedError(RuntimeError):
    """A rank process exited while the engine was starting."""


def _worker_main(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """A spawned rank's entry (torch imported there, not here)."""
    _name_process(f"sparkserve-r{rank}")
    from sparkserve.scheduler.rank_worker import run_worker
    run_worker(args, rank, parent_pid)


def _name_process(name: str) -> None:
    """The name `ps` and `top` show (Linux; at most 15 characters), so a rank can be told apart
    from the scheduler process and the other ranks."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a rank's stderr ---------------------------------------------------------------------------
class StderrTail:
    """A rank's stderr: a pipe whose text a thread copies on to this process' stderr as it comes,
    keeping the last few KiB to say what the rank printed before it died."""

    def __init__(self) -> None:
        self._out = os.dup(2)             # this process' stderr (fd 2 is the pipe while the rank starts)
        self.read_fd, self.write_fd = os.pipe()
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._pump, name="sparkserve-rank-stderr", daemon=True).start()

    def _pump(self) -> None:
        try:
            while chunk := os.read(self.read_fd, 65536):
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-STDERR_TAIL_BYTES]
                _write_all(self._out, chunk)
        finally:
            os.close(self.read_fd)
            os.close(self._out)
            self._closed.set()

    def text(self, wait: float = 0.0) -> str:
        """The tail so far; `wait`: up to that long for the rank's last words (its end of the
        pipe closes as it exits)."""
        self._closed.wait(wait)
        with self._lock:
            return self._tail.decode(errors="replace")


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):        # this process' stderr closed: the rank's text is dropped
        while data:
            data = data[os.write(fd, data):]


def _start_with_stderr(proc: mp.Process) -> StderrTail | None:
    """Start `proc` with its stderr going through a StderrTail. A spawned child inherits this
    process' fd 2 as it is when it starts (spawn's own bootstrap, which fails before any code of
    ours runs when a script lacks its `__main__` guard, writes there too), so fd 2 is the pipe for
    that moment only; what this process writes meanwhile goes on through the pipe as well."""
    try:
        tail = StderrTail()
    except OSError:                            # no stderr to copy to: start it plainly
        proc.start()
        return None
    resource_tracker.ensure_running()          # started now, it would keep the pipe open for good
    if sys.stderr is not None:
        sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(tail.write_fd, 2)
        proc.start()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(tail.write_fd)
    return tail


# ---- what a dead rank's end says ----------------------------------------------------------------
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
_ERROR_WORD = re.compile(r"\b(ERROR|CRITICAL|FATAL|error|fatal)\b|what\(\)")


def last_error(text: str, limit: int = 240) -> str | None:
    """The last exception a traceback in `text` ends with (with the indented lines that continue
    its message), else the last line that reports an error; whitespace collapsed, cut to `limit`
    (at a sentence's end where one is near)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[i]):
            return _short(" ".join([lines[i], *_continuation(lines[i + 1:])]), limit)
    found = next((ln for ln in reversed(lines) if _ERROR_WORD.search(ln)), None)
    return None if found is None else _short(found, limit)


def _continuation(lines: list[str]) -> Iterator[str]:
    for ln in lines:
        if ln and not ln[0].isspace():
            return
        yield ln


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 4]
    end = cut.rfind(". ")
    return (cut[:end + 1] if end > limit // 3 else cut) + " ..."


def describe_exit(rank: int, pid: int | None, exitcode: int, stderr: str, when: str = STARTING) -> str:
    """What to tell the user about a rank that ended `when`, and what to do about it."""
    if exitcode < 0:
        how = f"was killed by {_signal_name(-exitcode)} (signal {-exitcode})"
    else:
        how = f"exited with code {exitcode}"
    msg = f"rank {rank} (pid {pid}) {how} {when}"
    error = last_error(stderr)
    msg += f"; its last error: {error}" if error else "; it printed no error"
    if BOOTSTRAP_ERROR in " ".join(stderr.split()):
        msg += f"\n{GUARD_HINT}"
    elif exitcode == -signal.SIGKILL:
        msg += f"\n{OOM_HINT}"
    return msg


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# ---- the ranks of this node ----------------------------------------------------------------------
@dataclass
class RankProcess:
    rank: int
    proc: mp.Process
    stderr: StderrTail | None

    def failure(self, when: str = STARTING) -> str | None:
        """How the process ended, once it has (waits a moment for its last stderr)."""
        code = self.proc.exitcode
        if code is None:
            return None
        text = self.stderr.text(wait=1.0) if self.stderr else ""
        return describe_exit(self.rank, self.proc.pid, code, text, when)


class WorkerRanks:
    """The rank processes this process started (none on one rank), and the watch on them while
    the engine starts."""

    def __init__(self, ranks: list[RankProcess]):
        self.ranks = ranks
        self._stores: list = []            # the driver's rendezvous stores, alive as long as its groups

    def failure(self, when: str = STARTING) -> str | None:
        """The first rank that has exited, described; None while all run."""
        return next((why for r in self.ranks if (why := r.failure(when)) is not None), None)

    def wait_failure(self, timeout: float) -> str | None:
        """failure(), waiting up to `timeout` for a rank to exit (one whose death an error in the
        driver reports may not have been reaped yet)."""
        deadline = time.monotonic() + timeout
        while (why := self.failure()) is None and self.ranks and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return why

    @contextlib.contextmanager
    def watch_startup(self) -> Iterator[None]:
        """Around the driver's start-up in this process (the Engine's rank 0): its rendezvous
        waits and its gloo connects (the world, every group) give up as soon as a rank has
        died, and an error that a rank's death caused (gloo's "Connection closed by peer" in a
        collective) becomes a RankDiedError that names the rank. Start-up checks (ValueError:
        the flags) stay as they are: every rank makes them, the driver's message names the flag."""
        if not self.ranks:
            yield
            return
        from sparkserve.distributed import parallel_state as ps
        with ps.watch_rendezvous(ps.StartupWatch(self._watch_store, self._check_alive)):
            try:
                yield
            except (RankDiedError, ValueError):
                raise
            except Exception as e:
                why = self.wait_failure(EXIT_GRACE_S)
                if why is None:
                    raise
                raise RankDiedError(why) from e

    def _check_alive(self) -> None:
        if (why := self.failure()) is not None:
            raise RankDiedError(why)

    def _watch_store(self, store):
        """Rank 0's rendezvous store, watched; kept here, since torch's groups hold only its C++ side."""
        watched = watched_store(store, self.failure)
        self._stores.append(watched)
        return watched

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to leave (after the driver's stop), then terminate what remains."""
        procs = [r.proc for r in self.ranks]
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():                 # a stopped (hung) process does not act on SIGTERM
                p.kill()
                p.join(5)


def start_worker_ranks(args: ServerArgs) -> WorkerRanks:
    """One process per rank of this node but the driver (global rank 0). With one node and no
    --dist-init-addr, the ranks meet on a free port of 127.0.0.1 (set on `args`)."""
    cfg = args.parallel_config()
    if cfg.world_size == 1:
        return WorkerRanks([])
    if args.dist_init_addr is None:
        args.dist_init_addr = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    ranks = []
    for r in cfg.local_ranks():
        if r != 0:
            proc = ctx.Process(target=_worker_main, args=(args, r, os.getpid()), name=f"sparkserve-rank{r}",
                               daemon=True)
            ranks.append(RankProcess(r, proc, _start_with_stderr(proc)))
    return WorkerRanks(ranks)


def serve_worker_node(args: ServerArgs) -> int:
    """`sparkserve serve --node-rank N` (N > 0): this node's ranks only; node 0 serves HTTP."""
    ranks = start_worker_ranks(args)
    log.info("node %d: ranks %s joining %s", args.node_rank, args.parallel_config().local_ranks(),
             args.dist_init_addr)
    for r in ranks.ranks:
        r.proc.join()
    return max((r.proc.exitcode or 0 for r in ranks.ranks), default=0)


# ---- the driver's rendezvous ----------------------------------------------------------------------
def watched_store(inner, failure: Callable[[], str | None]):
    """Rank 0's rendezvous store (`inner`, the TCPStore the other ranks join) behind a store whose
    waits poll the keys and `failure` in turn, raising RankDiedError as soon as `failure` names a
    dead rank: the TCPStore's own waits block inside C++ for a key a dead rank never sets, for
    the whole timeout (the world's is a year)."""
    import torch.distributed as dist

    class WatchedStore(dist.Store):
        def _wait(self, keys: list[str], timeout: datetime.timedelta | None) -> None:
            limit = (timeout or inner.timeout).total_seconds()
            deadline = time.monotonic() + limit
            while not inner.check(keys):
                if (why := failure()) is not None:
                    raise RankDiedError(why)
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(f"keys {keys} not set after {limit:g}s")
                time.sleep(POLL_S)

        def set(self, key, value):
            inner.set(key, value)

        def get(self, key):
            self._wait([key], None)
            return inner.get(key)

        def wait(self, keys, timeout=None):
            self._wait(keys, timeout)

        def add(self, key, amount):
            return inner.add(key, amount)

        def compare_set(self, key, expected, desired):
            return inner.compare_set(key, expected, desired)

        def check(self, keys):
            return inner.check(keys)

        def delete_key(self, key):
            return inner.delete_key(key)

        def num_keys(self):
            return inner.num_keys()

    return WatchedStore()
