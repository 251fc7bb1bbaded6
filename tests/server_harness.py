"""Start `sparkserve serve` as a subprocess on a free port for HTTP tests (one per test module).

The server starts on construction and is waited for on first use of `.url`, so a test module can
load its reference Engine while the server loads its model. One torch thread per process and a
passive OpenMP wait policy keep the 2-core machine from stalling (research/stack.md)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

SERVER_THREADS = 1


# Ports for test servers come from below the kernel's ephemeral range (32768 and up on Linux, where
# every outgoing connection takes one), each pytest-xdist worker from its own block: a port handed
# out here cannot be taken by a connection or by a test of the other worker before its server binds.
_BLOCK = 3000
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_BASE = 20000 + _BLOCK * (_WORKER % 4)
_offset = [os.getpid() % _BLOCK]          # where this process starts in its block


def free_port() -> int:
    for _ in range(_BLOCK):
        port = _BASE + _offset[0]
        _offset[0] = (_offset[0] + 1) % _BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue                  # in use, or still closing: the next one
        return port
    raise RuntimeError(f"no free port in {_BASE}..{_BASE + _BLOCK - 1}")


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 180.0):
        self.port = free_port()
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.log = tempfile.NamedTemporaryFile(prefix="sparkserve-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sparkserve.cli", "serve", "--port", str(self.port),
               "--num-threads", str(SERVER_THREADS), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._ready = False

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Base URL, once /health answers 200 (raises with the server log if it never does)."""
        if not self._ready:
            self.wait_ready()
        return self.base

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        end = time.monotonic() + self.startup_timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during "
                                   f"start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    self._ready = True
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {self.startup_timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def rank_pids(self, scheduler_pid: int) -> list[int]:
        """The server's spawned children other than the scheduler (rank 0): the worker ranks."""
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == self.proc.pid and int(pid) != scheduler_pid and b"spawn_main" in cmd:
                out.append(int(pid))
        return out

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def remove_log(self) -> None:
        self.log.close()
        os.unlink(self.log.name)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode
