"""The native DeepSeek-V2 step (kernels/native_mla.cpp, models/deepseek_v2_native.py) against the
Python layer path it replaces (models/deepseek_v2.py, layers/mla.py) and against transformers'
DeepseekV2.

Tiny random checkpoints (tests/family_fixtures.py): DeepSeek-V2-Lite's kind (one q_proj, greedy
routing) and V2's (q through q_a / q_b, group-limited routing over 2 groups, tied head), both with a
dense first layer, then 4 routed experts top-2 plus a shared expert, YaRN mscale. The fp32 directory
runs the exact path (fp32 weights and experts, --activation-quant none): every logits row of a
schedule with chunked prefill, batched decode and a mixed extend equals transformers' and the Python
path's. A Q8_0 GGUF under int8 activations (experts on the MoE kernel, q_b / kv_a / o on int8
blocks) stays within int8 rounding of the Python path, routes the same (token, slot) counts, and
greedy decoding through the Engine gives the same tokens with the native step on and off."""
from __future__ import annotations

import pytest
import torch
from conftest import EXACT, hf_greedy, load_hf_reference
from family_fixtures import FAMILIES, make_family_checkpoint, write_gguf
from test_model_logits import Driver, check_against_hf, run_schedule
from test_native_step import assert_close, logits_of

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner
from sparkserve.kernels.blocks import Q4_0, Q8_0
from sparkserve.layers import moe
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.mem.kv_quant import scale_component
from sparkserve.models import deepseek_v2_native
from sparkserve.models.deepseek_v2_native import unsupported
from sparkserve.models.registry import load_config, load_model

