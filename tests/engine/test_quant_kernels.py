"""The C++ block kernels (sparkserve.kernels): y = x @ W.T straight from Q4_0 / Q4_1 / Q8_0 / Q6_S / BF16
/ F16 blocks.

They must compute on exactly the values gguf-py's `dequantize` gives (checked bit for bit on the
embedded GGUF) and differ from F.linear on the dequantized weight only by summation order; the
GGUF loader must hand every Linear blocks equal to its fp32 weight (fused q|k|v, gate|up, the
un-permuted q/k rows, the tied Q8_0 LM head); and with SPARKSERVE_DISABLE_KERNELS=1 the engine
falls back to the fp32 path and generates the same tokens. The kernel is built once per source
version (cached under ~/.cache/sparkserve/kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparkserve import kernels
from sparkserve.kernels import BF16, BLOCK_BYTES, F16, Q4_0, Q4_1, Q6_S, Q8_0, BlockWeight
from sparkserve.layers import linear as linear_mod
from sparkserve.layers.linear import FusedLinear, Linear
from sparkserve.loader.gguf_file import open_gguf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def built():
    if os.environ.get("SPARKSERVE_DISABLE_KERNELS", "") not in ("", "0"):
        pytest.fail("SPARKSERVE_DISABLE_KERNELS is set: these tests check the kernels themselves")
    assert kernels.available(), "kernel build failed (see the logged warning)"


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> BlockWeight:
    """Random block data with finite scales: random nibbles / int8 / bf16 / fp16, fp16 d and m drawn
    around 0.02 (both signs) so every code path of the expansion is exercised."""
    g = torch.Generator().manual_seed(seed)
    if qtype in (BF16, F16):
        half = torch.bfloat16 if qtype == BF16 else torch.float16
        return BlockWeight.from_half(torch.randn(n, k, generator=g).to(half))
    nb = k // 32
    b = torch.randint(0, 256, (n, nb, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    d = (torch.randn(n, nb, generator=g) * 0.02).to(torch.float16)
    b[..., 0:2] = d.view(torch.uint8).view(n, nb, 2)
    if qtype == Q4_1:
        m = (torch.randn(n, nb, generator=g) * 0.1).to(torch.float16)
        b[..., 2:4] = m.view(torch.uint8).view(n, nb, 2)
    if qtype == Q6_S:        # weights d * scale * (u - 32): keep d * scale around 0.02 / 32
        b[..., 0:2] = (d / 2048).view(torch.uint8).view(n, nb, 2)
    return BlockWeight(qtype, b.view(n, -1), k)


def assert_close_to_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    ref = F.linear(x, w, bias)
    scale = max(ref.abs().max().item(), 1e-30)
    err = (y - ref).abs().max().item()
    assert err <= 1e-5 * scale, f"max |diff| {err:.3g} at output scale {scale:.3g}"


# M covers both schemes of quant_linear (register expansion below 8 rows, expanded panels from 8)
# and every mix of 4- and 3-row x tiles; N every tail of a 3-row panel; K one chunk, several, and
# a last chunk of a single block (800 = 768 + 32).
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0, Q6_S, BF16, F16],
                         ids=["Q4_0", "Q4_1", "Q8_0", "Q6_S", "BF16", "F16"])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (33, 96), (257, 576), (61, 1536), (5, 800)])
def test_kernel_matches_linear_on_dequantized_weight(qtype, n, k):
    w = random_blocks(qtype, n, k, seed=n + k)
    dense = w.dequantize()
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 5, 7, 8, 9, 11, 16, 17, 19, 30, 32, 33, 63, 64):
        x = torch.randn(m, k, generator=g)
        y = kernels.quant_linear(x, w)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_close_to_linear(y, x, dense)
    # bias, and a non-contiguous x (a column slice of a wider tensor), in both schemes
    bias = torch.randn(n, generator=g)
    for m in (4, 33):
        x = torch.randn(m, k + 32, generator=g)[:, 16:16 + k]
        assert_close_to_linear(kernels.quant_linear(x, w, bias), x, dense, bias)


def test_linears_are_torch_operators():
    """torch.ops.sparkserve.* (what a compiled graph calls) run the same kernels as the bindings."""
    g = torch.Generator().manual_seed(2)
    for qtype in (Q4_0, Q4_1, Q8_0, Q6_S):
        w = random_blocks(qtype, 40, 96, seed=qtype)
        x, bias = torch.randn(3, 96, generator=g), torch.randn(40, generator=g)
        assert torch.equal(torch.ops.sparkserve.quant_linear(x, w.blocks, w.qtype, bias),
                           kernels.quant_linear(x, w, bias))
        assert torch.equal(torch.ops.sparkserve.quant_linear_int8(x, w.blocks, w.qtype),
                           kernels.quant_linear_int8(x, w))
        assert not torch.equal(torch.ops.sparkserve.quant_linear_int8(x, w.blocks, w.qtype),
                               kernels.quant_linear(x, w))      # int8 really is another computation


def test_kernel_rejects_bad_shapes():
    w = random_blocks(Q4_1, 8, 64)
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels.quant_linear(torch.randn(2, 96), w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.quant_linear(torch.randn(2, 40), w)
    with pytest.raises(ValueError):
        BlockWeight(Q8_0, torch.zeros(4, 33, dtype=torch.uint8), 32)


def _gguf_tensor(reader, name: str):
    return next(t for t in reader.tensors if t.name == name)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight",
                                  "blk.29.ffn_up.weight"])
def test_block_layout_matches_gguf_py(smollm2_path, name):
    """Ground truth for the block layouts: on real tensors of the embedded GGUF, our torch
    dequantization and the kernel itself (fed one-hot rows, which read single weights exactly)
    equal gguf-py's `dequantize` bit for bit."""
    t = _gguf_tensor(open_gguf(smollm2_path), name)
    rows = np.arange(0, t.data.shape[0], max(1, t.data.shape[0] // 96))      # a spread of rows
    ref = torch.from_numpy(gguf.quants.dequantize(t.data[rows], t.tensor_type).astype(np.float32))
    w = BlockWeight.from_numpy(int(t.tensor_type), t.data[rows], ref.shape)
    assert w.qtype == (Q8_0 if name.startswith("token_embd") else Q4_1)
    assert torch.equal(w.dequantize(), ref)
    eye = torch.eye(w.in_features)
    got = torch.cat([kernels.quant_linear(eye[k0:k0 + 16], w).T for k0 in range(0, w.in_features, 16)], dim=1)
    assert torch.equal(got, ref)


def test_gguf_model_linears_carry_matching_blocks(smollm2_engine):
    """Every Linear of the served SmolLM2 got blocks equal to its fp32 weight: fused q|k|v with
    llama.cpp's q/k rope permutation undone on block rows, fused gate|up, and the Q8_0 token
    embedding for the tied LM head."""
    model = smollm2_engine.scheduler.runner.model
    lins = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert len(lins) == 30 * 4 + 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)               # many tiny ops: no thread hand-offs on a busy machine
    try:
        for name, m in lins.items():
            assert m._blocks is not None, f"{name} has no blocks"
            rows = torch.arange(0, m.out_features, 7)     # a spread of rows, every shard's included
            assert torch.equal(m._blocks.rows(rows).dequantize(), m.weight[rows]), name
    finally:
        torch.set_num_threads(threads)
    assert model.lm_head._blocks.qtype == Q8_0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.qkv_proj._blocks.qtype == Q4_1


@pytest.mark.parametrize("dtype,qtype", [(torch.bfloat16, BF16), (torch.float16, F16)], ids=["bf16", "fp16"])
def test_hf_half_checkpoint_runs_on_half_blocks(dtype, qtype, tmp_path):
    """An HF checkpoint stored in bf16 or fp16 (as drafts ship): every Linear (fused ones and the
    tied LM head included) keeps the exact half values as blocks, and small-M outputs match
    F.linear on the fp32 weight."""
    from conftest import make_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    from sparkserve.models.registry import load_model
    path = make_tiny_checkpoint("qwen3", str(tmp_path / "half"))
    st = os.path.join(path, "model.safetensors")
    save_file({k: v.to(dtype) for k, v in load_file(st).items()}, st, metadata={"format": "pt"})
    model = load_model(path)
    lins = [m for m in model.modules() if isinstance(m, Linear)]
    assert lins and all(m._blocks is not None and m._blocks.qtype == qtype for m in lins)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in lins:
            assert torch.equal(m._blocks.dequantize(), m.weight)
            x = torch.randn(3, m.in_features, generator=g)
            assert_close_to_linear(m(x), x, m.weight, m.bias)


def test_linear_dispatch():
    """Small M uses the block kernel, larger M and autograd the fp32 weight; all agree."""
    w = random_blocks(Q4_1, 48, 64, seed=3)
    lin = Linear(64, 48, bias=True)
    lin.weight.data.copy_(w.dequantize())
    lin.bias.data.normal_()
    lin.set_blocks(w)
    lin.pack()
    g = torch.Generator().manual_seed(2)
    for m in (1, linear_mod.QUANT_MAX_M, linear_mod.QUANT_MAX_M + 1, 64):
        x = torch.randn(m, 64, generator=g)
        with torch.no_grad():
            assert_close_to_linear(lin(x), x, lin.weight, lin.bias)
    x = torch.randn(2, 64, generator=g, requires_grad=True)
    y = lin(x)
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias)) and y.requires_grad
    # The kernel path is really taken at small M: poison the fp32 weight, blocks still answer.
    lin.weight.data.zero_()
    lin._packed = None
    with torch.no_grad():
        assert lin(torch.ones(1, 64)).abs().sum() > 0
    with pytest.raises(ValueError, match="do not fit"):
        lin.set_blocks(random_blocks(Q4_1, 47, 64))


