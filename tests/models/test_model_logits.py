"""Model forward vs transformers, through the real serving path: KV pool, paged slot table,
ModelRunner.build_batch / forward with ScheduledReqs (so paged attention, padded batches,
causal + sliding-window masks and prefix-extend are all exercised).

The reference is one unpadded transformers forward over each request's full token sequence:
causality makes its logits at position i the right answer for any way we split the work."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from conftest import ARCHS, assert_no_kv_leak, hf_logits, make_tiny_checkpoint

from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.registry import load_config, load_model


@dataclass
class Seq:
    row: int
    tokens: list[int] = field(default_factory=list)       # tokens whose KV is in the pool
    logits: dict[int, torch.Tensor] = field(default_factory=dict)   # position -> our logits


class Driver:
    """Feeds token chunks for several sequences through ModelRunner the way the scheduler does
    (slot table row per sequence, slots from the paged allocator), asking for every row's logits."""

    def __init__(self, runner: ModelRunner, cache: KVCacheManager):
        self.runner, self.cache = runner, cache
        self.table = cache.req_to_token.table
        self.seqs: list[Seq] = []

    def new_seq(self) -> Seq:
        row = self.cache.req_to_token.alloc()
        assert row is not None
        seq = Seq(row)
        self.seqs.append(seq)
        return seq

    def step(self, work: list[tuple[Seq, list[int]]]) -> None:
        sched = []
        for seq, toks in work:
            n0 = len(seq.tokens)
            last = int(self.table[seq.row, n0 - 1]) if n0 else 0
            slots = self.cache.allocator.alloc(n0, len(toks), last)
            assert slots is not None, "test pool too small"
            self.table[seq.row, n0:n0 + len(toks)] = slots
            sched.append(ScheduledReq(seq.row, n0, list(toks), slots))
        mode = ForwardMode.DECODE if all(len(t) == 1 for _, t in work) else ForwardMode.EXTEND
        fb = self.runner.build_batch(mode, sched)
        fb.logits_rows = torch.arange(fb.num_tokens)       # every row, not just each request's last
        logits = self.runner.forward(fb)
        assert logits.shape == (fb.num_tokens, self.runner.model.config.vocab_size)
        off = 0
        for seq, toks in work:
            for i in range(len(toks)):
                seq.logits[len(seq.tokens) + i] = logits[off + i]
            off += len(toks)
            seq.tokens += list(toks)

    def release(self) -> None:
        for seq in self.seqs:
            self.cache.allocator.free(self.table[seq.row, :len(seq.tokens)].clone())  # frees whole pages
            self.cache.req_to_token.free(seq.row)
        self.seqs = []


