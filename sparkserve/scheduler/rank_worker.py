"""A rank other than the driver (tensor or pipeline parallel): it loads its shard and stage of
the model, sizes its KV pool with the others, and runs every forward the driver hands it
(ForwardMirror) until told to stop: it receives the previous stage's output, runs its layers, and
passes the result on (the last stage back to the driver); a first-stage rank also computes its
vocab slice of the logits the driver asks for. It schedules and samples nothing. Under DP
attention the first rank of each attention group but rank 0's drives its group instead: a
scheduler of its own, stepped by rank 0's commands (scheduler/data_parallel.py)."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from sparkserve.args import ServerArgs
from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.mirror import (
    commit_parts,
    report_moe_counts,
    run_worker_logits,
    run_worker_stage,
    taps_before,
)
from sparkserve.executor.pool_rows import COMMANDS, serve_rows
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.layers.moe import routed_token_counts
from sparkserve.models.causal_lm import CausalLM
from sparkserve.scheduler.data_parallel import run_dp_driver
from sparkserve.scheduler.runtime import build_scheduler, load_rank_model, rank_pool_sizes, request_rows

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
    if args.parallel_config().is_driver(rank):
        _run_group_driver(args, rank)
        return
    try:
        model, cfg = load_rank_model(args, rank)
    except ValueError as e:              # a start-up check of the flags; the driver reports it too
        log.error("%s", e)
        sys.exit(1)
    num_slots, swa_slots = rank_pool_sizes(args, cfg, model)
    pool = model.make_pool(num_slots, request_rows(args), swa_slots)
    log.info("rank %d ready: tp %d/%d, pp stage %d/%d (layers %d-%d), KV pool %d tokens", rank, ps.tp_rank(),
             ps.tp_size(), ps.pp_rank(), ps.pp_size(), model.layer_range.start, model.layer_range.stop - 1,
             num_slots)
    _mirror_driver(model, cfg.hidden_size, pool)


def _run_group_driver(args: ServerArgs, rank: int) -> None:
    """DP attention: this rank drives its attention group (a scheduler of its own, in step with
    the other groups')."""
    try:
        scheduler, _ = build_scheduler(args, load_tokenizer_for(args), rank)
    except ValueError as e:
        log.error("%s", e)
        sys.exit(1)
    log.info("rank %d ready: drives DP attention group %d/%d (%d ranks), KV pool %d tokens", rank,
             ps.dp_rank(), ps.dp_size(), ps.tp_size(), scheduler.cache.num_slots)
    run_dp_driver(scheduler)


def _mirror_driver(model: CausalLM, hidden_size: int, pool) -> None:
    """Run every forward the driver hands this rank, until it says stop."""
    last: ForwardBatch | None = None
    with torch.inference_mode():
        while (msg := ps.broadcast_object()) is not None:
            if msg[0] == "commit":
                commit_parts(model.commit_verify, last, msg[1])
                continue
            if msg[0] == "moe_counts":
                report_moe_counts(routed_token_counts(model))
                continue
            if msg[0] in COMMANDS:
                serve_rows(msg, pool)
                continue
            if msg[0] == "logits":          # only the first stage keeps (a slice of) the LM head
                if model.has_lm_head:
                    run_worker_logits(model.compute_logits, msg[1], hidden_size)
                continue
            _, wire, aux_ids, bounds = msg
            last = ForwardBatch(**wire, kv_pool=pool)
            if model.aux_layer_ids != aux_ids:
                model.set_aux_layers(aux_ids)
            taps_in = taps_before(aux_ids, model.layer_range.start)
            run_worker_stage(model, last, bounds, taps_in, hidden_size)
    ps.destroy()

