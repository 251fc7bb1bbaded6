"""Int8 activations (sparkserve.kernels.quant_linear_int8): x quantized per block of 32 to int8 and
integer dot products against Q4_0 / Q4_1 / Q8_0 / Q6_S blocks, on CPU variants chosen at run time.

Each variant this CPU runs must match the torch reference of the same quantization and integer dot
(sparkserve/kernels/int8_ref.py) to fp32 rounding, and stay close to the fp32 product on the
dequantized weight; the dispatcher must fall to the next variant when one is switched off by
SPARKSERVE_KERNEL_VARIANTS_OFF; and a Linear set to "none" must take the exact fp32 path."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from int8_fixtures import assert_int8_close, chunked_logits
from test_quant_kernels import REPO, random_blocks

from sparkserve import kernels
from sparkserve.kernels import BF16, Q4_0, Q4_1, Q6_S, Q8_0, int8_ref
from sparkserve.layers import linear as linear_mod
from sparkserve.layers.block_backed import set_activation_quant
from sparkserve.layers.linear import Linear

VARIANTS = ("avx2", "avxvnni", "avx512", "amx", "avx512vnni")     # the dispatcher's order is the reverse
INT8_QTYPES, INT8_IDS = [Q4_0, Q4_1, Q8_0, Q6_S], ["Q4_0", "Q4_1", "Q8_0", "Q6_S"]
# Tests only, on CPUs with AVX-512 VNNI: the AMX kernel on software tiles, the AVX-VNNI kernel on the
# EVEX dpbusd.
EMULATED = ("amx_emulated", "avxvnni_evex")
# /proc/cpuinfo flags each variant needs
_VNNI512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avxvnni": ("avx_vnni",),
             "avx512": ("avx512f", "avx512bw", "avx512vl"), "avx512vnni": _VNNI512,
             "amx": (*_VNNI512, "amx_tile", "amx_int8"), **{v: _VNNI512 for v in EMULATED}}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_runs(variant: str) -> bool:
    return all(f in cpu_flags() for f in CPU_FLAGS[variant])


def variants_to_check() -> list[str]:
    """Every variant this CPU runs: the dispatcher's, then the test-only ones."""
    return kernels.runnable_variants() + kernels.runnable_variants(test_only=True)


@pytest.fixture(scope="module", autouse=True)
def built():
    if os.environ.get("SPARKSERVE_DISABLE_KERNELS", "") not in ("", "0"):
        pytest.fail("SPARKSERVE_DISABLE_KERNELS is set: these tests check the kernels themselves")
    assert kernels.available(), "kernel build failed (see the logged warning)"


def test_runnable_variants_follow_the_cpu():
    """The extension's view of the CPU agrees with /proc/cpuinfo (AVX2 is always built)."""
    want = [v for v in reversed(VARIANTS) if cpu_runs(v)]
    assert kernels.runnable_variants() == want


