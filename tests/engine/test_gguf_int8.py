"""GGUF quant types the int8 kernels do not read (Q4_K, Q5_*, Q6_K, Q2_K, Q3_K) held in ones they
do (loader/gguf_int8.py), checked against gguf-py's own dequantization: block by block for
each type, and a SmolLM2 file re-encoded into a Q4_K_M-like mix served with int8 activations
against the same file's exact fp32 weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from int8_fixtures import assert_int8_close, chunked_logits

from sparkserve.kernels.blocks import BLOCK_BYTES, Q4_1, Q6_S, Q8_0
from sparkserve.loader.gguf_int8 import Q4_0, Q4_K, group_form, int8_blocks, int8_form

T = gguf.GGMLQuantizationType
# Where each type keeps its fp16 scales (byte offsets in a block): random bytes elsewhere are valid
# quants and sub-scales; these are set to scales a weight has.
_FP16_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
                T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,)}


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator, scale=None) -> np.ndarray:
    """uint8 [n, bytes] of random valid blocks; `scale(shape)` draws the fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        s = scale(len(raw)) if scale else rng.uniform(2 ** -12, 2 ** -8, len(raw))
        raw[:, off:off + 2] = s.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(n, -1)


def dequantized(qtype: T, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks [n, k / 256 * 144] of fp32 [n, k]: per sub-block of 32 a 6-bit scale and min of
    the super-block's fp16 d and dmin, values rounded onto them (a plain encoder, not llama.cpp's
    search; gguf-py has none for K-quants)."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    step, mins = (hi - lo) / 15, -lo
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    d16, dmin16 = np.where(d == 0, 1, d).astype(np.float32), np.where(dmin == 0, 1, dmin).astype(np.float32)
    sc = np.clip(np.rint(step / d16[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / dmin16[:, None]), 0, 63).astype(np.uint8)
    eff = np.where(sc == 0, 1, sc * d.astype(np.float32)[:, None])
    q = np.clip(np.rint((x + (mn * dmin.astype(np.float32)[:, None])[..., None]) / eff[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=1)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs],
                          axis=1).reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, k / 256 * 210] of fp32 [n, k]: per 16 elements an int8 scale of the
    super-block's fp16 d, values rounded onto it in [-32, 31] (a plain encoder; gguf-py has none)."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(x).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    d32 = np.where(d == 0, 1, d).astype(np.float32)
    sc = np.clip(np.rint(step / d32[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.rint(x / (sc * d32[:, None])[..., None]), -32, 31).astype(np.int16)
    u = (q + 32).astype(np.uint8).reshape(-1, 256)
    low, high = (u & 0x0F).reshape(-1, 2, 2, 64), (u >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)      # element 128h + 64s + i
    qh = np.bitwise_or.reduce(high << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1), axis=2)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)],
                          axis=1).reshape(n, -1)


def test_q6_k_encoder_round_trips():
    w = np.random.default_rng(5).standard_normal((8, 512)).astype(np.float32)
    back = dequantized(T.Q6_K, encode_q6_k(w)).numpy()
    step = np.abs(w).reshape(-1, 16).max(-1, keepdims=True) / 31
    assert (np.abs(back - w).reshape(-1, 16) <= 0.6 * step + 1e-6).all()


def test_q4_k_encoder_round_trips():
    """The test's own encoder writes what gguf-py reads back (within a 4-bit step)."""
    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) * 0.05
    back = dequantized(T.Q4_K, encode_q4_k(w)).numpy()
    step = (w.reshape(-1, 32).max(-1) - np.minimum(w.reshape(-1, 32).min(-1), 0)) / 15
    assert np.all(np.abs(back - w).reshape(-1, 32).max(-1) <= 0.6 * step + 1e-6)


@pytest.mark.parametrize("qtype, form", [(T.Q4_0, Q4_1), (T.Q5_0, Q6_S), (T.Q5_0, Q8_0), (T.Q6_K, Q6_S)])
def test_exact_conversions_keep_their_values(qtype, form):
    """Q4_0 as Q4_1 (beside Q4_1 tensors in a fused projection), Q5_0 as Q6_S (its own form) or
    Q8_0 (beside Q8_0 tensors), Q6_K as Q6_S (its 6-bit values and int8 scales of 16 in blocks of
    32): gguf-py's values exactly."""
    raw = random_blocks(qtype, 48, 512, np.random.default_rng(1))
    assert form == int8_form(int(qtype)) or (qtype, form) in ((T.Q5_0, Q8_0), (T.Q4_0, Q4_1))
    b = int8_blocks(int(qtype), raw, (48, 512), form)
    assert b.qtype == form and b.blocks.shape == (48, 16 * BLOCK_BYTES[form])
    assert torch.equal(b.dequantize(), dequantized(qtype, raw))


