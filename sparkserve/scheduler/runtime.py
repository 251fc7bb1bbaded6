"""Build everything one scheduler needs from ServerArgs: model, KV pool, cache, scheduler.
Used in-process by the offline Engine and inside the scheduler process of the server."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from sparkserve.args import ServerArgs
from sparkserve.config import ModelConfig
from sparkserve.constrained.backend import make_grammar_backend
from sparkserve.core.device import on_device
from sparkserve.core.device import resolve as resolve_device
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.mirror import ForwardMirror
from sparkserve.distributed.sharding import check_pp, check_tp
from sparkserve.executor.model_runner import ModelRunner
from sparkserve.frontend.tokenizer import Tokenizer
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.mem.kv_pool import split_windows, uniform_window
from sparkserve.mem.kv_quant import QUANT_KV_DTYPES, kv_dtype
from sparkserve.models.causal_lm import CausalLM
from sparkserve.models.registry import load_config, load_model, model_class
from sparkserve.priority_args import preemption_threshold
from sparkserve.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


def context_length(args: ServerArgs, cfg: ModelConfig) -> int:
    return args.context_length or cfg.context_length


def request_rows(args: ServerArgs) -> int:
    """Rows of the request table and of request_row pools: one per running request, plus one
    spare (the DSpark step-cost profile runs while nothing else does)."""
    return args.max_running_requests + 1


def pool_memory_budget(args: ServerArgs, device: torch.device) -> int:
    """Bytes the pools may take: --mem-fraction-static of the machine's RAM, or of the GPU's memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * args.mem_fraction_static)


def swa_tokens_cap(args: ServerArgs, cfg: ModelConfig) -> int | None:
    """Most windowed-layer slots a split pool can use (None: no split, or unbounded): every
    running request's window, one prefill chunk and two pages (chunking off: a whole prompt)."""
    split = split_windows(cfg.layer_windows)
    if split is None or args.chunked_prefill_size <= 0:
        return None
    return args.max_running_requests * (split[1] + args.chunked_prefill_size + 2 * args.page_size)


