"""Expert parallelism (--tp-size 2 --ep-size 2, gloo, 1 torch thread per rank): Kimi-Linear and
MiniMax-M3 split their routed experts over the two ranks (each runs its experts for every token
routed to them; the outputs are summed) and replicate attention, and give the single-process
engine's tokens and logprobs, under pipeline stages too (and MiniMax-M3's sparse-attention pools
split over stages); bad expert layouts are refused."""
from __future__ import annotations

import pytest
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax
from parallel_fixtures import COMMON, assert_same, run_mixed

from sparkserve import Engine


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"kimi": make_kimi(str(root / "kimi"), "kda_mla"), "minimax": make_minimax(str(root / "minimax"))}


@pytest.mark.parametrize("model,layout", [
    ("kimi", dict(tp_size=2, ep_size=2)), ("minimax", dict(tp_size=2, ep_size=2)),
    ("kimi", dict(tp_size=2, ep_size=2, pp_size=2)), ("minimax", dict(pp_size=2))])
def test_experts_split_over_ranks(moe_dirs, model, layout):
    path = moe_dirs[model]
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, **layout, **COMMON) as eng:
        experts = next(m for m in eng.scheduler.runner.model.modules() if type(m).__name__ == "Experts")
        split = layout.get("ep_size", 1)
        assert experts.gate_up_proj.shape[0] == experts.local == {"kimi": 8, "minimax": 4}[model] // split
        got = run_mixed(eng)
    assert_same(got, want)


def test_bad_expert_layouts(moe_dirs, llama_dir):
    with pytest.raises(ValueError,
                       match="--tp-size 2: KimiLinearForCausalLM splits its experts .* --ep-size 2"):
        Engine(moe_dirs["kimi"], tp_size=2, **COMMON)
    with pytest.raises(ValueError, match="--ep-size 2: LlamaForCausalLM has no experts"):
        Engine(llama_dir, tp_size=2, ep_size=2, **COMMON)
    with pytest.raises(ValueError, match="--ep-size 3: the model's 4 experts do not split over 3 ranks"):
        Engine(moe_dirs["minimax"], tp_size=3, ep_size=3, **COMMON)
    with pytest.raises(ValueError, match="--ep-size 2: experts split over a tensor-parallel group"):
        Engine(moe_dirs["kimi"], ep_size=2, **COMMON)