def test_q4_k_becomes_q4_1_with_its_values():
    """Exactly where the sub-blocks' scales are fp16 values (power-of-two d and dmin times a 6-bit
    integer); otherwise within fp16's rounding of the products d * scale and dmin * min."""
    rng = np.random.default_rng(2)
    exact = random_blocks(T.Q4_K, 32, 512, rng, lambda n: 2.0 ** rng.integers(-14, -8, n))
    b = int8_blocks(Q4_K, exact, (32, 512), int8_form(Q4_K))
    assert b.qtype == Q4_1
    assert torch.equal(b.dequantize(), dequantized(T.Q4_K, exact))
    rounded = random_blocks(T.Q4_K, 32, 512, rng)
    assert_within_scale_rounding(int8_blocks(Q4_K, rounded, (32, 512), Q4_1).dequantize(),
                                 dequantized(T.Q4_K, rounded))


def assert_within_scale_rounding(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Q4_K's weights as Q4_1 ones, the fp16 products d * scale and dmin * min each rounded by at
    most 2^-11 of themselves: |w - m| <= 2 max|w| and |m| <= max|w| per block of 32."""
    amax = ref.reshape(-1, 32).abs().max(-1).values
    err = (got - ref).abs().reshape(-1, 32).max(-1).values
    assert (err <= amax * 3 * 2 ** -11).all() and err.max() > 0


def test_q4_k_scales_beyond_fp16_take_q8_0():
    """A sub-block scale too large for an fp16 (as Q4_1 holds it): that tensor is requantized to
    Q8_0 instead, within Q8_0's rounding."""
    raw = random_blocks(T.Q4_K, 16, 256, np.random.default_rng(3), lambda n: np.full(n, 2048.0))
    b = int8_blocks(Q4_K, raw, (16, 256), Q4_1)
    assert b.qtype == Q8_0
    ref = dequantized(T.Q4_K, raw)
    amax = ref.reshape(-1, 32).abs().max(-1).values
    assert ((b.dequantize() - ref).abs().reshape(-1, 32).max(-1).values <= amax / 254 + amax * 2 ** -10).all()


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q6_K, Q4_1])
def test_other_types_become_q8_0_within_its_rounding(qtype):
    """Requantized from gguf-py's values: each within half a Q8_0 step of its block (fp16's rounding
    of the step aside). Q4_1 and Q6_K are requantized only to join Q8_0 parts of a fused projection."""
    rng = np.random.default_rng(4)
    raw = (random_blocks(T(qtype), 16, 512, rng) if qtype != Q4_1 else
           gguf.quants.quantize(rng.standard_normal((16, 512)).astype(np.float32), T.Q4_1))
    ref = dequantized(T(qtype), raw)
    b = int8_blocks(int(qtype), raw, (16, 512), Q8_0)
    assert b.qtype == Q8_0 and (qtype in (Q4_1, T.Q6_K) or int8_form(int(qtype)) == Q8_0)
    err = (b.dequantize() - ref).abs().reshape(-1, 32).max(-1).values
    amax = ref.reshape(-1, 32).abs().max(-1).values
    assert (err <= amax / 254 + amax * 2 ** -10).all() and err.max() > 0


def test_kept_types_and_fused_forms():
    assert int8_form(Q4_1) is None and int8_form(Q8_0) is None and int8_form(int(T.F16)) is None
    assert int8_form(Q4_0) is None and group_form([Q4_0, Q4_0]) == Q4_0
    assert group_form([Q4_K, Q4_K, Q4_0]) == Q4_1          # one form already
    assert group_form([Q4_K, Q4_K, int(T.Q6_K)]) == Q8_0   # Q4_K_M's q|k|v in some layers
    assert group_form([int(T.Q6_K), int(T.Q5_0)]) == Q6_S   # both exact in it
    assert group_form([int(T.Q5_0), Q8_0]) == Q8_0
    assert group_form([Q4_1, Q8_0]) == Q8_0
    assert group_form([Q4_K, int(T.F16)]) is None


