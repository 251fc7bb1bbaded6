"""What the serving benchmarks share about the servers they start: a free loopback port, the end of
a server's log, and waiting until it answers (or saying why it never did)."""
from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(proc: subprocess.Popen, n: int = 30) -> str:
    """The last `n` lines of the log a benchmark's server writes (`proc.log_path`)."""
    try:
        with open(proc.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `base`/v1/models answers; raises with the log's end when the server exits or times out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {proc.log_path}:\n"
                               f"{log_tail(proc)}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server did not come up in {timeout:.0f} s; log {proc.log_path}:\n{log_tail(proc)}")