def test_trained_weight_drops_its_inference_copies():
    """A draft loaded for serving (blocks + oneDNN-packed copy) and then trained in place must
    run on the new weight, at every M, not on the copies made at load time."""
    w = random_blocks(Q8_0, 48, 64, seed=5)
    lin = Linear(64, 48)
    lin.weight.data.copy_(w.dequantize())
    lin.set_blocks(w)
    lin.pack()
    with torch.no_grad():
        lin.weight.mul_(0.5)                       # an optimizer step: in place, version bumps
    g = torch.Generator().manual_seed(4)
    for m in (1, 16, linear_mod.QUANT_MAX_M + 1):
        x = torch.randn(m, 64, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-4, rtol=1e-4)


def test_fused_linear_keeps_blocks_only_when_every_shard_has_them():
    a, b = random_blocks(Q4_1, 16, 64, seed=4), random_blocks(Q4_1, 8, 64, seed=5)
    fl = FusedLinear(64, {"a": 16, "b": 8})
    fl.load("a", a.dequantize(), blocks=a)
    assert fl._blocks is None
    fl.load("b", b.dequantize(), blocks=b)
    assert torch.equal(fl._blocks.dequantize(), fl.weight)
    other = FusedLinear(64, {"a": 16, "b": 8})
    other.load("a", a.dequantize(), blocks=a)
    other.load("b", random_blocks(Q8_0, 8, 64).dequantize(), blocks=random_blocks(Q8_0, 8, 64))
    assert other._blocks is None                 # mixed formats: fp32 path


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 4, 32), (2, 50), (1, 8), (700, 96)])
def test_rms_norm_kernels_match_torch(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x, r = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    ext = kernels.load_extension()
    ref = F.rms_norm(x, (shape[-1],), w, 1e-5)
    assert (ext.rms_norm(x, w, 1e-5) - ref).abs().max() <= 1e-6 * ref.abs().max()
    s, y = ext.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    ref = F.rms_norm(x + r, (shape[-1],), w, 1e-5)
    assert (y - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_rms_norm_module_paths():
    from sparkserve.layers.norm import RMSNorm
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data.normal_()
    x, r = torch.randn(6, 64), torch.randn(6, 64)
    with torch.no_grad():
        ref = F.rms_norm(x, (64,), norm.weight, 1e-6)
        assert (norm(x) - ref).abs().max() <= 1e-6 * ref.abs().max()
        wide = torch.randn(6, 128)[:, :64]                         # non-contiguous: torch path
        assert torch.equal(norm(wide), F.rms_norm(wide, (64,), norm.weight, 1e-6))
        s, y = norm.add_norm(x, r)
        assert torch.equal(s, x + r) and (y - norm(x + r)).abs().max() <= 1e-6 * y.abs().max()
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6))    # autograd: torch