def _rewrite(src: str, dst: str, encodings: dict[str, T]) -> None:
    """`src` with the tensors named in `encodings` re-encoded from their values into that type."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        new = encodings.get(t.name)
        if new is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        encode = {T.Q4_K: encode_q4_k, T.Q6_K: encode_q6_k}.get(new, lambda w: gguf.quants.quantize(w, new))
        data = encode(w)
        writer.add_tensor(t.name, data, raw_dtype=new)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixed_gguf(smollm2_path, tmp_path_factory) -> str:
    """SmolLM2 in a mix of the types llama.cpp's K-quant presets write (Q4_K only where a row is a
    multiple of 256 wide: the down projections; the 576-wide ones take other types, as there):
    layer 0 Q4_0 q/k beside a Q5_1 v, Q5_0 gate/up, Q4_K down; layer 1 all Q4_0; layer 2 a Q4_0
    gate beside the shipped Q4_1 up and a Q4_K down; layer 3 a Q6_K down; a Q5_0 embedding (and
    tied LM head); the other layers as shipped (Q4_1)."""
    path = str(tmp_path_factory.mktemp("kquant") / "smollm2-mixed.gguf")
    enc = {"token_embd.weight": T.Q5_0, "blk.0.attn_q.weight": T.Q4_0, "blk.0.attn_k.weight": T.Q4_0,
           "blk.0.attn_v.weight": T.Q5_1, "blk.0.ffn_gate.weight": T.Q5_0, "blk.0.ffn_up.weight": T.Q5_0,
           "blk.0.ffn_down.weight": T.Q4_K, "blk.2.ffn_gate.weight": T.Q4_0, "blk.2.ffn_down.weight": T.Q4_K,
           "blk.3.ffn_down.weight": T.Q6_K}
    enc.update({f"blk.1.{p}.weight": T.Q4_0 for p in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                      "ffn_gate", "ffn_up", "ffn_down")})
    _rewrite(smollm2_path, path, enc)
    return path


@torch.no_grad()
def test_mixed_gguf_runs_on_the_int8_kernels(mixed_gguf):
    """Served with int8 activations, every projection of the mixed file is held as packed blocks of
    a type the int8 kernels read (no fp32 weight), of the form its types give; layer 1's Q4_0
    weights, layer 3's Q6_K ones and the Q5_0 embedding are the file's values exactly, layer 2's
    Q4_K ones within fp16's rounding of their scales; and the model's logits stay within the int8
    tolerance of the same file's exact fp32 weights (int8_fixtures)."""
    from sparkserve.frontend.tokenizer import load_tokenizer
    from sparkserve.models.registry import load_model
    i8 = load_model(mixed_gguf, activation_quant="int8")
    l0, l1 = i8.model.layers[0], i8.model.layers[1]
    l2, l3 = i8.model.layers[2], i8.model.layers[3]
    forms = {l0.self_attn.qkv_proj: Q8_0, l0.mlp.gate_up_proj: Q6_S, l0.mlp.down_proj: Q4_1,
             l1.self_attn.qkv_proj: Q4_0, l1.self_attn.o_proj: Q4_0, l1.mlp.down_proj: Q4_0,
             l2.mlp.gate_up_proj: Q4_1, l2.mlp.down_proj: Q4_1, l3.mlp.down_proj: Q6_S, i8.lm_head: Q6_S,
             i8.model.embed_tokens: Q6_S}
    for m, form in forms.items():
        assert m.held_blocks.gguf_type == form and m.held_blocks.is_packed and m.weight.is_meta
    assert i8.checkpoint_for_int8
    reader = gguf.GGUFReader(mixed_gguf)
    raw = {t.name: t for t in reader.tensors}
    down = raw["blk.1.ffn_down.weight"]
    assert torch.equal(l1.mlp.down_proj.held_blocks.dequantize(), dequantized(T.Q4_0, down.data))
    down = raw["blk.3.ffn_down.weight"]
    assert torch.equal(l3.mlp.down_proj.held_blocks.dequantize(), dequantized(T.Q6_K, down.data))
    embed = raw["token_embd.weight"]
    assert torch.equal(i8.model.embed_tokens.held_blocks.dequantize(), dequantized(T.Q5_0, embed.data))
    down = raw["blk.2.ffn_down.weight"]
    assert_within_scale_rounding(l2.mlp.down_proj.held_blocks.dequantize(), dequantized(T.Q4_K, down.data))

    text = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
            "    return a\n\nThe capital of France is Paris, and the capital of Italy is Rome.")
    tokens = load_tokenizer(mixed_gguf).encode(text, add_special_tokens=True)
    exact = load_model(mixed_gguf, activation_quant="none")
    assert not exact.checkpoint_for_int8
    assert exact.model.layers[0].self_attn.qkv_proj.inference_blocks() is None    # fp32, exact
    assert_int8_close(chunked_logits(exact, tokens), chunked_logits(i8, tokens), tokens)