@pytest.mark.parametrize("variant", [*VARIANTS, *EMULATED])
@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=INT8_IDS)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (33, 576), (61, 1536)])
def test_variant_matches_reference(variant, qtype, n, k):
    """Every M scheme (1, a partial tile, a full tile, one and a half tile pairs, a pair + 1,
    several pairs), odd N (a partial group of 16 output rows), with and without bias."""
    if not cpu_runs(variant):
        pytest.skip(f"this CPU lacks {variant} ({', '.join(CPU_FLAGS[variant])})")
    if variant not in variants_to_check():
        pytest.skip(f"{variant} not built: the compiler rejected its flags")
    w = random_blocks(qtype, n, k, seed=n * k)
    dense = w.dequantize()
    g = torch.Generator().manual_seed(n + k)
    for m in (1, 3, 8, 12, 17, 64):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        x[0, :32] = 0.0                         # an all-zero block (scale 0)
        for bias in (None, torch.randn(n, generator=g)):
            y = kernels.quant_linear_int8(x, w, bias, variant=variant)
            assert y.shape == (m, n) and y.dtype == torch.float32
            # Same integers and scales as the reference: only fp32 rounding of the block sums.
            terms = int8_ref.block_terms(x, w)
            ref = terms.sum(-1) + (0 if bias is None else bias.double())
            size = terms.abs().sum(-1) + (0 if bias is None else bias.double().abs())
            rel = ((y.double() - ref).abs() / size.clamp_min(1e-30)).max().item()
            assert rel <= 1e-5, f"M={m}: {rel:.3g} off the int8 reference (relative to sum |terms|)"
            # Int8 rounding of x moves y by at most ~1/254 of each block's |x|max x |w| mass; on
            # these random rows that is under 2% of the output scale (measured ~0.6%).
            fp = F.linear(x, dense, bias)
            err, scale = (y - fp).abs().max().item(), fp.abs().max().item()
            assert err <= 0.02 * scale, f"M={m}: {err:.3g} off the fp32 product (scale {scale:.3g})"
            # A row's result does not depend on the rows beside it (verify == plain decode).
            for i in {0, m // 2, m - 1}:
                alone = kernels.quant_linear_int8(x[i:i + 1], w, bias, variant=variant)
                assert torch.equal(y[i:i + 1], alone), f"M={m}: row {i} differs when run alone"


def test_quantizer_matches_reference_exactly():
    """The kernel's int8 x is the reference's bit for bit: with a weight that picks single inputs
    (Q8_0 blocks of one 1 and zeros, d = 1) y is d_x * q_x, so y == reference for every element."""
    k = 96
    n = k
    blocks = torch.zeros(n, k // 32, 34, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for i in range(n):
        blocks[i, i // 32, 0:2] = one
        blocks[i, i // 32, 2 + i % 32] = 1
    w = kernels.BlockWeight(Q8_0, blocks.view(n, -1), k)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, k, generator=g) * 3
    x[2, 40] = 0.5 * x[2, 32:64].abs().max()    # ties at .5 after scaling are rare; include edge values
    q, d, _ = int8_ref.quantize_rows(x)
    want = (q * d[..., None]).reshape(9, k)
    for variant in variants_to_check():
        assert torch.equal(kernels.quant_linear_int8(x, w, variant=variant), want), variant


def test_packed_copies_go_with_their_weights():
    """Every variant reads Q4_1 from a packed copy: one per weight tensor, reused across calls,
    dropped once the weight is gone; another weight of the same shape gets its own."""
    held = kernels.load_extension().int8_packed_weights_held
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6))
    w1, w2 = random_blocks(Q4_1, 40, 96, seed=1), random_blocks(Q4_1, 40, 96, seed=2)
    y1 = kernels.quant_linear_int8(x, w1)
    n = held()
    assert torch.equal(kernels.quant_linear_int8(x, w1), y1) and held() == n
    del w1
    y2 = kernels.quant_linear_int8(x, w2)
    assert held() <= n                                   # w1's copy went as w2's came
    assert torch.equal(y2, kernels.quant_linear_int8(x, w2))
    assert not torch.equal(y1, y2)


@torch.no_grad()
@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=INT8_IDS)
def test_blocks_held_packed_compute_as_the_gguf_ones(qtype):
    """A weight packed in place (BlockWeight.packed: the int8 kernels' layout, same shape and size)
    gives every variant the same outputs bit for bit as its GGUF blocks, with no packed copy made;
    unpacking gives the GGUF bytes back; its values, row lookups and row / column slices are the GGUF
    ones; the fp32 kernel refuses it by name; rows that are not whole groups of 16 stay GGUF."""
    ext = kernels.load_extension()
    w, w2 = random_blocks(qtype, 48, 96, seed=11), random_blocks(qtype, 32, 96, seed=12)
    p = w.packed()
    assert p.is_packed and p.gguf_type == qtype and p.blocks.shape == w.blocks.shape
    assert not torch.equal(p.blocks, w.blocks) and p.packed() is p and w.packed() is p
    assert p.unpacked() is w
    fresh = kernels.BlockWeight(p.qtype, p.blocks.clone(), 96)
    assert torch.equal(fresh.unpacked().blocks, w.blocks)
    assert torch.equal(p.dequantize(), w.dequantize())
    ids = torch.tensor([47, 0, 16, 15, 16])
    assert torch.equal(kernels.dequantize_rows(p, ids), w.dequantize()[ids])
    assert torch.equal(p.rows(ids).blocks, w.rows(ids).blocks)
    assert torch.equal(p.cols(32, 96).blocks, w.cols(32, 96).blocks)
    assert torch.equal(kernels.BlockWeight.cat([p, w2.packed()]).blocks,
                       kernels.BlockWeight.cat([w, w2]).packed().blocks)
    x = torch.randn(17, 96, generator=torch.Generator().manual_seed(13))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(14))
    held = ext.int8_packed_weights_held()
    for variant in variants_to_check():
        for m in (1, 8, 17):
            assert torch.equal(kernels.quant_linear_int8(x[:m], p, bias, variant=variant),
                               kernels.quant_linear_int8(x[:m], fresh.unpacked(), bias, variant=variant))
    with pytest.raises(RuntimeError, match="int8 activations only"):
        kernels.quant_linear(x, p)
    with pytest.raises(RuntimeError, match="packed blocks need an int8 kernel variant"):
        kernels.quant_linear_int8(x, p, variant="fp32")
    assert ext.int8_packed_weights_held() <= held + len(variants_to_check())   # fresh's GGUF ones
    assert random_blocks(qtype, 40, 96).packed() is None and random_blocks(BF16, 48, 96).packed() is None
    with pytest.raises(ValueError, match="groups of 16"):
        kernels.BlockWeight(p.qtype, p.blocks[:40], 96)


