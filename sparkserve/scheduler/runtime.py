"""Build everything one scheduler needs from ServerArgs: model, KV pool, cache, scheduler.
Used in-process by the offline Engine and inside the scheduler process of the server."""
from __future__ import annotations

import logging
import os

import torch

from sparkserve.args import ServerArgs
from sparkserve.config import ModelConfig
from sparkserve.executor.model_runner import ModelRunner
from sparkserve.frontend.tokenizer import Tokenizer
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.mem.kv_pool import uniform_window
from sparkserve.models.registry import load_config, load_model
from sparkserve.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


def context_length(args: ServerArgs, cfg: ModelConfig) -> int:
    return args.context_length or cfg.context_length


def kv_pool_tokens(args: ServerArgs, cfg: ModelConfig, per_token: int) -> int:
    if args.max_total_tokens:
        return args.max_total_tokens
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = int(ram * args.mem_fraction_static) // per_token
    # More than every running request at its largest live KV is wasted memory: the full context,
    # or with every layer windowed and chunked prefill, the window plus one chunk and two pages.
    per_request = context_length(args, cfg)
    window = uniform_window(cfg.layer_windows)
    if window is not None and args.chunked_prefill_size > 0:
        per_request = min(per_request, window + args.chunked_prefill_size + 2 * args.page_size)
    return max(args.page_size, min(tokens, args.max_running_requests * per_request))


def build_scheduler(args: ServerArgs, tokenizer: Tokenizer | None) -> tuple[Scheduler, ModelConfig]:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    cfg = load_config(args.model_path)
    model = load_model(args.model_path, cfg)
    per_token = model.pool_bytes_per_token()
    num_slots = kv_pool_tokens(args, cfg, per_token) // args.page_size * args.page_size
    ctx = context_length(args, cfg)
    num_rows = args.max_running_requests + 1
    pool = model.make_pool(num_slots, num_rows)
    no_radix = args.disable_radix_cache or getattr(model, "has_request_state", False)
    if no_radix and not args.disable_radix_cache:
        # A recurrent state summarises a whole prefix; it cannot be shared page by page.
        log.info("prefix cache off: %s keeps per-request recurrent state", cfg.architecture)
    cache = KVCacheManager(num_slots, args.page_size, num_rows, ctx + 1, no_radix,
                           window=getattr(pool, "window", None))   # pools that free pages leaving the window
    runner = ModelRunner(model, pool, cache.req_to_token.table)
    spec = build_dspark_worker(args, runner, num_slots, cache) if args.speculative_algorithm else None
    eos = set(tokenizer.eos_token_ids) if tokenizer else set(cfg.eos_token_ids)
    decode_tail = (lambda ids: tokenizer.decode(ids)) if tokenizer else None
    sched_cfg = SchedulerConfig(args.max_running_requests, args.chunked_prefill_size, args.max_prefill_tokens)
    log.info("KV pool: %d tokens (%.1f MiB), context %d", num_slots, num_slots * per_token / 2**20, ctx)
    return Scheduler(runner, cache, sched_cfg, eos, decode_tail, spec), cfg


def build_dspark_worker(args: ServerArgs, runner: ModelRunner, num_slots: int, cache: KVCacheManager):
    from sparkserve.models.dspark_draft import load_dspark_draft
    from sparkserve.speculative.dspark_worker import DSparkWorker
    from sparkserve.speculative.planner import StepCostTable, VerifyPlanner
    from sparkserve.speculative.profile import measure_step_costs
    path = args.speculative_draft_model_path or shipped_draft_path(args.model_path)
    draft = load_dspark_draft(path, runner.model)   # also sets the target's aux taps
    if args.speculative_dspark_block_size:
        draft.config.block_size = args.speculative_dspark_block_size
    thr = args.speculative_dspark_confidence_threshold
    mode = args.speculative_dspark_verify_mode or ("threshold" if thr is not None else "full")
    if mode != "full" and draft.confidence_head is None:
        raise ValueError(f"--speculative-dspark-verify-mode {mode} needs a draft with a confidence head "
                         f"(enable_confidence_head); {path} has none")
    costs = None
    if mode == "adaptive":
        costs = (StepCostTable.load(args.speculative_dspark_sps_table_path)
                 if args.speculative_dspark_sps_table_path
                 else measure_step_costs(runner, cache, max_tokens=args.max_running_requests * (draft.block_size + 1)))
    planner = VerifyPlanner(mode, thr or 0.0, costs)
    log.info("DSpark: draft %s, %d layers, gamma %d, verify mode %s", path, draft.config.num_hidden_layers,
             draft.block_size, mode)
    return DSparkWorker(draft, draft.new_kv_pool(num_slots), planner, cache.req_to_token.table)


def shipped_draft_path(model_path: str) -> str:
    """The DSpark draft this project ships for the embedded default model."""
    from sparkserve.loader.gguf_file import default_model_path
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "drafts", "smollm2-135m-instruct")
    if os.path.abspath(model_path) != os.path.abspath(default_model_path()) or not os.path.isdir(here):
        raise ValueError("--speculative-algorithm DSPARK needs --speculative-draft-model-path "
                         "(a draft is shipped only for the embedded default model)")
    return here
