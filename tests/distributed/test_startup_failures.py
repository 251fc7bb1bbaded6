"""A rank that dies while the engine starts fails the start within seconds, naming the rank and
how it ended, instead of leaving the driver waiting for it in the rendezvous (which waited > 90 s,
silently): the Engine with rank 1 SIGKILLed as the kernel's OOM killer would, a user script
without the `__main__` guard (spawn re-imports it in the rank, which then fails), and `sparkserve
serve --tp-size 2` with rank 1 SIGKILLed. Each runs in a subprocess, so a hang is a timeout here."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import make_tiny_checkpoint
from server_harness import free_port

LIMIT_S = 30.0
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
ENGINE = "Engine(sys.argv[1], tp_size=2, num_threads=1, max_total_tokens=256)"
GUARDED = textwrap.dedent(f"""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # where it is stuck, when the test asks
    import rank1_dies
    from sparkserve import Engine
    if __name__ == "__main__":
        start = time.monotonic()
        try:
            {ENGINE}
        except Exception as e:
            print(f"RAISED {{type(e).__name__}} after {{time.monotonic() - start:.1f}}s: {{e}}", flush=True)
            sys.exit(3)
        print("STARTED", flush=True)
""")
# Imported by the driver script, so by rank 1 too (spawn imports the script again there): with
# RANK1_DIES_AFTER_SETS=N, rank 1 SIGKILLs itself right after its Nth write to the world's store
# past the rendezvous, each a gloo group's address (1: the world's, 2 and on: the groups'): its
# peers then have its address and connect to a process that is gone.
RANK1_DIES = textwrap.dedent("""
    import multiprocessing, os, signal
    SETS = int(os.environ.get("RANK1_DIES_AFTER_SETS", "0"))
    if SETS and multiprocessing.current_process().name == "sparkserve-rank1":
        import torch.distributed as dist
        from sparkserve.distributed import rendezvous
        join, done = rendezvous.join, []

        class DiesAfterSets(dist.Store):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def set(self, key, value):
                self.inner.set(key, value)
                done.append(key)
                if len(done) == SETS:
                    os.kill(os.getpid(), signal.SIGKILL)

            def get(self, key):
                return self.inner.get(key)

            def wait(self, keys, timeout=None):
                self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

            def add(self, key, amount):
                return self.inner.add(key, amount)

            def compare_set(self, key, expected, desired):
                return self.inner.compare_set(key, expected, desired)

            def check(self, keys):
                return self.inner.check(keys)

            def delete_key(self, key):
                return self.inner.delete_key(key)

            def num_keys(self):
                return self.inner.num_keys()

        rendezvous.join = lambda *a, **kw: DiesAfterSets(join(*a, **kw))
""")
UNGUARDED = f"import sys\nfrom sparkserve import Engine\nengine = {ENGINE}\nprint('STARTED', flush=True)\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def child_named(parent: int, name: str, timeout: float = LIMIT_S) -> int:
    """The pid of `parent`'s child whose process name (/proc/PID/comm) is `name`, once it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and comm == name:
                return int(pid)
        time.sleep(0.02)
    raise AssertionError(f"no child {name} of {parent} after {timeout}s")


def run(cmd: list[str], log, kill_rank1: bool = False, env: dict | None = None) -> tuple[int, float]:
    """(exit code, seconds from rank 1's kill, or from the start, to the exit); a run that does
    not end within LIMIT_S fails the test (and is killed), its message leading with where the
    process was stuck."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**ENV, **(env or {})})
    try:
        if kill_rank1:
            os.kill(child_named(proc.pid, "sparkserve-r1"), signal.SIGKILL)   # as an OOM kill does
        start = time.monotonic()
        try:
            code = proc.wait(LIMIT_S)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            pytest.fail(f"still running {LIMIT_S:.0f}s after rank 1 died (or the start); "
                        f"{where_stuck(proc, log)}", pytrace=False)
        return code, time.monotonic() - start
    finally:
        _kill_tree(proc)


def where_stuck(proc: subprocess.Popen, log) -> str:
    """The stacks of a running driver script (it dumps them on SIGUSR1), then its output before:
    the stacks first, since CI shows the head of a long failure message."""
    os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    text = output(log)
    at = min((i for i in (text.find("Thread 0x"), text.find("Current thread 0x")) if i >= 0),
             default=len(text))
    stacks = text[at:] or "(no stacks: not a driver script that dumps them)"
    return f"where it was:\n{stacks}\n---- its output before ----\n{text[:at][-3000:]}"


def _kill_tree(proc: subprocess.Popen) -> None:
    """The process and the ranks it left (they leave within a second of their parent anyway)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def output(log) -> str:
    log.seek(0)
    return log.read()