@torch.no_grad()
def test_int8_layers_hold_their_blocks_packed_once():
    """Under int8 a layer and the embedding hold their blocks packed, not beside a packed copy;
    an LM head tied to the embedding shares the embedding's packed blocks, and after a switch to
    "none" its GGUF ones and one fp32 weight again; the outputs are those of the GGUF blocks."""
    from sparkserve.layers.vocab_parallel import VocabParallelEmbedding
    held = kernels.load_extension().int8_packed_weights_held
    lin = _layer(Q4_1)
    gguf = lin._blocks
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(15))
    want = kernels.quant_linear_int8(x, gguf, lin.bias)
    lin.set_activation_quant("int8")
    assert lin._blocks.is_packed and lin.inference_blocks() is lin._blocks
    n = held()
    assert torch.equal(lin(x), want) and held() == n
    lin.set_activation_quant("none")
    assert not lin._blocks.is_packed and torch.equal(lin._blocks.blocks, gguf.blocks)
    w = random_blocks(Q8_0, 64, 64, seed=16)
    emb, head = VocabParallelEmbedding(64, 64), Linear(64, 64)
    for m in (emb, head):
        m.weight.data.copy_(w.dequantize())
        m.set_blocks(w)
    del w
    for mode in ("int8", "none", "int8"):
        set_activation_quant(torch.nn.ModuleList([emb, head]), mode)
        assert emb.held_blocks is head.held_blocks and emb.held_blocks.is_packed == (mode == "int8")
        assert (emb.weight is head.weight) == (mode == "none")
    assert torch.equal(emb(torch.tensor([3])), head.dense_weight()[3:4])


def test_half_weights_keep_fp32_activations():
    w = random_blocks(BF16, 16, 64)
    x = torch.randn(5, 64)
    assert torch.equal(kernels.quant_linear_int8(x, w), kernels.quant_linear(x, w))


def test_rejects_bad_shapes_and_unknown_variant():
    w = random_blocks(Q4_1, 8, 64)
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels.quant_linear_int8(torch.randn(2, 96), w)
    with pytest.raises(RuntimeError, match="not built"):
        kernels.quant_linear_int8(torch.randn(2, 64), w, variant="sse2")


