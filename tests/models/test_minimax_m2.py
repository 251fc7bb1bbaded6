"""MiniMax-M2 (models/minimax_m2.py) against transformers' MiniMaxM2ForCausalLM: logits through the
serving path (chunked prefill, batched decode, a mixed extend) from the HF directory (as transformers
saves it, and with the released config's top-level `rotary_dim`) and from GGUF files as llama.cpp's
converter writes them (arch minimax-m2: F32 / F16 equal the directory; Q8_0 equal a directory of the
file's values), engine greedy tokens, and --tp-size 2 --ep-size 2 equal to one process.
Checkpoints: tests/minimax_m2_fixtures.py."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import EXACT, assert_no_kv_leak, hf_greedy, load_hf_reference
from family_fixtures import write_gguf
from minimax_m2_fixtures import (
    GGUF_EXPERTS,
    GGUF_LAYER,
    GGUF_TOP,
    VOCAB,
    as_released_config,
    make_minimax_m2,
    write_minimax_m2_gguf,
)
from parallel_fixtures import COMMON, assert_same, run_mixed
from test_model_logits import Driver, check_against_hf, make_runner, run_schedule
from test_native_step import Counter

from sparkserve import Engine
from sparkserve.config import ModelConfig
from sparkserve.layers.norm import WidthRMSNorm
from sparkserve.loader.gguf import gguf_config
from sparkserve.models.minimax_m2 import MiniMaxM2ForCausalLM


@pytest.fixture(scope="module")
def m2_dir(tmp_path_factory) -> str:
    return make_minimax_m2(str(tmp_path_factory.mktemp("minimax_m2") / "m2"))


@pytest.fixture(scope="module")
def m2_ref(m2_dir):
    return load_hf_reference(m2_dir)


def run_checked(path: str, ref, native: bool = True) -> None:
    """Every logits row of the test_model_logits schedule vs `ref` (1e-4 of the largest logit), through
    the native decode step or the Python layer path."""
    runner, cache = make_runner(path, 1)
    runner.model.enable_native_step(native)
    driver = Driver(runner, cache)
    run_schedule(driver, VOCAB, [13, 1, 23, 6], decode_steps=6, seed=2)
    check_against_hf(driver, ref)
    driver.release()
    assert cache.allocator.free_slots == cache.num_slots


def test_config_reads_the_family(m2_dir, tmp_path):
    cfg = ModelConfig.from_hf_dir(m2_dir)
    assert (cfg.architecture, cfg.rotary_dim, cfg.qk_norm, cfg.qk_norm_full_width) == \
        ("MiniMaxM2ForCausalLM", 8, True, True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_router,
            cfg.moe_layers) == (4, 2, 32, "sigmoid_grouped", [True, True])
    released = as_released_config(shutil.copytree(m2_dir, str(tmp_path / "released")))
    got = ModelConfig.from_hf_dir(released)
    assert (got.rotary_dim, got.rope_theta) == (8, 5000000.0)


def test_logits_match_transformers(m2_dir, m2_ref):
    run_checked(m2_dir, m2_ref)


def test_released_config_matches_transformers(m2_dir, tmp_path):
    """The released config's layout (rotary_dim, rope_theta at the top level), read by both."""
    path = as_released_config(shutil.copytree(m2_dir, str(tmp_path / "released")))
    run_checked(path, load_hf_reference(path))


def test_every_one_d_tensor_counts(m2_dir, m2_ref, tmp_path):
    """The routing bias and the full-width q/k norms are read: zeroing the bias (or setting the q norm
    to 1) changes the logits, so the test above would see either dropped."""
    from safetensors.torch import load_file, save_file
    path = shutil.copytree(m2_dir, str(tmp_path / "changed"))
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    assert w["model.layers.0.self_attn.q_norm.weight"].shape == (64,)       # every head's channels
    w["model.layers.0.block_sparse_moe.e_score_correction_bias"] = torch.tensor([2.0, 0.0, 0.0, 2.0])
    save_file(w, file, metadata={"format": "pt"})
    with pytest.raises(AssertionError):
        run_checked(path, m2_ref)
    run_checked(path, load_hf_reference(path))