def make_runner(path: str, page_size: int, num_slots: int = 1024,
                kv_dtype: torch.dtype = torch.float32) -> tuple[ModelRunner, KVCacheManager]:
    """What scheduler/runtime.build_scheduler builds, minus the scheduler."""
    cfg = load_config(path)
    model = load_model(path, cfg)
    pool = KVPool(num_slots, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
    cache = KVCacheManager(num_slots, page_size, 8, cfg.context_length + 1, disable_radix_cache=True)
    return ModelRunner(model, pool, cache.req_to_token.table), cache


def check_against_hf(driver: Driver, hf_model, rel_atol: float = 1e-4) -> int:
    """Every logit row we produced vs the transformers forward over the full sequence."""
    checked = 0
    for seq in driver.seqs:
        ref = hf_logits(hf_model, seq.tokens)
        scale = max(1.0, ref.abs().max().item())
        for pos, ours in seq.logits.items():
            err = (ours - ref[pos]).abs().max().item()
            assert err <= rel_atol * scale, \
                f"row {seq.row} position {pos}: max |diff| {err:.3g} (scale {scale:.3g})"
            checked += 1
    return checked


def _rand_tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def run_schedule(driver: Driver, vocab: int, prompt_lens: list[int], decode_steps: int,
                 seed: int = 0) -> None:
    """Chunked prefill of a batch of different-length prompts, then batched decode steps
    interleaved with a multi-token extend of one request (mixed extend lengths in one batch)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [driver.new_seq() for _ in prompt_lens]
    prompts = [_rand_tokens(gen, n, vocab) for n in prompt_lens]
    # First chunk: the first half of the longest prompt alone (prefix KV then reused by extend).
    longest = max(range(len(prompts)), key=lambda i: prompt_lens[i])
    half = prompt_lens[longest] // 2
    driver.step([(seqs[longest], prompts[longest][:half])])
    # The rest of every prompt together: one request extends over a cached prefix.
    driver.step([(s, p[half:] if i == longest else p) for i, (s, p) in enumerate(zip(seqs, prompts))])
    for step in range(decode_steps):
        if step == decode_steps // 2:
            # Mixed: seq 0 gets 3 tokens, the rest 1 each (EXTEND with unequal lengths).
            driver.step([(s, _rand_tokens(gen, 3 if i == 0 else 1, vocab)) for i, s in enumerate(seqs)])
        else:
            driver.step([(s, _rand_tokens(gen, 1, vocab)) for s in seqs])


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_logits_match_transformers(arch, page_size, tiny_dirs, hf_tiny):
    """Prefill (chunked, batched, lengths 1..23 across the sliding window of 8) and decode
    logits equal transformers' at every position."""
    runner, cache = make_runner(tiny_dirs[arch], page_size)
    driver = Driver(runner, cache)
    run_schedule(driver, runner.model.config.vocab_size, [13, 1, 23, 6], decode_steps=6, seed=page_size)
    n = check_against_hf(driver, hf_tiny[arch])
    assert n == sum(len(s.tokens) for s in driver.seqs)
    driver.release()
    assert cache.allocator.free_slots == cache.num_slots


def test_batch_padding_does_not_leak_between_requests(tiny_dirs, hf_tiny):
    """The same sequence gives the same logits whether its batch-mates are short or long
    (padded key slots point at the dummy slot 0 and must be masked)."""
    runner, cache = make_runner(tiny_dirs["mistral"], 1)
    driver = Driver(runner, cache)
    a, b = driver.new_seq(), driver.new_seq()
    gen = torch.Generator().manual_seed(7)
    pa, pb = _rand_tokens(gen, 5, 320), _rand_tokens(gen, 30, 320)
    driver.step([(a, pa), (b, pb)])
    for _ in range(3):
        driver.step([(a, _rand_tokens(gen, 1, 320)), (b, _rand_tokens(gen, 1, 320))])
    check_against_hf(driver, hf_tiny["mistral"])
    driver.release()


def test_smollm2_gguf_logits_match_transformers(smollm2_engine, smollm2_hf):
    """SmolLM2-135M from the GGUF (our dequantize + llama.cpp q/k un-permute) vs transformers'
    GGUF loader, through the engine's own runner and pool."""
    engine = smollm2_engine
    engine.flush_cache()
    sched = engine.scheduler
    driver = Driver(sched.runner, sched.cache)
    run_schedule(driver, engine.model_config.vocab_size, [9, 21], decode_steps=3, seed=3)
    try:
        check_against_hf(driver, smollm2_hf)
    finally:
        driver.release()
    assert_no_kv_leak(sched.cache)


def test_sharded_checkpoint_loads_identically(tmp_path, llama_dir):
    sharded = make_tiny_checkpoint("llama", str(tmp_path / "sharded"), max_shard_size="20KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1, "checkpoint was not sharded"
    a = load_model(llama_dir, pack=False).state_dict()
    b = load_model(sharded, pack=False).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # And the served model (packed linears) gives identical logits.
    ra, ca = make_runner(llama_dir, 1, 64)
    rb, cb = make_runner(sharded, 1, 64)
    outs = []
    for runner, cache in ((ra, ca), (rb, cb)):
        d = Driver(runner, cache)
        s = d.new_seq()
        d.step([(s, list(range(10, 30)))])
        outs.append(torch.stack([s.logits[i] for i in range(20)]))
    assert torch.equal(outs[0], outs[1])


def test_unknown_architecture_is_refused(tmp_path, llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooBarForCausalLM") as e:
        load_model(str(bad))
    for supported in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert supported in str(e.value)
    from sparkserve import Engine
    with pytest.raises(ValueError, match="supported"):
        Engine(str(bad), max_total_tokens=64)
