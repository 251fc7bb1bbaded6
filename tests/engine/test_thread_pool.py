"""The kernels' thread pool (kernels/thread_pool.cpp), seen through the kernels that use it:
splitting work over threads changes no result, an error inside a job reaches Python and leaves the
pool usable, a forked child gets working threads of its own, and an idle pool sleeps instead of
spinning."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from sparkserve.kernels import Q4_1, BlockWeight, load_extension, quant_linear


@pytest.fixture(scope="module")
def ext():
    e = load_extension()
    if e is None:
        pytest.fail("the C++ kernels did not build on this machine")
    return e


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def random_q4_1(n: int, k: int, seed: int = 0) -> BlockWeight:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[:, :, 2:4] = np.frombuffer(np.float16(-0.07).tobytes(), np.uint8)
    return BlockWeight(Q4_1, torch.from_numpy(raw.reshape(n, -1).copy()), k)


@pytest.mark.parametrize("m", [1, 5, 12])
def test_threads_change_no_result(ext, m):
    """Each output row is computed by one thread whatever the split: 1, 2 and 3 threads give
    bit-identical results (matrices of one chunk to thousands)."""
    n_threads = torch.get_num_threads()
    for n in (7, 576, 4099):
        w = random_q4_1(n, 576, seed=n)
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(n))
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(quant_linear(x, w))
        torch.set_num_threads(n_threads)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), n


def test_error_in_a_job_is_raised_and_the_pool_keeps_working(ext, two_threads):
    """A bad slot id found by a worker thread surfaces as a RuntimeError; the next job runs."""
    k_buf = torch.randn(16, 2, 16)
    v_buf = torch.randn(16, 2, 16)
    q = torch.randn(8, 4, 16)
    good = torch.randint(1, 16, (8, 10))
    bad = good.clone()
    bad[5, 3] = 99
    with pytest.raises(RuntimeError, match="slot id out of range"):
        ext.decode_attention(q, k_buf, v_buf, bad, [10] * 8, 0, 0, 0.25)
    out = ext.decode_attention(q, k_buf, v_buf, good, [10] * 8, 0, 0, 0.25)
    torch.set_num_threads(1)
    assert torch.equal(out, ext.decode_attention(q, k_buf, v_buf, good, [10] * 8, 0, 0, 0.25))


def _child(q) -> None:
    torch.set_num_threads(2)
    w = random_q4_1(4099, 576)
    x = torch.ones(1, 576)
    q.put(quant_linear(x, w).sum().item())


def test_forked_child_gets_its_own_workers(ext, two_threads):
    """The parent's workers do not exist in a forked child: the child must not wait for them."""
    w = random_q4_1(4099, 576)
    want = quant_linear(torch.ones(1, 576), w).sum().item()     # the parent's pool is running
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive, "the forked child hung in the thread pool"
    assert q.get(timeout=5) == want


def _pool_thread_states() -> dict[int, str]:
    """State letter (R running/runnable, S sleeping, ...) of each of the pool's worker threads
    (named sparkserve-pool; other threads of the test process are not the pool's business)."""
    states = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() != "sparkserve-pool":
                continue
        with open(f"/proc/self/task/{tid}/stat") as f:
            states[int(tid)] = f.read().rsplit(")", 1)[1].split()[0]
    return states


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_idle_pool_sleeps(ext, two_threads):
    """After a burst of jobs the workers spin briefly, then sleep: a quarter of a second later no
    thread but this one is running or waiting for a core (read from /proc, so a loaded machine,
    which slows a spinning thread, still shows it as runnable)."""
    w = random_q4_1(4099, 576)
    x = torch.randn(1, 576)
    for _ in range(50):
        quant_linear(x, w)
    time.sleep(0.25)
    assert _pool_thread_states(), "no pool workers found"
    for _ in range(5):
        busy = {t: s for t, s in _pool_thread_states().items() if s == "R"}
        assert not busy, f"pool workers still spinning while idle: {busy}"
        time.sleep(0.02)


def test_back_to_back_jobs_of_changing_sizes(ext, two_threads):
    """Hundreds of jobs in a row, their chunk counts changing every time (the case where a worker
    late for one job could take a chunk of the next): every output equals its one-thread value."""
    shapes = [(4099, 1), (7, 3), (1536, 1), (576, 5), (96, 1)]
    weights = [random_q4_1(n, 576, seed=n) for n, _ in shapes]
    xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for _, m in shapes]
    torch.set_num_threads(1)
    want = [quant_linear(x, w) for x, w in zip(xs, weights)]
    torch.set_num_threads(2)
    for i in range(400):
        k = i % len(shapes)
        assert torch.equal(quant_linear(xs[k], weights[k]), want[k]), (i, shapes[k])


def test_threads_held_up_do_not_hold_the_job(ext):
    """Each thread works through its own contiguous range of a job first (one stretch of the
    weights to stream), then takes what the others have left: with 8 threads on this machine's
    cores, most of them waiting for a core at any moment, the jobs still finish about as soon as
    the running threads can do all the work, and give the one-thread results. Waiting for every
    thread's own range instead takes a scheduler time slice per job."""
    w = random_q4_1(4099, 576)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(9))
    n = torch.get_num_threads()
    try:
        times = {}
        for t in (1, 8):
            torch.set_num_threads(t)
            want = quant_linear(x, w)
            start = time.perf_counter()
            for _ in range(200):
                assert torch.equal(quant_linear(x, w), want)
            times[t] = time.perf_counter() - start
    finally:
        torch.set_num_threads(n)
    assert times[8] < 4 * times[1] + 0.5, times


@pytest.mark.parametrize("first,policy,warns", [("torch", None, True), ("sparkserve", None, False),
                                                ("torch", "ACTIVE", False)])
def test_late_import_after_torch_is_reported(first, policy, warns):
    """OMP_WAIT_POLICY works only if set before torch loads OpenMP: sparkserve imported after torch,
    with no policy chosen, says so (torch's threads would spin beside the kernels'); imported first
    it sets PASSIVE, and a policy the user chose is theirs. ENV_DEFAULTS tells what sparkserve
    added (a launcher of other programs leaves it out of their environment)."""
    import subprocess
    import sys

    from test_quant_kernels import REPO
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    second = "sparkserve" if first == "torch" else "torch"
    code = f"import {first}, {second}, os; print(os.environ['OMP_WAIT_POLICY'], sparkserve.ENV_DEFAULTS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("torch was imported before sparkserve" in out.stderr) == warns, out.stderr
    value, added = out.stdout.strip().split(" ", 1)
    assert value == (policy or "PASSIVE")
    assert added == str({} if policy else {"OMP_WAIT_POLICY": "PASSIVE"})
