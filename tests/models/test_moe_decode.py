"""The MoE decode path (layers/moe_decode.py, kernels/moe_experts.cpp): a Q8_0 GGUF's experts served
under int8 activations run in one kernel call per layer at decode and small batches, and give what
the Python expert loop (moe.py grouped_experts over the same block Linears) gives, for every MoE
family (SwiGLU experts; GPT-OSS's clamped SwiGLU with biases; DeepSeek-V2's shared experts beside)."""
from __future__ import annotations

import pytest
import torch
from family_fixtures import make_family_checkpoint, write_gguf

from sparkserve import Engine
from sparkserve.layers import moe, moe_decode
from sparkserve.models.registry import load_model

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
    """Through the Engine at batch 1 and 3: every decode step's MoE layers take the kernel, and the
    greedy tokens equal those of the Python expert loop (the path forced by MAX_TOKENS = 0)."""
    taken = []
    real = moe.decode_experts

    def counting(ex, x, weights, ids):
        y = real(ex, x, weights, ids)
        taken.append((x.shape[0], y is not None))
        return y
    prompts = [[3, 4, 5, 6, 7], [11, 2, 9], [40, 41, 42, 43, 44, 45, 46]]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def tokens(batch: list[list[int]]) -> list[list[int]]:
        with Engine(q8_ggufs[name], max_total_tokens=512, activation_quant="int8") as eng:
            return [r["output_ids"] for r in eng.generate(input_ids=batch, sampling_params=sp)]
    monkeypatch.setattr(moe, "decode_experts", counting)
    fast = [tokens(prompts[:1]), tokens(prompts)]
    decode_calls = [ok for rows, ok in taken if rows <= len(prompts)]
    assert decode_calls and all(decode_calls)
    monkeypatch.setattr(moe_decode, "MAX_TOKENS", 0)
    taken.clear()
    assert [tokens(prompts[:1]), tokens(prompts)] == fast
    assert taken and not any(ok for _, ok in taken)