def test_model_shape(m2_dir):
    from sparkserve.models.registry import load_model
    model = load_model(m2_dir, activation_quant="none")
    assert isinstance(model, MiniMaxM2ForCausalLM)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, WidthRMSNorm) and attn.q_norm.weight.shape == (64,)
    gate = model.model.layers[1].mlp.gate
    assert (gate.rule, gate.num_groups, gate.renormalize, gate.scaling) == ("sigmoid_grouped", 1, True, 1.0)
    assert not torch.all(gate.e_score_correction_bias == 0)


@pytest.fixture(scope="module")
def m2_bf16(m2_dir, tmp_path_factory) -> str:
    """The checkpoint in bf16 (its values already are): block weights, which the native step runs."""
    from safetensors.torch import load_file, save_file
    path = shutil.copytree(m2_dir, str(tmp_path_factory.mktemp("minimax_m2_bf16") / "m2"))
    file = os.path.join(path, "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("native", [False, True])
def test_native_step_matches_transformers(m2_bf16, m2_ref, native, monkeypatch):
    """The native decode step (sigmoid routing with the correction bias in C++, full-width q/k norms,
    partial rotary) and the Python layer path on the bf16 copy: logits equal transformers'."""
    calls = Counter(monkeypatch)
    run_checked(m2_bf16, m2_ref, native)
    assert (len(calls.calls) >= 6) if native else not calls.calls


def test_greedy_tokens_match_transformers(m2_dir, m2_ref):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 19, 11)]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(m2_dir, max_total_tokens=1024, **EXACT) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        assert_no_kv_leak(eng.scheduler.cache)
    for p, r in zip(prompts, out):
        assert r["output_ids"] == hf_greedy(m2_ref, p, 12)


def test_mtp_layers_are_not_read(m2_dir, m2_ref, tmp_path):
    """A released checkpoint's multi-token-prediction layers (past num_hidden_layers) are skipped."""
    from safetensors.torch import load_file, save_file
    path = shutil.copytree(m2_dir, str(tmp_path / "mtp"))
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    w.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in w.items() if "layers.1." in k})
    save_file(w, file, metadata={"format": "pt"})
    run_checked(path, m2_ref)


# ---- GGUF (arch minimax-m2, as convert_hf_to_gguf.py MiniMaxM2Model writes it) ----------------------


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_gguf_equals_hf_dir(ftype, m2_dir, m2_ref, tmp_path):
    path = write_gguf(m2_dir, str(tmp_path / f"m2.{ftype}.gguf"), ftype)
    cfg, want = gguf_config(path), ModelConfig.from_hf_dir(m2_dir)
    for f in ("architecture", "qk_norm", "qk_norm_full_width", "rotary_dim", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "moe_router", "moe_layers", "head_dim",
              "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(cfg, f) == getattr(want, f), f
    assert cfg.rope_theta == pytest.approx(want.rope_theta, rel=1e-6)
    run_checked(path, m2_ref)


def test_gguf_q8_0_equals_its_values(m2_dir, tmp_path):
    """Q8_0 weights (experts held as their blocks) give the logits of an HF directory of the file's
    dequantized values, in transformers, with fp32 activations."""
    import gguf
    from safetensors.torch import load_file, save_file

    from sparkserve.loader.gguf_file import GGUFFile
    path = write_gguf(m2_dir, str(tmp_path / "m2.q8_0.gguf"), "q8_0")
    values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in GGUFFile(path).tensors}
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in GGUFFile(path).tensors)
    ref_dir = shutil.copytree(m2_dir, str(tmp_path / "q8_values"))
    file = os.path.join(ref_dir, "model.safetensors")
    w = load_file(file)
    for name in w:
        w[name] = torch.from_numpy(np.ascontiguousarray(_file_values(name, values)))
    save_file(w, file, metadata={"format": "pt"})
    run_checked(path, load_hf_reference(ref_dir))


