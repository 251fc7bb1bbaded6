"""The native forward step (kernels/native_llama.cpp, models/llama_native.py) against the Python
layer path it replaces, and against transformers.

Tiny Llama / Qwen3 (q/k norm, tied head) / Mistral (sliding window) checkpoints are saved in bf16,
so their projections load as BF16 blocks and the native step applies; SmolLM2 runs from its Q4_1
GGUF. The same schedule (chunked prefill, batched decode, a mixed-length extend) runs through two
runners of one checkpoint, native on and off: every logits row must agree, and the native one must
have run every step small enough for it."""
from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, TINY_CONFIGS, TINY_SEED, assert_no_kv_leak
from test_model_logits import Driver, check_against_hf, make_runner, run_schedule

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.layers.block_backed import set_activation_quant
from sparkserve.models import llama_native
from sparkserve.models.native_step import NATIVE_MAX_TOKENS

GREEDY = dict(temperature=0, ignore_eos=True)


def save_bf16(arch: str, path: str, **over) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(TINY_SEED)
    cfg = AutoConfig.for_model(arch, **dict(TINY_CONFIGS[arch], **over))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bf16")
    dirs = {arch: save_bf16(arch, str(root / arch)) for arch in ARCHS}
    dirs["qwen3_mixed"] = save_bf16("qwen3", str(root / "qwen3_mixed"), use_sliding_window=True,
                                    sliding_window=8, max_window_layers=1)
    return dirs


