"""Kimi-Linear from GGUF files as llama.cpp's convert_hf_to_gguf.py writes them (family_fixtures.write_gguf,
checked byte for byte against the real converter by benchmarks/gguf_conformance.py): the config read
from the kimi-linear metadata, KDA's `ssm_*` tensors (-exp(A_log), the convs' 4-D shape), MLA's split
kv_b, stacked experts and the routing bias. The GGUF's logits equal the HF directory's (the original
checkpoint format the converter reads) and transformers'."""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from family_fixtures import write_gguf
from kimi_fixtures import CONFIGS, as_original_checkpoint, make_kimi

from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.kernels.blocks import Q8_0
from sparkserve.layers.kda import KimiDeltaAttention
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.models.kimi_linear import KimiArgs
from sparkserve.models.registry import load_config, load_model

IDS = torch.randint(3, CONFIGS["gguf"]["vocab_size"], (40,),
                    generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", params=["gguf", "gguf_qlora"])
def kimi(tmp_path_factory, request) -> dict[str, str]:
    """The original-format directory (every value rounded to bfloat16, which float16 holds: the F16
    file holds the same numbers) and its f32 / f16 / q8_0 GGUF files; without and with q LoRA."""
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("kimi_gguf")
    path = as_original_checkpoint(make_kimi(str(root / "hf"), request.param))
    file = os.path.join(path, "model.safetensors")
    save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(file).items()}, file,
              metadata={"format": "pt"})
    files = {f: write_gguf(path, str(root / f"kimi.{f}.gguf"), f) for f in ("f32", "f16", "q8_0")}
    q8 = str(root / "hf_q8_0")
    shutil.copytree(path, q8)
    save_file({k: _q8_0_values(k, v) for k, v in load_file(file).items()},
              os.path.join(q8, "model.safetensors"), metadata={"format": "pt"})
    return {"hf": path, "hf_q8_0": q8, **files}


def _q8_0_values(name: str, t: torch.Tensor) -> torch.Tensor:
    """A weight as the Q8_0 file holds it (the converter quantizes a matrix whose rows are whole
    blocks and that it does not keep F32: not a norm, the router or a conv)."""
    import gguf
    if (t.dim() < 2 or not name.endswith(".weight") or t.shape[-1] % 32 or "norm" in name
            or name.endswith(".gate.weight") or "conv1d" in name):
        return t
    q8 = gguf.GGMLQuantizationType.Q8_0
    values = gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8)
    return torch.from_numpy(values.reshape(t.shape))


def prefill_logits(path: str, activation_quant: str = "none") -> torch.Tensor:
    """Every position's logits of IDS, one prefill through ModelRunner."""
    model = load_model(path, load_config(path), activation_quant=activation_quant)
    n = len(IDS)
    cache = KVCacheManager(64, 1, 2, 65, disable_radix_cache=True)
    runner = ModelRunner(model, model.make_pool(64, 2), cache.req_to_token.table)
    row = cache.req_to_token.alloc()
    slots = cache.allocator.alloc(0, n, 0)
    cache.req_to_token.table[row, :n] = slots
    with torch.no_grad():
        fb = runner.build_batch(ForwardMode.EXTEND, [ScheduledReq(row, 0, IDS, slots, n)])
        fb.logits_rows = torch.arange(fb.num_tokens)
        return runner.forward(fb).float()


@pytest.fixture(scope="module")
def reference(kimi) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(kimi["hf"], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def test_gguf_config_equals_hf(kimi):
    """The kimi-linear metadata gives the original config.json's KimiArgs (what the model reads)."""
    hf, gguf = load_config(kimi["hf"]), load_config(kimi["f32"])
    assert gguf.architecture == hf.architecture == "KimiLinearForCausalLM"
    n = hf.num_hidden_layers
    got, want = KimiArgs.from_raw(gguf.raw, n), KimiArgs.from_raw(hf.raw, n)
    assert got.scaling == pytest.approx(want.scaling, rel=1e-6)       # GGUF metadata holds float32
    assert dataclasses.replace(got, scaling=want.scaling) == want
    assert (gguf.hidden_size, gguf.intermediate_size, gguf.num_attention_heads, gguf.vocab_size,
            gguf.tie_word_embeddings) == (hf.hidden_size, hf.intermediate_size, hf.num_attention_heads,
                                          hf.vocab_size, hf.tie_word_embeddings)
    assert gguf.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_gguf_logits_equal_hf_dir_and_transformers(kimi, reference, ftype):
    """F32 and F16 files (the same numbers) give the HF directory's logits, which equal transformers'.
    (The F16 file's projections, KDA's too, run on the block kernel over the same values: another
    fp32 summation order than the directory's GEMM, ~2e-5 here.)"""
    hf = prefill_logits(kimi["hf"])
    torch.testing.assert_close(hf, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prefill_logits(kimi[ftype]), hf, rtol=1e-5, atol=5e-5)


def test_q8_0_gguf_equals_its_values(kimi):
    """A Q8_0 file gives the logits of an HF directory holding its quantized values (fp32 activations),
    and stays near them served as the engine does (int8 activations, experts kept as blocks)."""
    want = prefill_logits(kimi["hf_q8_0"])
    assert not torch.allclose(want, prefill_logits(kimi["hf"]), atol=1e-2)     # the rounding shows
    torch.testing.assert_close(prefill_logits(kimi["q8_0"]), want, rtol=1e-4, atol=1e-4)
    got = prefill_logits(kimi["q8_0"], activation_quant="int8")
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.7


@pytest.mark.parametrize("mode", ["int8", "none"])
def test_q8_0_kda_projections_held_as_the_files_blocks(kimi, mode):
    """A Q8_0 file's KDA input projections (q, k, v, f_a, g_a, beta: one fused Linear) are held as
    the file's blocks, which the block kernels read, not dequantized to fp32 for good; their values
    are the file's (test_q8_0_gguf_equals_its_values: the logits they give)."""
    import gguf
    reader = gguf.GGUFReader(kimi["q8_0"])
    tensors = {t.name: t for t in reader.tensors}
    model = load_model(kimi["q8_0"], load_config(kimi["q8_0"]), activation_quant=mode)
    kda = [(i, layer.self_attn) for i, layer in enumerate(model.model.layers)
           if isinstance(layer.self_attn, KimiDeltaAttention)]
    assert kda
    for i, attn in kda:
        blocks = attn.in_proj.inference_blocks()
        assert blocks is not None and blocks.gguf_type == Q8_0, i
        parts = [tensors[f"blk.{i}.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v", "ssm_f_a", "ssm_g_a",
                                                            "ssm_beta")]
        want = torch.cat([torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)) for t in parts])
        assert torch.equal(blocks.dequantize(), want)


def test_q8_0_gguf_tp2_ep2_equals_one_process(kimi):
    """The Q8_0 file over two ranks (KDA and MLA heads split, experts held as blocks one half per
    rank) serves the tokens and logprobs of one process."""
    from parallel_fixtures import COMMON, assert_same, run_mixed

    from sparkserve import Engine
    kw = dict(COMMON, activation_quant="none", kv_cache_dtype="float32")
    with Engine(kimi["q8_0"], **kw) as eng:
        want = run_mixed(eng)
    with Engine(kimi["q8_0"], tp_size=2, ep_size=2, **kw) as eng:
        got = run_mixed(eng)
    assert_same(got, want)