def pool_sizes(args: ServerArgs, cfg: ModelConfig, per_token: int, per_request: int = 0,
               per_swa_token: int = 0, device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """(KV slots, windowed-layer slots of a split pool or 0). KV slots: --max-total-tokens, else
    what the memory budget holds once every request row's fixed state (`per_request` bytes,
    e.g. linear-attention recurrent state) and the windowed layers' slots (`per_swa_token` bytes
    each, at most one per KV slot) are paid for, capped at what the running requests can use."""
    page = args.page_size
    swa_cap = swa_tokens_cap(args, cfg) if per_swa_token else None
    if args.max_total_tokens:
        tokens = args.max_total_tokens
    else:
        budget = pool_memory_budget(args, device)
        rows = request_rows(args)
        left = budget - rows * per_request
        if left < page * (per_token + per_swa_token):
            raise ValueError(
                f"--mem-fraction-static {args.mem_fraction_static} gives the pools {budget / 2**20:.1f} MiB, "
                f"but {rows} request rows (--max-running-requests {args.max_running_requests} + 1) of "
                f"{cfg.architecture} per-request state take {rows * per_request / 2**20:.1f} MiB "
                f"({per_request / 2**20:.2f} MiB each), leaving less than one KV page; raise "
                f"--mem-fraction-static, lower --max-running-requests, or set --max-total-tokens")
        if per_swa_token:         # windowed slots are bought first, at most one per KV slot
            swa = left // (per_token + per_swa_token)
            swa_cap = swa if swa_cap is None else min(swa, swa_cap)
            left -= swa_cap * per_swa_token
        tokens = left // per_token
        # More than every running request at its largest live KV is wasted memory: the full
        # context, or with every layer windowed and chunked prefill, the window plus one chunk
        # and two pages.
        per_seq = context_length(args, cfg)
        window = uniform_window(cfg.layer_windows)
        if window is not None and args.chunked_prefill_size > 0:
            per_seq = min(per_seq, window + args.chunked_prefill_size + 2 * page)
        tokens = max(page, min(tokens, args.max_running_requests * per_seq))
    tokens = tokens // page * page
    if not per_swa_token:
        return tokens, 0
    swa = tokens if swa_cap is None else min(tokens, swa_cap)
    return tokens, max(page, swa // page * page)


# SGLang's name: a context past the trained positions is refused unless the user says they mean it.
ALLOW_LONGER_CONTEXT = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def check_longer_context(context_length: int, cfg: ModelConfig, warn: bool) -> None:
    """A --context-length past the positions the model was trained for makes its rope extrapolate,
    and quality drops past them: refused (as SGLang and vLLM do) unless the environment allows it,
    then served with a warning (as llama.cpp's -c does)."""
    if os.environ.get(ALLOW_LONGER_CONTEXT, "").strip().lower() not in ("1", "true", "yes"):
        raise ValueError(f"--context-length {context_length} is past the {cfg.max_position_embeddings} "
                         f"positions {cfg.architecture} was trained for: lower it, or set "
                         f"{ALLOW_LONGER_CONTEXT}=1 to serve it anyway (the rope extrapolates, quality may "
                         f"drop past them)")
    if warn:
        log.warning("--context-length %d is past the %d positions %s was trained for: its rope "
                    "extrapolates, so quality may drop past them (%s is set)",
                    context_length, cfg.max_position_embeddings, cfg.architecture, ALLOW_LONGER_CONTEXT)


def load_rank_model(args: ServerArgs, rank: int) -> tuple[CausalLM, ModelConfig]:
    """This rank's model: threads and seed set, the world joined first when there are several
    ranks (layers take their shard of the weights as they are built)."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    cfg = load_config(args.model_path)
    if args.context_length:          # the rope tables (and LongRoPE's choice of factors) serve this
        if args.context_length > cfg.max_position_embeddings:
            check_longer_context(args.context_length, cfg, warn=rank == 0)
        cfg = dataclasses.replace(cfg, max_position_embeddings=args.context_length)
    pc = args.parallel_config()
    if rank == 0 and args.moe_a2a_backend != "none":
        log.info("MoE backend: %s (--moe-a2a-backend %s): tokens dispatched to their experts' ranks with "
                 "torch.distributed all-to-alls", pc.moe_a2a_backend, args.moe_a2a_backend)
    check_tp(cfg, args.tp_size, args.ep_size, model_class(cfg).tp_dims(cfg), pc.attn_tp_size,
             a2a=pc.moe_a2a_backend == "a2a")
    check_pp(cfg, args.pp_size, args.parallel_config().pp_layer_partition)
    if args.parallel_config().world_size > 1:
        ps.init_distributed(args.parallel_config(), rank, args.dist_init_addr, args.dist_timeout)
    device = model_device(args, cfg)
    model = load_model(args.model_path, cfg, activation_quant=args.activation_quant, device=device,
                       huge_pages=not args.disable_huge_pages)
    model.enable_native_step(not args.disable_native_step and device.type == "cpu")
    model.set_kv_cache_dtype(kv_cache_dtype(args, model))
    return model, cfg


def model_device(args: ServerArgs, cfg: ModelConfig) -> torch.device:
    """--device for this model: auto takes cuda only where the flags and the model allow it."""
    why_not = args.cuda_refusal()
    if why_not is None and "cuda" not in model_class(cfg).DEVICES:
        why_not = (f"with {cfg.architecture}: its layers run on {', '.join(model_class(cfg).DEVICES)} "
                   "so far; use --device cpu")
    device = resolve_device(args.device, why_not)
    if args.device == "auto" and device.type == "cpu" and why_not and torch.cuda.is_available():
        log.info("--device auto: cpu, since cuda %s", why_not)
    return device


def kv_cache_dtype(args: ServerArgs, model: CausalLM) -> torch.dtype:
    """--kv-cache-dtype as a dtype. auto: float16 for a GGUF checkpoint whose model can hold it,
    as llama.cpp caches the same file (a decode step's attention reads half the bytes); else
    float32, the compute dtype on CPU, as vLLM and SGLang keep the model's."""
    if args.kv_cache_dtype != "auto":
        return kv_dtype(args.kv_cache_dtype)
    gguf = args.model_path.endswith(".gguf") and torch.float16 in model.KV_CACHE_DTYPES
    return torch.float16 if gguf else torch.float32


def rank_pool_sizes(args: ServerArgs, cfg: ModelConfig, model: CausalLM) -> tuple[int, int]:
    """(KV slots, windowed-layer slots) that fit this rank's memory budget and every other
    rank's (each holds its shard or stage, all index the same slots)."""
    sizes = pool_sizes(args, cfg, model.pool_bytes_per_token(), model.pool_bytes_per_request(),
                       model.pool_bytes_per_swa_token(), model.device)
    num_slots, swa_slots = ps.agree_min(list(sizes))
    return num_slots, swa_slots


def build_scheduler(args: ServerArgs, tokenizer: Tokenizer | None,
                    rank: int = 0) -> tuple[Scheduler, ModelConfig]:
    """A driver's scheduler (rank 0's, or a DP attention group's); a failure leaves no process
    group behind (the Engine's process may build another)."""
    try:
        return _build_scheduler(args, tokenizer, rank)
    except BaseException:
        ps.destroy()
        raise


def _build_scheduler(args: ServerArgs, tokenizer: Tokenizer | None,
                     rank: int) -> tuple[Scheduler, ModelConfig]:
    model, cfg = load_rank_model(args, rank)
    per_token, per_request = model.pool_bytes_per_token(), model.pool_bytes_per_request()
    per_swa_token = model.pool_bytes_per_swa_token()
    num_slots, swa_slots = rank_pool_sizes(args, cfg, model)
    ctx = context_length(args, cfg)
    num_rows = request_rows(args)
    multi = args.parallel_config().world_size > 1
    mirror = ForwardMirror(cfg.hidden_size, args.pp_micro_batches or args.pp_size,
                           args.pp_micro_batch_min_tokens) if multi else None
    with on_device(model.device):
        pool = model.make_pool(num_slots, num_rows, swa_slots)
    no_radix = args.disable_radix_cache or model.has_request_state
    if no_radix and not args.disable_radix_cache:
        # A recurrent state summarises a whole prefix; it cannot be shared page by page.
        log.info("prefix cache off: %s keeps per-request recurrent state", cfg.architecture)
    cache = KVCacheManager(num_slots, args.page_size, num_rows, ctx + 1, no_radix,
                           window=pool.window, swa_slots=swa_slots, swa_window=pool.swa_window)
    runner = ModelRunner(model, pool, cache.req_to_token.table, cache.full_to_swa, mirror)
    spec = (build_ngram_worker(args, runner, cfg, cache) if args.speculative_algorithm == "NGRAM"
            else build_dspark_worker(args, runner, num_slots, cache) if args.speculative_algorithm else None)
    if args.hidden_state_layers is not None:
        model.set_aux_layers(args.hidden_state_layers)     # ranks get them with every forward
    eos = set(tokenizer.eos_token_ids) if tokenizer else set(cfg.eos_token_ids)
    decode_tail = (lambda ids: tokenizer.decode(ids)) if tokenizer else None
    sched_cfg = SchedulerConfig(args.max_running_requests, args.chunked_prefill_size, args.max_prefill_tokens,
                                args.decode_log_interval, args.enable_mixed_chunk,
                                args.enable_priority_scheduling, args.schedule_low_priority_values_first,
                                preemption_threshold(args))
    log.info("device: %s", model.device)
    log.info("KV pool: %d tokens (%.1f MiB), windowed layers %d tokens (%.1f MiB), request state %d rows "
             "(%.1f MiB), context %d", num_slots, num_slots * per_token / 2**20, swa_slots,
             swa_slots * per_swa_token / 2**20, num_rows, num_rows * per_request / 2**20, ctx)
    grammar = make_grammar_backend(args.grammar_backend, tokenizer, cfg.vocab_size)
    return Scheduler(runner, cache, sched_cfg, eos, decode_tail, spec, grammar), cfg


def build_dspark_worker(args: ServerArgs, runner: ModelRunner, num_slots: int, cache: KVCacheManager):
    from sparkserve.models.dspark_draft import load_dspark_draft
    from sparkserve.speculative.dspark_worker import DSparkWorker
    from sparkserve.speculative.planner import StepCostTable, VerifyPlanner
    from sparkserve.speculative.profile import measure_step_costs
    path = args.speculative_draft_model_path
    draft = load_dspark_draft(path, runner.model, args.activation_quant,     # also sets the target's aux taps
                              huge_pages=not args.disable_huge_pages)
    if args.speculative_dspark_block_size:
        draft.config.block_size = args.speculative_dspark_block_size
    thr, mode = args.speculative_dspark_confidence_threshold, args.verify_mode
    if mode == "adaptive" and draft.confidence_head is None and args.speculative_dspark_verify_mode is None:
        mode = "full"               # the default, on a draft that cannot say which drafts will pass
        log.warning("DSpark: %s has no confidence head: verify mode full (drafting may cost more than it "
                    "saves)", path)
    if mode != "full" and draft.confidence_head is None:
        raise ValueError(f"--speculative-dspark-verify-mode {mode} needs a draft with a confidence head "
                         f"(enable_confidence_head); {path} has none")
    costs = None
    if mode == "adaptive":
        costs = (StepCostTable.load(args.speculative_dspark_sps_table_path)
                 if args.speculative_dspark_sps_table_path
                 else measure_step_costs(runner, cache,
                                         max_tokens=args.max_running_requests * (draft.block_size + 1),
                                         max_requests=args.max_running_requests))
    planner = VerifyPlanner(mode, thr or 0.0, costs)
    log.info("DSpark: draft %s, %d layers, gamma %d, verify mode %s", path, draft.config.num_hidden_layers,
             draft.block_size, mode)
    # the native block pass keeps each block's own K/V in pool rows after the target's slots
    native = not args.disable_native_step and runner.device.type == "cpu"
    block_rows = args.max_running_requests * draft.block_size if native else 0
    draft.enable_native_step(native)
    with on_device(runner.device):
        # the draft's K/V in the target's format where that is int8 / fp8 (else float32)
        dtype = kv_dtype(args.kv_cache_dtype) if args.kv_cache_dtype in QUANT_KV_DTYPES else torch.float32
        return DSparkWorker(draft, draft.new_kv_pool(num_slots, dtype, block_rows=block_rows), planner,
                            cache.req_to_token.table, torch.arange(num_slots + 1, num_slots + 1 + block_rows),
                            runner.device)


def build_ngram_worker(args: ServerArgs, runner: ModelRunner, cfg: ModelConfig, cache: KVCacheManager):
    """NGRAM: no draft model. The planner is DSpark's (adaptive by default: the step costs measured
    at start-up against the acceptance NGRAM's drafts have had)."""
    from sparkserve.speculative.ngram import NgramWorker
    from sparkserve.speculative.planner import StepCostTable, VerifyPlanner
    from sparkserve.speculative.profile import measure_step_costs
    thr, table = args.speculative_dspark_confidence_threshold, args.speculative_dspark_sps_table_path
    mode = args.speculative_dspark_verify_mode or ("threshold" if thr is not None else "adaptive")
    drafts = args.speculative_num_draft_tokens - 1
    costs = None
    if mode == "adaptive":
        costs = (StepCostTable.load(table) if table else
                 measure_step_costs(runner, cache, max_tokens=args.max_running_requests * (drafts + 1),
                                    max_requests=args.max_running_requests))
    log.info("NGRAM: up to %d drafts, match %d..%d tokens, %s, verify mode %s", drafts,
             args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size,
             args.speculative_ngram_match_type, mode)
    planner = VerifyPlanner(mode, thr or 0.0, costs)
    return NgramWorker(drafts, args.speculative_ngram_min_match_window_size,
                       args.speculative_ngram_max_match_window_size, args.speculative_ngram_match_type,
                       planner, cfg.vocab_size, runner.device)