NAMES = ["deepseek_v2", "deepseek_v2_qlora"]
WIDE = "deepseek_v2_wide_test_native_mla"
Q8 = ["q8_0", "q8_0_wide", "q5_0_wide"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("native_mla")
    out = {name: make_family_checkpoint(name, str(root / name)) for name in NAMES}
    gguf = make_family_checkpoint("deepseek_v2_qlora_gguf", str(root / "gguf_src"))
    out["q8_0"] = write_gguf(gguf, str(root / "ds.q8_0.gguf"), "q8_0")
    # nope, v and the latent whole blocks of 32: the file's attn_k_b / attn_v_b are Q8_0 too
    FAMILIES[WIDE] = ("deepseek_v2", dict(FAMILIES["deepseek_v2_qlora_gguf"][1], kv_lora_rank=32,
                                          qk_nope_head_dim=32, v_head_dim=32))
    try:
        wide = make_family_checkpoint(WIDE, str(root / "wide_src"))
    finally:
        del FAMILIES[WIDE]
    out["q8_0_wide"] = write_gguf(wide, str(root / "wide.q8_0.gguf"), "q8_0")
    # kv_b's halves as a Q4_K_M file mixes them where rows are not whole 256-blocks (k_b: Q5_0) or are
    # (v_b: Q4_K, which gguf-py cannot write: Q4_0 here)
    out["q5_0_wide"] = write_gguf(wide, str(root / "wide.q5_0.gguf"), "q8_0",
                                  quant_types={"attn_k_b.weight": "Q5_0", "attn_v_b.weight": "Q4_0"})
    return out


class NativeCalls:
    """The (mode, tokens) of every forward that ran natively (wraps NativeMLAStep.forward)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[ForwardMode, int]] = []
        real = deepseek_v2_native.NativeMLAStep.forward

        def forward(step, model, input_ids, batch):
            self.calls.append((batch.mode, batch.num_tokens))
            return real(step, model, input_ids, batch)
        monkeypatch.setattr(deepseek_v2_native.NativeMLAStep, "forward", forward)


def _drive(path: str, native: bool, activation_quant: str = "none", kv_dtype: torch.dtype = torch.float32,
           prompt_lens: tuple[int, ...] = (13, 1, 23, 6), prepare=None) -> tuple[Driver, list[int]]:
    """The test_model_logits schedule over the latent pool the model makes; (driver, routed counts).
    `prepare(model)`: a change to the loaded model first."""
    cfg = load_config(path)
    model = load_model(path, cfg, activation_quant=activation_quant)
    if prepare is not None:
        prepare(model)
    model.set_kv_cache_dtype(kv_dtype)
    cache = KVCacheManager(1024, 1, 8, cfg.context_length + 1, disable_radix_cache=True)
    runner = ModelRunner(model, model.make_pool(cache.num_slots, 8), cache.req_to_token.table)
    model.enable_native_step(native)
    d = Driver(runner, cache)
    run_schedule(d, cfg.vocab_size, list(prompt_lens), decode_steps=6, seed=5)
    return d, moe.routed_token_counts(model)


@pytest.mark.parametrize("name", NAMES)
def test_native_step_equals_python_path_and_transformers(name, dirs, monkeypatch):
    """Exact path: every decode step and small extend runs natively, and every logits row equals
    transformers' (1e-4 of the logit scale) and the Python path's; the routed counts too."""
    calls = NativeCalls(monkeypatch)
    native, native_counts = _drive(dirs[name], True)
    modes = [m for m, _ in calls.calls]
    assert modes.count(ForwardMode.DECODE) == 5 and ForwardMode.EXTEND in modes, calls.calls
    check_against_hf(native, load_hf_reference(dirs[name]))
    calls.calls.clear()
    python, python_counts = _drive(dirs[name], False)
    assert not calls.calls
    assert_close(logits_of(native), logits_of(python), 1e-4)
    assert native_counts == python_counts and sum(native_counts) > 0


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantized_latent_pool_equals_python_path(kv_dtype, dirs, monkeypatch):
    """--kv-cache-dtype int8 / fp8: the native step stores the latent rows quantized as the layers do
    (mem/kv_quant.py: the same bytes and scales, so every later step reads the same pool) and attends
    through the scales: every logits row equals the Python path's (SDPA over the dequantized rows),
    up to an int8 value whose input sat on a rounding edge and rounded the other way (one step, 1/127
    of its block's max: ~1e-3 of the logits here); a wrong scale or row moves them by O(1)."""
    calls = NativeCalls(monkeypatch)
    lens = (13, 1, 140, 6)      # the prompts' chunks are too long for the step: the layers store them
    native, _ = _drive(dirs["deepseek_v2_qlora"], True, kv_dtype=kv_dtype, prompt_lens=lens)
    assert sorted(m.value for m, _ in calls.calls) == ["decode"] * 5 + ["extend"], calls.calls
    python, _ = _drive(dirs["deepseek_v2_qlora"], False, kv_dtype=kv_dtype, prompt_lens=lens)
    assert_close(logits_of(native), logits_of(python), 1e-3)
    used = sorted({int(native.table[s.row, i]) for s in native.seqs for i in range(len(s.tokens))})
    for name in ("kv_latent", scale_component("kv_latent", kv_dtype)):
        for layer in range(3):   # the same bytes but where fp32 rounding crossed a rounding edge
            a, b = (d.runner.kv_pool.get(name, layer)[used] for d in (native, python))
            assert (a.view(torch.uint8) == b.view(torch.uint8)).float().mean() >= 0.99, (name, layer)


@pytest.mark.parametrize("q8", Q8)
def test_q8_0_gguf_native_step_within_int8_of_python_path(q8, dirs, monkeypatch):
    """Q8_0 GGUF, int8 activations: the native step (q_a / q_b / kv_a / o / dense MLP / experts on
    int8 blocks, group-limited routing in C++) against the Python layer path. The two quantize the
    same activations but round fp32 differently in places (absorbed products, softmax, rotary), which
    can flip an int8 step and move logits by ~1% (test_moe_decode.py); a wrong expert, head or
    weight moves them by O(1)."""
    calls = NativeCalls(monkeypatch)
    native, native_counts = _drive(dirs[q8], True, "int8")
    assert [m for m, _ in calls.calls].count(ForwardMode.DECODE) == 5
    python, python_counts = _drive(dirs[q8], False, "int8")
    a, b = torch.cat(logits_of(native)), torch.cat(logits_of(python))
    assert (a - b).abs().max() <= 3e-2 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert native_counts == python_counts and sum(native_counts) > 0


def _generate(path: str, prompts: list[list[int]], native: bool, **kw) -> list[dict]:
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(path, max_total_tokens=512, disable_native_step=not native, **kw) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        ran = eng.scheduler.runner.model.native._step is not None
    assert ran == native
    return out


def _greedy(path: str, prompts: list[list[int]], native: bool, **kw) -> list[list[int]]:
    return [r["output_ids"] for r in _generate(path, prompts, native, **kw)]


PROMPTS = [[3, 4, 5, 6, 7], [11, 2, 9], [40, 41, 42, 43, 44, 45, 46]]


@pytest.mark.parametrize("name", NAMES)
def test_exact_greedy_tokens_equal_transformers(name, dirs):
    """Engine greedy decoding with the native step (exact path) equals transformers' generate."""
    ref = load_hf_reference(dirs[name])
    out = _greedy(dirs[name], PROMPTS, True, **EXACT)
    assert out == [hf_greedy(ref, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("q8", Q8)
def test_q8_0_greedy_tokens_native_equal_python(q8, dirs):
    """The quantized GGUF served as `sparkserve serve` does (int8 activations), batch 1 and 3: native
    step on and off give the same greedy tokens, up to a near-tie: where the two part, the Python
    path ranks the native step's token second, within 0.05 of its own logprob (they round fp32
    differently in places, which moves logprobs by ~0.01 and flips a tie that close: kv_b's halves
    held as blocks or as their fp32 values flip one in this fixture); a wrong weight, head or expert
    parts them by far more."""
    for batch in (PROMPTS[:1], PROMPTS):
        native = _greedy(dirs[q8], batch, True, activation_quant="int8")
        python = _generate(dirs[q8], batch, False, activation_quant="int8")
        for got, ref in zip(native, python):
            want = ref["output_ids"]
            part = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if part is None:
                assert got == want
                continue
            (first, token), (second, runner_up) = ref["meta_info"]["output_top_logprobs"][part][:2]
            assert token == want[part] and runner_up == got[part] and first - second < 0.05, (part, got, want)


def _file_halves(path: str, layer: int) -> list[torch.Tensor]:
    """The file's attn_k_b / attn_v_b of `layer` as gguf-py dequantizes them, rows per head
    [heads * rows, k]."""
    import gguf
    reader = gguf.GGUFReader(path)
    out = []
    for part in ("k_b", "v_b"):
        t = next(t for t in reader.tensors if t.name == f"blk.{layer}.attn_{part}.weight")
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        out.append(torch.from_numpy(values.reshape(-1, values.shape[-1]).copy()))
    return out


@pytest.mark.parametrize("key,mode,want", [
    ("q8_0_wide", "int8", (Q8_0, Q8_0)), ("q8_0_wide", "none", (Q8_0, Q8_0)),
    ("q5_0_wide", "int8", (Q8_0, Q4_0)),     # Q5_0 held exactly as Q8_0 (read fast with fp32 x)
    ("q5_0_wide", "none", None),             # the exact path reads no Q5_0: fp32 values
    ("q8_0", "int8", None)])                 # 8-wide heads: F16 in the file, not whole blocks
def test_kv_b_halves_held_as_the_files_blocks(key, mode, want, dirs):
    """A GGUF's split kv_b halves are held as blocks of the file's values (no fp32 copy, in the
    Python layer or the native step) wherever the kernels read their type, else as the fp32 join."""
    model = load_model(dirs[key], activation_quant=mode)
    for i, layer in enumerate(model.model.layers):
        kv_b = layer.self_attn.kv_b_proj
        if want is None:
            assert kv_b.k_b is None and kv_b.v_b is None and not kv_b.weight.is_meta
            continue
        assert (kv_b.k_b.qtype, kv_b.v_b.qtype) == want and kv_b.weight.is_meta
        for held, values in zip((kv_b.k_b, kv_b.v_b), _file_halves(dirs[key], i)):
            assert torch.equal(held.dequantize(), values)
        assert kv_b.held_bytes() * 3 < kv_b.weight.numel() * 4


def _fp32_kv_b(model) -> None:
    """Every layer's kv_b as the fp32 join of the values its halves' blocks hold."""
    for layer in model.model.layers:
        kv_b = layer.self_attn.kv_b_proj
        k = kv_b.k_b.dequantize().view(kv_b.h, kv_b.r, kv_b.nope).transpose(1, 2)
        w = torch.cat([k, kv_b.v_b.dequantize().view(kv_b.h, kv_b.vd, kv_b.r)], 1).reshape(-1, kv_b.r)
        kv_b.local_shard(w)
        kv_b.weight.data.copy_(w)
        assert kv_b.k_b is None


def test_kv_b_blocks_equal_their_fp32_values(dirs, monkeypatch):
    """Exact path on kv_b's Q8_0 blocks: the Python path equals the one on the same values in fp32
    (the einsum), and the native step, reading the same blocks, equals the Python path."""
    calls = NativeCalls(monkeypatch)
    native, _ = _drive(dirs["q8_0_wide"], True)
    assert [m for m, _ in calls.calls].count(ForwardMode.DECODE) == 5
    calls.calls.clear()
    python, _ = _drive(dirs["q8_0_wide"], False)
    fp32, _ = _drive(dirs["q8_0_wide"], False, prepare=_fp32_kv_b)
    assert not calls.calls
    assert_close(logits_of(python), logits_of(fp32), 1e-5)
    assert_close(logits_of(native), logits_of(python), 1e-4)


def test_refuses_what_it_does_not_compute(dirs):
    """Experts split over ranks or a router other than DeepSeek-V2's stay on the Python path,
    which names why; the fixtures themselves run natively."""
    model = load_model(dirs["q8_0"], activation_quant="int8")
    assert unsupported(model) is None
    block = model.model.layers[1].mlp
    block.gate.rule = "softmax_topk"
    assert unsupported(model) == "the 'softmax_topk' MoE router is not in the native MLA step"
    block.gate.rule = "softmax_greedy"
    block.experts.local = block.experts.num_experts - 1
    assert unsupported(model) == "a MoE layer's experts are neither the MoE kernel's blocks nor fp32"
