"""The processes of the ranks other than the driver (tensor, pipeline, expert parallel): started
by the offline Engine or by `sparkserve serve` on node 0 (whose scheduler process is the driver,
rank 0), or, on a node above 0, they are all that `sparkserve serve` runs there."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time

from sparkserve.args import ServerArgs

log = logging.getLogger("sparkserve.server")


def _worker_main(args: ServerArgs, rank: int, parent_pid: int) -> None:
    """A spawned rank's entry (torch imported there, not here)."""
    from sparkserve.scheduler.rank_worker import run_worker
    run_worker(args, rank, parent_pid)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker_ranks(args: ServerArgs) -> list[mp.Process]:
    """One process per rank of this node but the driver (global rank 0). With one node and no
    --dist-init-addr, the ranks meet on a free port of 127.0.0.1 (set on `args`)."""
    cfg = args.parallel_config()
    if cfg.world_size == 1:
        return []
    if args.dist_init_addr is None:
        args.dist_init_addr = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(args, r, os.getpid()), name=f"sparkserve-rank{r}",
                         daemon=True) for r in cfg.local_ranks() if r != 0]
    for p in procs:
        p.start()
    return procs


def stop_worker_ranks(procs: list[mp.Process], timeout: float = 10.0) -> None:
    """Wait for the ranks to leave (after the driver's stop), then terminate what remains."""
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


def serve_worker_node(args: ServerArgs) -> int:
    """`sparkserve serve --node-rank N` (N > 0): this node's ranks only; node 0 serves HTTP."""
    procs = start_worker_ranks(args)
    log.info("node %d: ranks %s joining %s", args.node_rank, args.parallel_config().local_ranks(),
             args.dist_init_addr)
    for p in procs:
        p.join()
    return max((p.exitcode or 0 for p in procs), default=0)