class Counter:
    """Counts the forwards that ran natively (wraps NativeStep.forward)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[ForwardMode, int]] = []
        real = llama_native.NativeStep.forward

        def forward(step, model, input_ids, batch):
            self.calls.append((batch.mode, batch.num_tokens))
            return real(step, model, input_ids, batch)
        monkeypatch.setattr(llama_native.NativeStep, "forward", forward)


def logits_of(driver: Driver) -> list[torch.Tensor]:
    return [torch.stack([s.logits[p] for p in sorted(s.logits)]) for s in driver.seqs]


def run_both(path: str, prompt_lens: list[int], decode_steps: int, page_size: int = 1,
             kv_dtype: torch.dtype = torch.float32):
    """(native driver, python driver): the same schedule through each."""
    drivers = []
    for native in (True, False):
        runner, cache = make_runner(path, page_size, kv_dtype=kv_dtype)
        runner.model.enable_native_step(native)
        d = Driver(runner, cache)
        run_schedule(d, runner.model.config.vocab_size, prompt_lens, decode_steps, seed=5)
        drivers.append(d)
    return drivers


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], rel: float) -> None:
    for x, y in zip(a, b, strict=True):
        scale = max(1.0, y.abs().max().item())
        err = (x - y).abs().max().item()
        assert err <= rel * scale, f"max |diff| {err:.3g} (scale {scale:.3g})"
        assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_equals_python_path_and_transformers(arch, bf16_dirs, monkeypatch):
    """Decode steps of 4 requests and a mixed extend (3 + 1 + 1 + 1 tokens) run natively; their
    logits equal the Python path's and transformers' (fp32 on the same bf16 values)."""
    from conftest import load_hf_reference
    count = Counter(monkeypatch)
    native, python = run_both(bf16_dirs[arch], [13, 1, 23, 6], decode_steps=6)
    modes = [m for m, _ in count.calls]
    assert modes.count(ForwardMode.DECODE) == 5 and modes.count(ForwardMode.EXTEND) >= 1, count.calls
    assert all(n <= NATIVE_MAX_TOKENS for _, n in count.calls)
    assert_close(logits_of(native), logits_of(python), 1e-4)
    check_against_hf(native, load_hf_reference(bf16_dirs[arch]))
    for d in (native, python):
        d.release()
        assert d.cache.allocator.free_slots == d.cache.num_slots


@pytest.mark.parametrize("kv_dtype,paths,rel", [(torch.float16, 2e-4, 1e-2), (torch.bfloat16, 2e-3, 3e-2)])
def test_half_precision_kv_pool(kv_dtype, paths, rel, bf16_dirs, monkeypatch):
    """--kv-cache-dtype float16 / bfloat16: the native step writes its K/V rounded as the layer
    path's store does and reads them back through the same kernel. The two paths differ by fp32
    rounding (rotary, SiLU, the prefill vs decode attention kernels), which can flip the rounding
    of a stored K/V value by one unit of the pool's type that later tokens read, so they agree to
    a few of those units' effect (`paths`; bfloat16's unit is 8x float16's); against transformers
    the logits move by what one rounding of each K/V value costs."""
    from conftest import load_hf_reference
    count = Counter(monkeypatch)
    native, python = run_both(bf16_dirs["llama"], [13, 1, 23, 6], decode_steps=6, kv_dtype=kv_dtype)
    assert count.calls
    assert native.runner.kv_pool.k[0].dtype == kv_dtype
    assert_close(logits_of(native), logits_of(python), paths)
    check_against_hf(native, load_hf_reference(bf16_dirs["llama"]), rel)


def test_native_step_records_the_same_aux_taps(bf16_dirs):
    """DSpark's taps (the embedding, -1, and layer outputs) come out of the native step as the
    Python path records them."""
    taps = []
    for native in (True, False):
        runner, cache = make_runner(bf16_dirs["llama"], 1)
        runner.model.enable_native_step(native)
        runner.model.set_aux_layers([-1, 0, 1])
        d = Driver(runner, cache)
        s = d.new_seq()
        d.step([(s, list(range(5, 12)))])
        fb = runner.build_batch(ForwardMode.DECODE, [_decode_req(d, s, 40)])
        runner.forward(fb)
        taps.append(fb.aux_hidden)
    assert len(taps[0]) == len(taps[1]) == 3
    for a, b in zip(*taps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _decode_req(driver: Driver, seq, token: int):
    from sparkserve.executor.model_runner import ScheduledReq
    n0 = len(seq.tokens)
    slots = driver.cache.allocator.alloc(n0, 1, int(driver.table[seq.row, n0 - 1]))
    driver.table[seq.row, n0] = slots
    seq.tokens.append(token)
    return ScheduledReq(seq.row, n0, [token], slots)


def test_smollm2_native_equals_python_path(smollm2_engine, monkeypatch):
    """The embedded Q4_1 model: a batch of two prompts decoding, native vs the Python path, on
    the engine's own runner and pool. fp32 activations: equal to 1e-4. int8 activations: rounding
    to int8 turns the paths' fp32 rounding differences into int8 steps, so the two agree only as
    closely as int8 agrees with fp32 (docs/kernel-notes.md); the native one must still quantize
    (differ from its fp32 self) and keep the argmax of the Python path on nearly every row."""
    count = Counter(monkeypatch)
    engine = smollm2_engine
    sched = engine.scheduler
    model = sched.runner.model
    outs = {}
    try:
        for mode in ("none", "int8"):
            set_activation_quant(model, mode)
            for native in (True, False):
                engine.flush_cache()
                model.enable_native_step(native)
                d = Driver(sched.runner, sched.cache)
                run_schedule(d, engine.model_config.vocab_size, [9, 21], decode_steps=4, seed=3)
                outs[mode, native] = torch.cat(logits_of(d))
                d.release()
        set_activation_quant(model, "none")     # the blocks go back to GGUF order: the step rebuilds
        model.enable_native_step(True)
        engine.flush_cache()
        d = Driver(sched.runner, sched.cache)
        run_schedule(d, engine.model_config.vocab_size, [9, 21], decode_steps=4, seed=3)
        assert torch.equal(torch.cat(logits_of(d)), outs["none", True])
        d.release()
    finally:
        model.enable_native_step(True)
        set_activation_quant(model, "none")
    assert count.calls, "the native step never ran"
    assert_close([outs["none", True]], [outs["none", False]], 1e-4)
    native, python = outs["int8", True], outs["int8", False]
    assert (native - outs["none", True]).abs().max() > 0.05, "the native step did not quantize"
    assert (native - python).abs().mean() < 0.2
    assert (native.argmax(-1) == python.argmax(-1)).float().mean() >= 0.9
    assert_no_kv_leak(sched.cache)


@pytest.mark.parametrize("arch", ["mistral", "qwen3_mixed"])
def test_engine_greedy_tokens_equal(arch, bf16_dirs, monkeypatch):
    """Whole generations through the scheduler (radix cache, chunked prefill, a sliding window
    that frees pages; qwen3_mixed: a split pool whose windowed layer has its own slots)."""
    count = Counter(monkeypatch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 17, 30)]
    outs = []
    for disable in (False, True):
        with Engine(bf16_dirs[arch], max_total_tokens=2048, disable_native_step=disable) as eng:
            res = eng.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=24))
            outs.append([r["output_ids"] for r in res])
            assert_no_kv_leak(eng.scheduler.cache)
    assert count.calls and outs[0] == outs[1]


def test_dspark_verify_runs_natively(monkeypatch):
    """DSpark on SmolLM2 with its shipped draft (an fp16 checkpoint, so F16 blocks): VERIFY
    forwards of anchor + drafts and the draft's greedy passes run natively, and the greedy tokens
    equal plain decoding's."""
    from sparkserve.models.dspark_native import NativeDraftStep
    count = Counter(monkeypatch)
    blocks = []
    native_pass = NativeDraftStep.propose_greedy
    monkeypatch.setattr(NativeDraftStep, "propose_greedy",
                        lambda self, *a: blocks.append(out := native_pass(self, *a)) or out)
    msgs = [[{"role": "user", "content": "Write a Python function that adds two numbers."}]]
    params = dict(GREEDY, max_new_tokens=40)
    with Engine(max_total_tokens=2048, speculative_algorithm="DSPARK",
                speculative_dspark_verify_mode="full") as spec:
        got = spec.generate(messages=msgs, sampling_params=params)[0]["output_ids"]
        assert_no_kv_leak(spec.scheduler.cache)
    verifies = sum(m == ForwardMode.VERIFY for m, _ in count.calls)
    assert verifies and len(blocks) == verifies and None not in blocks
    with Engine(max_total_tokens=2048) as plain:
        want = plain.generate(messages=msgs, sampling_params=params)[0]["output_ids"]
    assert got == want


def test_bad_slot_is_an_error_not_a_crash(bf16_dirs):
    runner, cache = make_runner(bf16_dirs["llama"], 1, num_slots=64)
    d = Driver(runner, cache)
    s = d.new_seq()
    d.step([(s, [3, 4, 5])])
    fb = runner.build_batch(ForwardMode.DECODE, [_decode_req(d, s, 7)])
    fb.out_cache_loc = torch.tensor([10_000])
    with pytest.raises(RuntimeError, match="out of range"):
        runner.forward(fb)
