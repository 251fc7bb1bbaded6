"""MiniMax-M3 from GGUF (arch minimax-m3, as llama.cpp's convert_hf_to_gguf.py MiniMaxM3Model writes a
checkpoint in MiniMax's own layout: tests/minimax_fixtures.py as_original_checkpoint /
write_minimax_m3_gguf): the config rebuilt from the metadata (leading dense blocks full attention, the
rest sparse + MoE, the indexer's sizes), Gemma's 1 + w norms read back, gate / up joined, stacked experts
(or their blocks); logits equal transformers' MiniMaxM3VLForCausalLM on the HF directory through
chunked prefill and batched decode, and --tp-size 2 --ep-size 2 equal to one process."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import EXACT
from family_fixtures import write_gguf
from minimax_fixtures import as_original_checkpoint, make_minimax_exact
from parallel_fixtures import COMMON, assert_same, run_mixed
from test_minimax_m3 import check_rows, decode_schedule, driver, hf_reference

from sparkserve import Engine
from sparkserve.config import ModelConfig
from sparkserve.loader.gguf import gguf_config
from sparkserve.models.minimax_m3 import M3Spec


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    """(HF directory, transformers model, {outtype: GGUF path})."""
    from transformers import MiniMaxM3VLForCausalLM
    root = tmp_path_factory.mktemp("minimax_m3_gguf")
    hf_dir = make_minimax_exact(str(root / "hf"))
    original = as_original_checkpoint(shutil.copytree(hf_dir, str(root / "original")))
    files = {ft: write_gguf(original, str(root / f"m3.{ft}.gguf"), ft) for ft in ("f32", "f16", "q8_0")}
    hf = MiniMaxM3VLForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval().requires_grad_(False)
    return hf_dir, hf, files


def test_gguf_config_equals_hf_dir(m3):
    hf_dir, _, files = m3
    got, want = gguf_config(files["f32"]), ModelConfig.from_hf_dir(hf_dir)
    assert M3Spec.from_config(got) == M3Spec.from_config(want)
    for f in ("architecture", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "intermediate_size", "tie_word_embeddings", "norm_offset"):
        assert getattr(got, f) == getattr(want, f), f
    assert got.norm_offset == 1.0


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_gguf_logits_match_transformers(m3, ftype):
    """Prefill chunks, decode beside them, a short prompt: every row equals transformers on the HF dir."""
    _, hf, files = m3
    drv = driver(files[ftype])
    decode_schedule(drv)
    assert check_rows(drv, hf_reference(hf)) > 100


def test_gguf_q8_0_experts_stay_blocks(m3, tmp_path):
    """Q8_0 experts held as the file's blocks under int8 activations (no fp32 expert copies); with fp32
    activations the logits equal transformers holding the file's dequantized values."""
    import gguf
    from safetensors.torch import load_file, save_file
    from transformers import MiniMaxM3VLForCausalLM

    from sparkserve.loader.gguf_file import GGUFFile
    from sparkserve.models.registry import load_model
    hf_dir, _, files = m3
    model = load_model(files["q8_0"], activation_quant="int8")
    experts = model.model.layers[1].mlp.experts
    assert experts.block_experts is not None and experts.gate_up_proj.is_meta     # no fp32 values
    tensors = GGUFFile(files["q8_0"]).tensors
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in tensors)
    values = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in tensors}
    ref_dir = shutil.copytree(hf_dir, str(tmp_path / "q8_values"))
    file = f"{ref_dir}/model.safetensors"
    w = load_file(file)
    for name in w:
        if (v := _file_values(name, values)) is not None:
            assert v.shape == w[name].shape, name
            w[name] = v.contiguous()
    save_file(w, file, metadata={"format": "pt"})
    hf = MiniMaxM3VLForCausalLM.from_pretrained(ref_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval().requires_grad_(False)
    drv = driver(files["q8_0"])
    decode_schedule(drv)
    assert check_rows(drv, hf_reference(hf)) > 100


# transformers' name (after model.layers.N.) -> the GGUF tensors holding it (joined along dim, rows)
_JOINED = {"self_attn.q_proj.weight": ("attn_q",), "self_attn.k_proj.weight": ("attn_k",),
           "self_attn.v_proj.weight": ("attn_v",), "self_attn.o_proj.weight": ("attn_output",),
           "mlp.gate_up_proj.weight": ("ffn_gate", "ffn_up"), "mlp.down_proj.weight": ("ffn_down",),
           "mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
           "mlp.experts.down_proj": ("ffn_down_exps",),
           "mlp.shared_experts.gate_up_proj.weight": ("ffn_gate_shexp", "ffn_up_shexp"),
           "mlp.shared_experts.down_proj.weight": ("ffn_down_shexp",)}


def _file_values(name: str, values: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The quantized file's values of a transformers tensor (None: an F32 one, which the file holds as is)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return values[top[name]]
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[3] not in _JOINED:
        return None
    got = [values[f"blk.{parts[2]}.{g}.weight"] for g in _JOINED[parts[3]]]
    return torch.cat(got, dim=1 if ".experts." in name else 0)


def test_gguf_tp2_ep2_equals_one_process(m3):
    """--tp-size 2 --ep-size 2 from the F32 GGUF (gloo, one thread a rank) == one process."""
    path, common = m3[2]["f32"], dict(COMMON, **EXACT)
    want = run_mixed(Engine(path, **common))
    with Engine(path, tp_size=2, ep_size=2, **common) as eng:
        got = run_mixed(eng)
    assert_same(got, want)
