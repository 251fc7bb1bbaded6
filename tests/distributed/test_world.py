"""A process group closes for good: torch's lazy import of torch.distributed.nn (which binds
group.WORLD as default arguments) must not keep it, and its gloo threads, past
destroy_process_group(), where one of them aborts the interpreter's shutdown."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Fresh process: torch.distributed.nn is imported at most once per process.
SCRIPT = """
import os, socket, sys, time
import torch
import torch.distributed as dist
from sparkserve.distributed.world import init_world

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if n.startswith(("pt_gloo", "gloo"))]

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
init_world("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
# A thread names itself once it runs, so its name can lag its start.
deadline = time.monotonic() + 30
while not gloo_threads() and time.monotonic() < deadline:
    time.sleep(0.01)
assert gloo_threads(), "gloo runs threads of its own"
import torch.distributed._shard.sharded_tensor  # noqa: F401  (how torch reaches torch.distributed.nn)
dist.destroy_process_group()
print("left:", gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc (the thread list)")
def test_destroyed_group_leaves_no_gloo_threads():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "left: []" in res.stdout, res.stdout
