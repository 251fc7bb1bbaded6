"""The MoE decode path (layers/moe_decode.py, kernels/moe_experts.cpp): a Q8_0 GGUF's experts served
under int8 activations run in one kernel call per layer at decode and small batches, and give what
the Python expert loop (moe.py grouped_experts over the same block Linears) gives, for every MoE
family (SwiGLU experts; GPT-OSS's clamped SwiGLU with biases; DeepSeek-V2's shared experts beside).
Mixtral, Qwen3-MoE and GPT-OSS run whole in the native step (kernels/native_llama.cpp: the router
in C++, then the same kernel), equal to the Python layer path (GPT-OSS on the exact path:
tests/models/test_gpt_oss_native.py)."""
from __future__ import annotations

import pytest
import torch
from family_fixtures import make_family_checkpoint, write_gguf
from test_model_logits import Driver, run_schedule
from test_native_step import Counter, logits_of

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner
from sparkserve.layers import moe, moe_decode
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.mem.kv_pool import KVPool
from sparkserve.models.llama_native import unsupported
from sparkserve.models.registry import load_config, load_model

MOE_GGUF = ["qwen3_moe", "mixtral", "gpt_oss_gguf", "deepseek_v2_qlora_gguf"]


@pytest.fixture(scope="module")
def q8_ggufs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_q8")
    return {name: write_gguf(make_family_checkpoint(name, str(root / name)), str(root / f"{name}.gguf"),
                             "q8_0") for name in MOE_GGUF}


def _experts(model) -> list[moe.Experts]:
    return [m for m in model.modules() if isinstance(m, moe.Experts)]


@pytest.mark.parametrize("name", MOE_GGUF)
def test_kernel_equals_python_expert_loop(name, q8_ggufs, monkeypatch):
    """Per MoE layer, random rows routed at random (some slots to experts another rank would own,
    ids outside [0, E)): the kernel's output equals the Python loop's, at 1, 3 and 40 rows."""
    model = load_model(q8_ggufs[name], activation_quant="int8")
    layers = _experts(model)
    assert layers and all(ex.block_experts is not None for ex in layers)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for ex in layers:
            for T in (1, 3, 40):
                k = 2
                x = torch.randn(T, ex.hidden, generator=g)
                weights = torch.rand(T, k, generator=g)
                ids = torch.randint(-1, ex.num_experts + 1, (T, k), generator=g)
                fast = moe_decode.decode_experts(ex, x, weights, ids - ex.first)
                assert fast is not None
                monkeypatch.setattr(moe_decode, "MAX_TOKENS", 0)
                slow = ex(x, weights, ids)
                monkeypatch.undo()
                scale = slow.abs().max().item()
                assert scale > 0
                torch.testing.assert_close(fast, slow, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("name", MOE_GGUF)
def test_decode_takes_the_kernel_and_keeps_the_tokens(name, q8_ggufs, monkeypatch):
    """Through the Engine at batch 1 and 3 (the native step off: the layer path): every decode
    step's MoE layers take the kernel, and the greedy tokens equal those of the Python expert loop
    (forced by MAX_TOKENS = 0); with the native step on (all but DeepSeek-V2 run it) the same tokens."""
    taken = []
    real = moe.decode_experts

    def counting(ex, x, weights, ids):
        y = real(ex, x, weights, ids)
        taken.append((x.shape[0], y is not None))
        return y
    prompts = [[3, 4, 5, 6, 7], [11, 2, 9], [40, 41, 42, 43, 44, 45, 46]]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def tokens(batch: list[list[int]], native: bool = False) -> list[list[int]]:
        with Engine(q8_ggufs[name], max_total_tokens=512, activation_quant="int8",
                    disable_native_step=not native) as eng:
            return [r["output_ids"] for r in eng.generate(input_ids=batch, sampling_params=sp)]
    monkeypatch.setattr(moe, "decode_experts", counting)
    fast = [tokens(prompts[:1]), tokens(prompts)]
    decode_calls = [ok for rows, ok in taken if rows <= len(prompts)]
    assert decode_calls and all(decode_calls)
    assert [tokens(prompts[:1], native=True), tokens(prompts, native=True)] == fast
    monkeypatch.setattr(moe_decode, "MAX_TOKENS", 0)
    taken.clear()
    assert [tokens(prompts[:1]), tokens(prompts)] == fast
    assert taken and not any(ok for _, ok in taken)


def _int8_runner(path: str) -> tuple[ModelRunner, KVCacheManager]:
    """test_model_logits.make_runner with int8 activations (the engine's default for a GGUF)."""
    cfg = load_config(path)
    model = load_model(path, cfg, activation_quant="int8")
    pool = KVPool(1024, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    cache = KVCacheManager(1024, 1, 8, cfg.context_length + 1, disable_radix_cache=True)
    return ModelRunner(model, pool, cache.req_to_token.table), cache


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss_gguf"])
def test_native_step_runs_moe_layers(name, q8_ggufs, monkeypatch):
    """Decode steps of 4 requests and a mixed extend run natively (MoE layers, and Qwen3-MoE's dense
    one, in C++) and give the Python layer path's logits and greedy choices; the experts' routed
    counts (/metrics) are the Python path's too. Under int8 activations a fp32 rounding difference
    between the paths (the extend's prefill vs paged attention kernel) can flip one int8 step, which
    moves the logits by ~1% (test_native_step.test_smollm2_native_equals_python_path); a wrong
    expert or weight moves them by O(1)."""
    count = Counter(monkeypatch)
    drivers, counts = [], []
    for native in (True, False):
        runner, cache = _int8_runner(q8_ggufs[name])
        assert unsupported(runner.model) is None
        runner.model.enable_native_step(native)
        d = Driver(runner, cache)
        run_schedule(d, runner.model.config.vocab_size, [13, 1, 23, 6], decode_steps=6, seed=5)
        drivers.append(d)
        counts.append(moe.routed_token_counts(runner.model))
    modes = [m for m, _ in count.calls]
    assert modes.count(ForwardMode.DECODE) == 5, count.calls
    native, python = torch.cat(logits_of(drivers[0])), torch.cat(logits_of(drivers[1]))
    assert (native - python).abs().max() <= 3e-2 * python.abs().max()
    assert (native.argmax(-1) == python.argmax(-1)).float().mean() >= 0.9
    assert counts[0] == counts[1] and sum(counts[0]) > 0


def test_native_step_takes_fp32_experts(q8_ggufs):
    """Experts held in fp32 (activation_quant none: the Q8_0 file's values dequantized) run natively
    from their parameters in place (tests/models/test_families.py checks the logits); GPT-OSS too,
    sinks, o bias and its router included."""
    for name in ("mixtral", "gpt_oss_gguf"):
        model = load_model(q8_ggufs[name], activation_quant="none")
        assert all(ex.block_experts is None for ex in _experts(model))
        assert unsupported(model) is None
