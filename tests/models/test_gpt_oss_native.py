"""GPT-OSS in the native step (kernels/native_llama.cpp, models/llama_native.py): o-proj bias,
attention sinks (the paged decode kernel's), alternating sliding-window / full layers, YaRN rope, the
biased top-k-then-softmax router and the clamped SwiGLU experts with biases (kernels/moe_experts.cpp).

On the exact path (fp32 activations: the bf16 copy's projections as BF16 blocks, the experts as fp32
matrices read in place) the native step's logits equal the Python layer path's and transformers' at
1e-4; with GPT-OSS's real window of 128 the sequences run past it (decode and VERIFY-sized extends
attend to a window that no longer starts at 0), and through the engine (a split pool: the windowed
layers' slots apart) the greedy tokens are transformers'."""
from __future__ import annotations

import pytest
import torch
from conftest import EXACT, assert_no_kv_leak, hf_greedy, load_hf_reference
from family_fixtures import FAMILIES, make_family_checkpoint
from test_model_logits import check_against_hf
from test_native_step import Counter, assert_close, logits_of, run_both

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.models.llama_native import unsupported
from sparkserve.models.registry import load_model

# the fixture's GPT-OSS (sinks, q/k/v/o biases, YaRN, 4 experts top-2 with biases, a clamped
# SwiGLU that bites) with the released models' window of 128 and room for sequences past it
WINDOW_128 = dict(FAMILIES["gpt_oss"][1], sliding_window=128, max_position_embeddings=512)


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> the bf16 copy (BF16 blocks: the native step runs it); the fp32 one beside."""
    root = tmp_path_factory.mktemp("gpt_oss_native")
    dirs = {}
    for name, kw in (("window8", None), ("window128", WINDOW_128)):
        if kw is not None:
            FAMILIES[f"_{name}"] = ("gpt_oss", kw)
        try:
            make_family_checkpoint(f"_{name}" if kw is not None else "gpt_oss", str(root / name),
                                   str(root / f"{name}_bf16"))
        finally:
            FAMILIES.pop(f"_{name}", None)
        dirs[name] = str(root / f"{name}_bf16")
    return dirs


@pytest.mark.parametrize("name,prompts", [("window8", [13, 1, 23, 6]), ("window128", [150, 1, 139, 20])])
def test_native_step_equals_python_path_and_transformers(name, prompts, gpt_oss_dirs, monkeypatch):
    """Chunked prefill (Python: too many rows), then decode steps of 4 requests and a mixed extend,
    natively: every logits row equals the Python layer path's and transformers'; the routed counts
    (/metrics) are the Python path's."""
    from sparkserve.layers import moe
    path = gpt_oss_dirs[name]
    model = load_model(path, activation_quant="none")
    assert unsupported(model) is None
    count = Counter(monkeypatch)
    native, python = run_both(path, prompts, decode_steps=6)
    modes = [m for m, _ in count.calls]
    assert modes.count(ForwardMode.DECODE) == 5 and modes.count(ForwardMode.EXTEND) >= 1, count.calls
    assert_close(logits_of(native), logits_of(python), 1e-4)
    check_against_hf(native, load_hf_reference(path))
    counts = [moe.routed_token_counts(d.runner.model) for d in (native, python)]
    assert counts[0] == counts[1] and sum(counts[0]) > 0


def test_engine_greedy_past_the_window_equals_transformers(gpt_oss_dirs):
    """Through the engine (its split pool keeps the windowed layers' K/V in slots of their own),
    prompts on both sides of the window of 128 decode natively to transformers' greedy tokens."""
    path = gpt_oss_dirs["window128"]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (140, 9, 121)]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(path, max_total_tokens=2048, **EXACT) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        runner = eng.scheduler.runner
        assert runner.model.native._step is not None, "the native step did not run"
        assert runner.kv_pool.swa_layers, "the pool did not keep the windowed layers apart"
        assert_no_kv_leak(eng.scheduler.cache)
    ref = load_hf_reference(path)
    for p, r in zip(prompts, out):
        assert r["output_ids"] == hf_greedy(ref, p, 12)