_VARIANT_SCRIPT = """
import json, torch
from sparkserve import kernels
from sparkserve.kernels import Q4_1
from test_quant_kernels import random_blocks
w = random_blocks(Q4_1, 40, 128, seed=1)
x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
same_as_fp32 = torch.equal(kernels.quant_linear_int8(x, w), kernels.quant_linear(x, w))
print(json.dumps({"variant": kernels.variant(), "fp32": same_as_fp32, "any_m": kernels.int8_beats_gemm()}))
"""


def test_env_switches_variants_off_in_order():
    """SPARKSERVE_KERNEL_VARIANTS_OFF applies at load (a fresh process per setting): switching off
    the best k variants runs the next one; switching off all of them computes in fp32. Prefill
    sizes go to the int8 kernel where it beats oneDNN: the AVX-512 ones always, the ymm variants only
    where torch and oneDNN run no wider than AVX2 (an AVX2 CPU, made here by capping both)."""
    runnable = kernels.runnable_variants()
    assert kernels.variant() == runnable[0]     # this process: nothing switched off
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests", "engine"),
                                                       os.environ.get("PYTHONPATH", "")]))
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    cases = [(runnable[:k], runnable[k] if k < len(runnable) else "fp32", False)
             for k in range(1, len(runnable) + 1)]
    cases.append((["amx", "avx512vnni", "avx512", "avxvnni"], "avx2", False))    # the documented setting
    ymm = [v for v in runnable if v in ("avxvnni", "avx2")]
    cases.append((["amx", "avx512vnni", "avx512"], ymm[0], True))
    for off, want, capped in cases:
        env["SPARKSERVE_KERNEL_VARIANTS_OFF"] = " , ".join(off)
        for name, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
            if capped:
                env[name] = value
            else:
                env.pop(name, None)
        proc = subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT], env=env, capture_output=True,
                              text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-2000:]
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        assert res["variant"] == want, (off, res)
        assert res["fp32"] == (want == "fp32"), (off, res)
        ymm_wins = want in ("avxvnni", "avx2") and (capped or not avx512)
        assert res["any_m"] == (want in ("amx", "avx512vnni", "avx512") or ymm_wins), (off, capped, res)


@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=INT8_IDS)
def test_amx_kernel_equals_vnni_bit_for_bit(qtype):
    """The AMX kernel (on the CPU's tiles where it has AMX, and on software tiles wherever AVX-512
    VNNI runs) gives the AVX-512 VNNI kernel's results bit for bit at every row count: each tile
    pair's tails (1-16 rows, the second tile 0-8), several pairs, a partial group of output rows,
    one and many blocks. So a verify row equals its decode row whichever kernel ran it."""
    amx = [v for v in variants_to_check() if v.startswith("amx")]
    if "avx512vnni" not in kernels.runnable_variants() or not amx:
        pytest.skip("this CPU lacks AVX-512 VNNI, which the AMX kernels (emulated too) need")
    g = torch.Generator().manual_seed(21)
    for n, k in ((40, 576), (16, 32)):
        w = random_blocks(qtype, n, k, seed=n + k)
        x = torch.randn(41, k, generator=g) * torch.rand(41, 1, generator=g) * 4
        bias = torch.randn(n, generator=g)
        for m in range(1, 42):
            want = kernels.quant_linear_int8(x[:m], w, bias, variant="avx512vnni")
            for variant in amx:
                got = kernels.quant_linear_int8(x[:m], w, bias, variant=variant)
                assert torch.equal(got, want), (variant, m)


def _layer(qtype: int, n: int = 48, k: int = 64) -> Linear:
    w = random_blocks(qtype, n, k, seed=3)
    lin = Linear(k, n, bias=True)
    lin.weight.data.copy_(w.dequantize())
    lin.bias.data.normal_()
    lin.set_blocks(w)
    lin.pack()
    return lin


