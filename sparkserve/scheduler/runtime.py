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
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.registry import load_config, load_model
from sparkserve.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_pretrained(path)


def context_length(args: ServerArgs, cfg: ModelConfig) -> int:
    return args.context_length or cfg.context_length


def kv_pool_tokens(args: ServerArgs, cfg: ModelConfig) -> int:
    if args.max_total_tokens:
        return args.max_total_tokens
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                       torch.float32)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = int(ram * args.mem_fraction_static) // per_token
    # More than every running request at full context is wasted memory.
    return max(args.page_size, min(tokens, args.max_running_requests * context_length(args, cfg)))


def build_scheduler(args: ServerArgs, tokenizer: Tokenizer | None) -> tuple[Scheduler, ModelConfig]:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    cfg = load_config(args.model_path)
    model = load_model(args.model_path, cfg)
    num_slots = kv_pool_tokens(args, cfg) // args.page_size * args.page_size
    ctx = context_length(args, cfg)
    pool = KVPool(num_slots, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    cache = KVCacheManager(num_slots, args.page_size, args.max_running_requests + 1, ctx + 1,
                           args.disable_radix_cache)
    runner = ModelRunner(model, pool, cache.req_to_token.table)
    eos = set(tokenizer.eos_token_ids) if tokenizer else set(cfg.eos_token_ids)
    decode_tail = (lambda ids: tokenizer.decode(ids)) if tokenizer else None
    sched_cfg = SchedulerConfig(args.max_running_requests, args.chunked_prefill_size, args.max_prefill_tokens)
    log.info("KV pool: %d tokens (%.1f MiB), context %d", num_slots,
             num_slots * KVPool.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                cfg.head_dim, torch.float32) / 2**20, ctx)
    return Scheduler(runner, cache, sched_cfg, eos, decode_tail), cfg
