"""A tensor-parallel rank other than the driver: it loads its shard of the model, sizes its KV
pool as the driver says, and runs every forward the driver hands it (ForwardMirror) until told
to stop. It schedules nothing and samples nothing."""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from sparkserve.args import ServerArgs
from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed import parallel_state as ps
from sparkserve.scheduler.runtime import load_rank_model

log = logging.getLogger("sparkserve.worker")


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose launcher was killed must not linger in a collective."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_worker(args: ServerArgs, rank: int, parent_pid: int) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank{rank}: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    model, _ = load_rank_model(args, rank)
    num_slots, num_rows, swa_slots = ps.broadcast_object()
    pool = model.make_pool(num_slots, num_rows, swa_slots)
    log.info("rank %d ready: tp rank %d of %d, KV pool %d tokens", rank, ps.tp_rank(), ps.tp_size(),
             num_slots)
    with torch.inference_mode():
        while (wire := ps.broadcast_object()) is not None:
            batch = ForwardBatch(**wire, kv_pool=pool)
            model(batch.input_ids, batch.positions, batch)
    ps.destroy()