@pytest.mark.parametrize("qtype", INT8_QTYPES, ids=INT8_IDS)
def test_linear_activation_modes(qtype):
    """"none" is the exact fp32 kernel at every M it takes; "int8" is the int8 kernel at every M
    the block kernel takes, and past it too where the variant beats oneDNN (int8_beats_gemm), each
    row's result independent of the batch; a bad mode is refused."""
    lin = _layer(qtype)
    b = lin._blocks
    g = torch.Generator().manual_seed(4)
    assert lin.activation_quant == "none"
    big = linear_mod.QUANT_MAX_M + 40
    with torch.no_grad():
        rows = torch.randn(big, 64, generator=g)
        lin.set_activation_quant("int8")
        alone = torch.cat([lin(rows[i:i + 1]) for i in range(rows.shape[0])])
        y = lin(rows)
        assert torch.equal(y, alone) == kernels.int8_beats_gemm()     # else oneDNN's fp32 GEMM
        assert torch.equal(y, kernels.quant_linear_int8(rows, b, lin.bias)) == kernels.int8_beats_gemm()
        for m in (1, 5, 8, 9, 17, 40, linear_mod.QUANT_MAX_M):
            x = rows[:m]
            lin.set_activation_quant("none")
            assert torch.equal(lin(x), kernels.quant_linear(x, b, lin.bias))
            lin.set_activation_quant("int8")
            y = lin(x)
            assert torch.equal(y, kernels.quant_linear_int8(x, b, lin.bias))
            assert not torch.equal(y, kernels.quant_linear(x, b, lin.bias))
            assert torch.equal(y, alone[:m]), f"M={m}: rows differ from the same rows run one by one"
    with pytest.raises(ValueError, match="activation_quant"):
        lin.set_activation_quant("int4")


@torch.no_grad()
def test_no_packed_copy_while_int8_takes_every_row_count():
    """Where the int8 kernel takes every row count, a packed oneDNN copy of the weight would go
    unread: the layer keeps none under int8 (as much memory as the weight saved), packs when switched
    to fp32 activations, and a prefill-sized input gives oneDNN's fp32 result again."""
    lin = _layer(Q8_0)
    x = torch.randn(linear_mod.QUANT_MAX_M + 40, 64, generator=torch.Generator().manual_seed(5))
    exact = lin(x)                                   # "none": oneDNN on the packed copy
    assert lin._packed is not None
    lin.set_activation_quant("int8")
    assert (lin._packed is None) == kernels.int8_beats_gemm()
    int8 = kernels.quant_linear_int8(x, lin._blocks, lin.bias)
    assert torch.equal(lin(x), int8) == kernels.int8_beats_gemm()
    lin.set_activation_quant("none")
    assert lin._packed is not None and torch.equal(lin(x), exact)


@torch.no_grad()
def test_int8_layer_lets_its_fp32_weight_go():
    """Where int8 takes every row count nothing reads a layer's fp32 weight: it goes (a meta tensor
    of its shape stands in) and outputs stay the int8 kernel's; `dense_weight()` still gives the
    values; fp32 activations bring the weight back and the exact path with it; a layer marked
    keep_dense (the LM head tied to the embedding) keeps it; autograd runs on the rebuilt values."""
    lin = _layer(Q4_1)
    dense = lin.weight.clone()
    x = torch.randn(linear_mod.QUANT_MAX_M + 40, 64, generator=torch.Generator().manual_seed(7))
    exact = lin(x)
    lin.set_activation_quant("int8")
    dropped = kernels.int8_beats_gemm()
    assert lin.weight.is_meta == dropped and lin.weight.shape == dense.shape
    assert torch.equal(lin.dense_weight(), dense)
    for m in (1, 8, x.shape[0]):
        assert torch.equal(lin(x[:m]), kernels.quant_linear_int8(x[:m], lin._blocks, lin.bias))
    with torch.enable_grad():
        xg = x[:2].clone().requires_grad_()
        y = lin(xg)
        assert y.requires_grad and torch.equal(y, F.linear(xg, dense, lin.bias))
    lin.set_activation_quant("none")
    assert not lin.weight.is_meta and torch.equal(lin.weight, dense)
    assert torch.equal(lin(x), exact)