_FALLBACK_SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(1)
from sparkserve import Engine, kernels
engine = Engine(max_total_tokens=512, max_running_requests=2)
model = engine.scheduler.runner.model
out = engine.generate(input_ids=[json.loads(sys.argv[1])],
                      sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
print(json.dumps({"available": kernels.available(), "head_blocks": model.lm_head._blocks is not None,
                  "ids": out[0]["output_ids"]}))
"""


def test_disable_env_falls_back_to_fp32_with_same_tokens(smollm2_engine):
    prompt = smollm2_engine.tokenizer.encode("The three primary colors are", add_special_tokens=True)
    ours = smollm2_engine.generate(input_ids=[prompt], sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})[0]["output_ids"]
    assert smollm2_engine.scheduler.runner.model.lm_head._blocks is not None
    env = dict(os.environ, SPARKSERVE_DISABLE_KERNELS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, json.dumps(prompt)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["available"] is False and res["head_blocks"] is False
    assert res["ids"] == ours


def test_build_left_by_a_killed_process_does_not_hang_the_next():
    """torch's build leaves a `lock` file in the build folder while it compiles; a process killed
    then leaves it behind (and no `built` marker), and torch alone would wait on it forever. The
    next process takes the build path (here: ninja finds every object up to date), clears the
    stale lock and marks the build finished."""
    import fcntl

    from sparkserve.kernels.build import _DONE, build_dir
    path = build_dir()
    done = os.path.join(path, _DONE)
    with open(done) as f:
        marker = f.read()
    try:
        with open(path + ".lock", "w") as flock:      # as the builders do: nobody builds meanwhile
            fcntl.flock(flock, fcntl.LOCK_EX)
            open(os.path.join(path, "lock"), "w").close()
            os.remove(done)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        code = "from sparkserve import kernels; print(kernels.available())"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
        assert not os.path.exists(os.path.join(path, "lock")) and os.path.exists(done)
    finally:
        if not os.path.exists(done):
            with open(done, "w") as f:
                f.write(marker)