@pytest.mark.parametrize("moment", ["named", "world", "group"])
def test_engine_rank_killed_during_startup(model, tmp_path, moment):
    """Rank 1 SIGKILLed as soon as it has its name, or right after it gave the driver its gloo
    address for the world (or for the third group): gloo's connect to it would then wait out the
    group's timeout (the world's is a year) without looking at the ranks."""
    script = tmp_path / "driver.py"
    script.write_text(GUARDED)
    (tmp_path / "rank1_dies.py").write_text(RANK1_DIES)
    sets = {"named": "0", "world": "1", "group": "3"}[moment]
    with open(tmp_path / "log", "w+") as log:
        code, took = run([sys.executable, str(script), model], log, kill_rank1=moment == "named",
                         env={"RANK1_DIES_AFTER_SETS": sets})
        out = output(log)
    assert code == 3, out
    line = next(ln for ln in out.splitlines() if ln.startswith("RAISED"))
    assert "RankDiedError" in line and "rank 1 " in line and "killed by SIGKILL (signal 9)" in line, out
    assert "out-of-memory" in out
    assert took < LIMIT_S


def test_engine_script_without_main_guard(model, tmp_path):
    """spawn runs the script again in rank 1 (as `__mp_main__`), which starts an Engine at import,
    which starts a process during spawn's bootstrap: RuntimeError, rank 1 exits 1."""
    script = tmp_path / "user_script.py"
    script.write_text(UNGUARDED)
    with open(tmp_path / "log", "w+") as log:
        code, took = run([sys.executable, str(script), model], log)
        out = output(log)
    assert code == 1 and "STARTED" not in out, out
    error = out[out.index("RankDiedError: "):]
    assert error.startswith("RankDiedError: rank 1 (pid ") and "exited with code 1" in error, out
    assert "bootstrapping phase" in error, out            # rank 1's own last error line
    assert 'Put the code that starts the Engine under `if __name__ == "__main__":`' in error, out


def test_serve_rank_killed_during_startup(model, tmp_path):
    cmd = [sys.executable, "-m", "sparkserve.cli", "serve", "--model-path", model, "--tp-size", "2",
           "--port", str(free_port()), "--num-threads", "1", "--max-total-tokens", "256",
           "--log-level", "warning"]
    with open(tmp_path / "log", "w+") as log:
        code, took = run(cmd, log, kill_rank1=True)
        out = output(log)
    assert code == 1, out
    assert "sparkserve: error: rank 1 (pid " in out and "killed by SIGKILL (signal 9)" in out, out
    assert took < LIMIT_S


def test_errors_a_dead_rank_caused_name_it():
    """In the driver, an error that follows a rank's death (gloo's "Connection closed by peer" in a
    collective) becomes a RankDiedError naming the rank; a flag check's ValueError, or an error
    while every rank runs, stays as it is."""
    import multiprocessing as mp

    from sparkserve.entrypoints.ranks import RankDiedError, RankProcess, WorkerRanks
    proc = mp.get_context("fork").Process(target=os._exit, args=(7,))
    proc.start()
    ranks = WorkerRanks([RankProcess(1, proc, None)])
    with pytest.raises(RankDiedError, match=r"^rank 1 \(pid \d+\) exited with code 7 while the engine was "
                                            r"starting; it printed no error$") as info:
        with ranks.watch_startup():
            raise RuntimeError("Connection closed by peer")
    assert str(info.value.__cause__) == "Connection closed by peer"
    with pytest.raises(ValueError, match="--tp-size 3"), ranks.watch_startup():
        raise ValueError("--tp-size 3: ...")
    alive = mp.get_context("fork").Process(target=time.sleep, args=(30,))
    alive.start()
    try:
        running = WorkerRanks([RankProcess(1, alive, None)])
        with pytest.raises(RuntimeError, match="^gloo$"), running.watch_startup():
            raise RuntimeError("gloo")
    finally:
        alive.kill()
        alive.join()