@torch.no_grad()
@pytest.mark.parametrize("qtype", [*INT8_QTYPES, BF16], ids=[*INT8_IDS, "BF16"])
def test_int8_embedding_looks_rows_up_in_its_blocks(qtype):
    """Served quantized, the embedding holds no fp32 table and looks rows up in its blocks (the C++
    row expansion, or torch's without the kernels): the same values bit for bit, for any id shape;
    "none" brings the table back."""
    from sparkserve.layers.vocab_parallel import VocabParallelEmbedding
    w = random_blocks(qtype, 300, 64, seed=8)
    ids = torch.tensor([299, 0, 7, 7, 150])
    assert torch.equal(kernels.dequantize_rows(w, ids), w.dequantize()[ids])
    assert torch.equal(w.rows(ids).dequantize(), w.dequantize()[ids])        # the fallback
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.dequantize_rows(w, torch.tensor([300]))
    emb = VocabParallelEmbedding(300, 64)
    emb.weight.data.copy_(w.dequantize())
    emb.set_blocks(w)
    ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
    table = emb(ids)
    assert not emb.weight.is_meta and torch.equal(table, F.embedding(ids, w.dequantize()))
    emb.set_activation_quant("int8")
    assert emb.weight.is_meta and torch.equal(emb.dense_weight(), w.dequantize())
    assert torch.equal(emb(ids), table) and torch.equal(emb(ids[0, 1:2]), table[0, 1:2])
    emb.set_activation_quant("none")
    assert not emb.weight.is_meta and torch.equal(emb(ids), table)
    with pytest.raises(ValueError, match="activation_quant"):
        emb.set_activation_quant("int4")


def test_mode_survives_set_blocks_and_skips_half_blocks():
    lin = _layer(Q4_1)
    lin.set_activation_quant("int8")
    lin.set_blocks(random_blocks(Q8_0, 48, 64))     # the loader may hand blocks after the mode
    assert lin._int8_max_m >= linear_mod.QUANT_MAX_M
    lin.set_blocks(random_blocks(BF16, 48, 64))
    assert lin.activation_quant == "int8" and lin._int8_max_m == 0


