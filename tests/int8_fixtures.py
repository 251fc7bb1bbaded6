"""A whole model's logits run the way int8 activations see them, and the stated tolerance of int8
against fp32 activations (docs/kernel-notes.md: mean |diff| 0.17, top-1 agreement 97%, perplexity
+0.5-0.7% on ShareGPT / HumanEval), with margin."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_logits(model, tokens: list[int], chunk: int = 8) -> torch.Tensor:
    """Logits of every position, the model run in chunks of `chunk` tokens (the int8 M range)."""
    from sparkserve.core.forward_batch import ForwardMode
    from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
    from sparkserve.mem.cache_manager import KVCacheManager
    from sparkserve.mem.kv_pool import KVPool
    cfg = model.config
    n = len(tokens) + chunk
    cache = KVCacheManager(n, 1, 2, n + 1, disable_radix_cache=True)
    runner = ModelRunner(model, KVPool(n, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                         cache.req_to_token.table)
    row, table, out = cache.req_to_token.alloc(), cache.req_to_token.table, []
    with torch.no_grad():
        for s in range(0, len(tokens), chunk):
            toks = tokens[s:s + chunk]
            slots = cache.allocator.alloc(s, len(toks), int(table[row, s - 1]) if s else 0)
            table[row, s:s + len(toks)] = slots
            fb = runner.build_batch(ForwardMode.EXTEND, [ScheduledReq(row, s, toks, slots, len(toks))])
            fb.logits_rows = torch.arange(fb.num_tokens)
            out.append(runner.forward(fb).float())
    return torch.cat(out)


def assert_int8_close(fp: torch.Tensor, i8: torch.Tensor, tokens: list[int]) -> None:
    """int8-activation logits `i8` within the int8 tolerance of fp32 ones `fp` over `tokens`, and
    really different from them."""
    diff = (i8 - fp).abs()
    scale = fp.abs().max().item()
    agree = (i8.argmax(-1) == fp.argmax(-1)).float().mean().item()
    assert diff.max().item() > 0
    assert diff.mean().item() <= 0.4, f"mean |logit diff| {diff.mean().item():.3f}"
    assert diff.max().item() <= 0.2 * scale, f"max |logit diff| {diff.max().item():.3f} (scale {scale:.3g})"
    assert agree >= 0.9, f"top-1 agreement {agree:.3f}"
    nll = {k: F.cross_entropy(v[:-1], torch.tensor(tokens[1:])).item() for k, v in (("fp", fp), ("i8", i8))}
    assert abs(nll["i8"] - nll["fp"]) <= 0.05, nll