def _file_values(name: str, values: dict[str, np.ndarray]) -> np.ndarray:
    """HF tensor `name`'s values as the GGUF file holds them (the writer's names)."""
    if name in GGUF_TOP:
        return values[GGUF_TOP[name]]
    _, _, layer, rest = name.split(".", 3)
    m = re.fullmatch(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", rest)
    if m:
        return values[f"blk.{layer}.{GGUF_EXPERTS[m[2]]}.weight"][int(m[1])]
    return values[f"blk.{layer}.{GGUF_LAYER[rest]}"]


def test_gguf_refuses_another_gating_function(m2_dir, tmp_path):
    """llama.cpp routes by the file's expert_gating_func; MiniMax-M2's is sigmoid (2): another is refused."""
    path = write_minimax_m2_gguf(m2_dir, str(tmp_path / "softmax.gguf"), "f32", gating_func=1)
    with pytest.raises(ValueError, match="expert_gating_func"):
        gguf_config(path)


# ---- parallel ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(m2_dir):
    return run_mixed(Engine(m2_dir, **COMMON, **EXACT))


@pytest.mark.parametrize("layout,held", [
    (dict(tp_size=2, ep_size=2), [(2, 1, 2)] * 2),      # 2 of the 4 experts a rank
    (dict(tp_size=2, ep_size=1), [(2, 1, 4)] * 2),      # every expert, half its width
    (dict(pp_size=2), [(4, 2, 4)]),                     # the driver's stage: layer 0
])
def test_ranks_equal_one_process(m2_dir, one_process, layout, held):
    """--tp-size 2 (experts whole or split by width) and --pp-size 2 (gloo, one thread a rank): heads,
    the full-width q/k norms (their sum of squares over the ranks) and experts split; tokens and
    logprobs equal one process's."""
    with Engine(m2_dir, **layout, **COMMON, **EXACT) as eng:
        model = eng.scheduler.runner.model
        got_held = [(model.model.layers[i].self_attn.h, model.model.layers[i].self_attn.hkv,
                     model.model.layers[i].mlp.experts.local) for i in model.layer_range]
        got = run_mixed(eng)
    assert got_held == held
    assert_same(got, one_process)


# ---- the released checkpoints' FP8 form ------------------------------------------------------------


def test_fp8_block_checkpoint_equals_its_values(m2_dir, tmp_path):
    """MiniMax-M2 ships FP8 (e4m3 weights, one float32 weight_scale_inv per 128 x 128 block; router,
    routing bias, norms and LM head unquantized): each block dequantized as it loads gives the logits
    of transformers on a directory of those values (blocks of 32 x 16 here, cut at the edges)."""
    from safetensors.torch import load_file, save_file
    block = (32, 16)
    fp8_dir, ref_dir = (shutil.copytree(m2_dir, str(tmp_path / n)) for n in ("fp8", "values"))
    w = load_file(os.path.join(m2_dir, "model.safetensors"))
    quant, values = {}, {}
    g = torch.Generator().manual_seed(7)
    for name, t in w.items():
        if t.dim() != 2 or "embed_tokens" in name or "lm_head" in name or ".gate." in name:
            quant[name] = values[name] = t
            continue
        rows, cols = t.shape
        scale = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=g) * 0.01 + 0.002
        expanded = torch.kron(scale, torch.ones(block))[:rows, :cols]
        q = (t / expanded).to(torch.float8_e4m3fn)
        quant[name], quant[f"{name}_scale_inv"] = q, scale
        values[name] = q.float() * expanded
    save_file(quant, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(values, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    run_checked(fp8_dir, load_hf_reference(ref_dir))
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        Engine(fp8_dir, **EXACT)
    from sparkserve.loader.hf import _fp8_block  # GPT-OSS's released MXFP4 experts stay readable
    assert _fp8_block({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}) is None