def test_engine_option_reaches_the_layers(smollm2_path, monkeypatch):
    """--activation-quant is a ServerArgs field (default int8, as llama.cpp) that load_model applies to
    every layer holding Q4_1 / Q8_0 blocks (the LM head is Q8_0); under int8 they and the embedding
    let their fp32 weights go, each as soon as its blocks arrive while loading."""
    from sparkserve.args import ServerArgs
    from sparkserve.layers.block_backed import BlockBacked
    from sparkserve.loader.weights import WeightLoader
    from sparkserve.models.registry import load_model
    assert ServerArgs().activation_quant == "int8"
    with pytest.raises(ValueError, match="--activation-quant"):
        ServerArgs(activation_quant="fp8").validate()
    load, still_dense = WeightLoader.load, []

    def watched(loader, name, tensor):          # after each tensor: block-backed layers still in fp32
        load(loader, name, tensor)
        still_dense.append(sum(isinstance(m, BlockBacked) and m._blocks is not None and not m.weight.is_meta
                               for m in loader.model.modules()))

    monkeypatch.setattr(WeightLoader, "load", watched)
    trims, reads, dequantize = [], [], kernels.BlockWeight.dequantize
    monkeypatch.setattr("sparkserve.models.registry.release_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(kernels.BlockWeight, "dequantize", lambda self: reads.append(1) or dequantize(self))
    for mode in ("int8", "none"):
        still_dense.clear(), reads.clear()
        model = load_model(smollm2_path, activation_quant=mode)
        assert trims.pop() and not trims, "load_model hands what loading freed back to the OS once"
        # a GGUF tensor is dequantized only for a module that keeps fp32 values
        assert (len(reads) == 0) == (mode == "int8" and kernels.int8_beats_gemm()), len(reads)
        if mode == "int8" and kernels.int8_beats_gemm():
            assert len(still_dense) > 200 and max(still_dense) == 0
        held = [m for m in model.modules() if isinstance(m, Linear) and m._blocks is not None]
        assert held and all(m.activation_quant == mode for m in held)
        assert all((m._int8_max_m > 0) == (mode == "int8") for m in held)
        # int8 holds the weights once: no fp32 copy beside the blocks, the embedding table included
        dropped = mode == "int8" and kernels.int8_beats_gemm()
        assert all(m.weight.is_meta == dropped for m in held)
        assert model.model.embed_tokens.weight.is_meta == (mode == "int8")
        # and the blocks once: held packed in place of the GGUF ones (SmolLM2's rows are whole
        # groups of 16), the tied LM head sharing the embedding's
        assert all(m._blocks.is_packed == (mode == "int8") for m in held)
        assert model.lm_head.held_blocks is model.model.embed_tokens.held_blocks
        if mode == "none":
            assert model.lm_head.weight is model.model.embed_tokens.weight


@torch.no_grad()
def test_int8_layers_that_keep_fp32_get_their_values(smollm2_path, monkeypatch):
    """Where int8 does not take every row count (the ymm variants beside AVX-512 oneDNN), a layer
    keeps its fp32 weight for prefill-sized inputs while the embedding drops its own: the loader,
    which otherwise leaves GGUF tensors unread, must fill those layers, the LM head tied to the
    embedding included, with their blocks' values."""
    from sparkserve.models.registry import load_model
    monkeypatch.setattr(kernels, "int8_beats_gemm", lambda: False)
    model = load_model(smollm2_path, activation_quant="int8")
    assert model.model.embed_tokens.weight.is_meta
    for m in (model.lm_head, model.model.layers[0].self_attn.qkv_proj, model.model.layers[29].mlp.down_proj):
        assert not m.weight.is_meta and m._int8_max_m < linear_mod.ALL_ROWS
        rows = torch.arange(0, m.out_features, 97)
        assert torch.equal(m.weight[rows], m.held_blocks.rows(rows).dequantize())


def test_smollm2_int8_logits_stay_close_to_fp32(smollm2_path):
    """The whole model with int8 activations vs fp32 activations on the same text: the stated int8
    tolerance (measured on ShareGPT / HumanEval: mean |diff| 0.17, top-1 agreement 97%, perplexity
    +0.5-0.7%) with margin; and int8 must really differ from fp32."""
    from sparkserve.frontend.tokenizer import load_tokenizer
    from sparkserve.models.registry import load_model
    text = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
            "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
            "The capital of France is Paris, and the capital of Italy is Rome. "
            "Water boils at 100 degrees Celsius at sea level.")
    tokens = load_tokenizer(smollm2_path).encode(text, add_special_tokens=True)
    model = load_model(smollm2_path, activation_quant="none")
    fp = chunked_logits(model, tokens)
    set_activation_quant(model, "int8")
    assert_int8_close(fp, chunked_logits(model, tokens), tokens)


def test_int8_engine_runs_int8(smollm2_path, smollm2_engine):
    """An Engine with --activation-quant int8 computes with int8 activations (the scheduler's model
    holds int8 layers) and answers a plain factual prompt like the fp32 session engine on its first
    tokens; the default engine keeps fp32 activations."""
    from sparkserve import Engine
    assert smollm2_engine.scheduler.runner.model.lm_head.activation_quant == "none"
    engine = Engine(smollm2_path, max_total_tokens=512, max_running_requests=2, activation_quant="int8")
    try:
        model = engine.scheduler.runner.model
        assert model.lm_head.activation_quant == "int8" and model.lm_head._int8_max_m > 0
        prompt = engine.tokenizer.encode("The capital of France is", add_special_tokens=True)
        sp = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
        ours = engine.generate(input_ids=[prompt], sampling_params=sp)[0]["output_ids"]
        ref = smollm2_engine.generate(input_ids=[prompt], sampling_params=sp)[0]["output_ids"]
        assert ours == ref
    finally:
        engine.shutdown()
