"""MLA decode through the paged decode attention kernel (layers/mla.py `_latent_kernel`: the latent
pool read in place as one shared K = V head) equals SDPA over the gathered latent rows, and a
quantized DeepSeek-V2 GGUF keeps the blocks of its rope-reordered projections (q_b, kv_a)."""
from __future__ import annotations

import json

import torch
from family_fixtures import make_family_checkpoint, write_gguf
from test_model_logits import Driver, make_runner, run_schedule
from test_native_step import assert_close, logits_of

from sparkserve.layers import mla
from sparkserve.models.registry import load_model


def test_latent_kernel_equals_sdpa(tmp_path, monkeypatch):
    """Chunked prefill, batched decode of 4 requests and a mixed extend: every logits row with the
    kernel equals the SDPA path's (forced by a _latent_kernel that declines), and the kernel ran."""
    path = make_family_checkpoint("deepseek_v2_qlora", str(tmp_path / "ds"))
    hits = []
    real = mla.MLAttention._latent_kernel

    def counting(self, *args):
        out = real(self, *args)
        hits.append(out is not None)
        return out
    outs = []
    for kernel in (True, False):
        monkeypatch.setattr(mla.MLAttention, "_latent_kernel", counting if kernel else lambda *a: None)
        runner, cache = make_runner(path, 1)
        pool = runner.model.make_pool(cache.num_slots, 8)
        runner = type(runner)(runner.model, pool, cache.req_to_token.table)
        runner.model.enable_native_step(False)      # the layer path (the native step: test_native_mla.py)
        d = Driver(runner, cache)
        run_schedule(d, runner.model.config.vocab_size, [13, 1, 23, 6], decode_steps=6, seed=5)
        outs.append(logits_of(d))
    assert any(hits)
    assert_close(outs[0], outs[1], 1e-4)


def test_quantized_gguf_keeps_rope_reordered_blocks(tmp_path):
    """kv_a_proj_with_mqa of a Q8_0 file (and q_b_proj, when its width is whole blocks: not at the
    fixture's q_lora_rank) holds its blocks, rows permuted pairs -> halves as the values are: its
    int8 output equals the checkpoint weight's (Q8_0 values, rows reordered) to int8 precision."""
    import gguf
    from safetensors.torch import load_file
    src = make_family_checkpoint("deepseek_v2_qlora_gguf", str(tmp_path / "ds"))
    model = load_model(write_gguf(src, str(tmp_path / "ds.gguf"), "q8_0"), activation_quant="int8")
    ck, q8 = load_file(f"{src}/model.safetensors"), gguf.GGMLQuantizationType.Q8_0
    with open(f"{src}/config.json") as f:
        cfg = json.load(f)
    rope, width = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in (0, 1):
        attn = model.model.layers[layer].self_attn
        assert (attn.q_b_proj.inference_blocks() is not None) == (attn.q_b_proj.in_features % 32 == 0)
        assert attn.kv_a_proj_with_mqa.inference_blocks() is not None
        w = ck[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"].numpy()
        w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8))
        want = x @ mla.rope_rows_to_halves(w, rope, width).T
        with torch.no_grad():
            y = attn.kv_a_proj_with_mqa(x)
        torch.testing.assert_close(y, want, rtol=0, atol=3e-2 * want.abs().max().item())
