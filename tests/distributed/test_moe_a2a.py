"""All-to-all expert parallel (--moe-a2a-backend a2a --ep-size N, gloo all_to_all_single, 1 torch
thread per rank) and TP MoE (--tp-size N, --ep-size 1: every expert split by width): greedy tokens
and logprobs equal the single-process engine's on tiny Kimi-Linear and MiniMax-M3, alone (tp 2), under
DP attention (ep 2; tp 4 = 2 groups of 2 ranks, ep 4), context parallel (cp 2), both (tp 4 = 2 DP
groups x 2 CP ranks, ep 4) and pipeline stages; on the MoE families (Qwen3-MoE, Mixtral's GGUF,
GPT-OSS, DeepSeek-V2) under DP attention; DSpark stays lossless under DP attention + a2a (+ CP), with
one group idle; a router that never picks one rank's experts leaves that rank without rows while it
still takes part; /metrics reports each expert's and each expert rank's tokens, the single-process
engine's counts (under pipeline stages too: the driver gathers the other stages'); a token's row
goes once to each rank owning one of its experts (DeepEP's dispatch), not once per slot."""
from __future__ import annotations

import argparse
import logging
import os
import re

import httpx
import pytest
import torch
from dspark_fixtures import make_oracle_draft
from family_fixtures import make_family_checkpoint, write_gguf
from kimi_fixtures import VOCAB as KIMI_VOCAB
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from parallel_fixtures import COMMON, PROMPTS, act_as_rank, assert_same, bigram_of, run_mixed
from safetensors.torch import load_file, save_file
from server_harness import ServerProcess

from sparkserve import Engine
from sparkserve.args import ServerArgs
from sparkserve.distributed import expert_parallel as ep
from sparkserve.distributed.sharding import check_tp
from sparkserve.layers.moe import MoEBlock, routed_token_counts
from sparkserve.models.registry import load_config, load_model, model_class
from sparkserve.scheduler.data_parallel import DataParallelScheduler

A2A = dict(ep_size=2, moe_a2a_backend="a2a")
LAYOUTS = {"tp2": dict(A2A, tp_size=2),
           "dp2": dict(A2A, tp_size=2, dp_size=2, enable_dp_attention=True),
           "cp2": dict(A2A, tp_size=2, attn_cp_size=2),
           "dp2cp2": dict(A2A, tp_size=4, ep_size=4, dp_size=2, enable_dp_attention=True, attn_cp_size=2),
           "dp2tp4": dict(A2A, tp_size=4, ep_size=4, dp_size=2, enable_dp_attention=True),   # 2 ranks a group
           "tp2pp2": dict(A2A, tp_size=2, pp_size=2)}
LONG = list(range(20, 60))          # split by CP (40 tokens: chunks of 16, 16, 8)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("a2a_moe")
    return {"kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "minimax": with_index_value(make_minimax(str(root / "minimax")))}


@pytest.fixture
def a2a_calls(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """The (send, recv) row counts of every all-to-all this process (rank 0) ran."""
    seen: list[tuple[list[int], list[int]]] = []
    real = ep.all_to_all_rows

    def recording(x, send, recv):
        seen.append((list(send), list(recv)))
        return real(x, send, recv)
    monkeypatch.setattr(ep, "all_to_all_rows", recording)
    return seen


def _driver_model(eng):
    """Rank 0's model (group 0's scheduler's under DP attention)."""
    sched = eng.scheduler
    return (sched.local if isinstance(sched, DataParallelScheduler) else sched).runner.model


def _run(eng) -> list[dict]:
    return [eng.generate(input_ids=LONG, sampling_params=SP_LONG)] + run_mixed(eng)


SP_LONG = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "return_logprob": True,
           "top_logprobs_num": 3}


@pytest.mark.parametrize("model,layout", [("kimi", "tp2"), ("kimi", "dp2"), ("kimi", "cp2"),
                                          ("kimi", "dp2cp2"), ("kimi", "dp2tp4"), ("kimi", "tp2pp2"),
                                          ("minimax", "tp2"), ("minimax", "dp2"), ("minimax", "cp2")])
def test_a2a_equals_one_process(moe_dirs, a2a_calls, model, layout):
    """Rank 0 dispatched rows with all-to-alls (none on plain all-reduce); its shared experts are
    whole (each rank runs them on its own rows); expert counts are the single-process engine's."""
    path = moe_dirs[model]
    one = Engine(path, **COMMON)
    want = _run(one)
    with Engine(path, **LAYOUTS[layout], **COMMON) as eng:
        blocks = [m for m in _driver_model(eng).modules() if isinstance(m, MoEBlock)]
        assert blocks and all(b.a2a for b in blocks)
        shared = blocks[0].shared_experts
        assert shared.down_proj.parts == 1
        got = _run(eng)
        counts = eng.scheduler.load().moe_expert_tokens
    assert a2a_calls and any(sum(s) for s, _ in a2a_calls)
    assert_same(got, want)
    assert counts == routed_token_counts(one.scheduler.runner.model)      # every stage's layers


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("a2a_families")
    mixtral = make_family_checkpoint("mixtral", str(root / "mixtral"))
    return {"qwen3_moe": make_family_checkpoint("qwen3_moe", str(root / "qwen3_moe")),
            "mixtral": write_gguf(mixtral, str(root / "mixtral.gguf")),
            "gpt_oss": make_family_checkpoint("gpt_oss", str(root / "gpt_oss")),
            "deepseek_v2": make_family_checkpoint("deepseek_v2", str(root / "deepseek_v2"))}


FAMILY = dict(COMMON, activation_quant="none", kv_cache_dtype="float32")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2"])
def test_families_a2a_under_dp_attention(family_dirs, a2a_calls, name):
    path = family_dirs[name]
    want = run_mixed(Engine(path, **FAMILY))
    with Engine(path, **LAYOUTS["dp2"], **FAMILY) as eng:
        got = run_mixed(eng)
    assert a2a_calls
    assert_same(got, want)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2", "kimi", "minimax"])
def test_tp_moe_equals_one_process(family_dirs, moe_dirs, name):
    """SGLang's plain --tp-size 2 on a MoE model: every rank holds all experts, half of each one's
    intermediate channels; one all-reduce sums the halves."""
    path = {**family_dirs, **moe_dirs}[name]
    common = COMMON if name in moe_dirs else FAMILY
    want = run_mixed(Engine(path, **common))
    with Engine(path, tp_size=2, **common) as eng:
        ex = [m.experts for m in eng.scheduler.runner.model.modules() if isinstance(m, MoEBlock)]
        assert ex and all(e.local == e.num_experts and e.width_parts == 2 for e in ex)
        assert ex[0].down_proj.shape[2] == ex[0].intermediate // 2
        got = run_mixed(eng)
    assert_same(got, want)


def test_tp_moe_rank1_keeps_its_channels(family_dirs, monkeypatch):
    """Rank 1 of TP MoE: channels 16..31 of every expert (gate and up rows, down columns); GPT-OSS's
    stacked experts (gate and up interleaved in the checkpoint) and its whole biases."""
    act_as_rank(monkeypatch, tp_rank=1, tp_size=2)
    path = family_dirs["qwen3_moe"]
    m, ck = load_model(path), load_file(os.path.join(path, "model.safetensors"))
    ex, c = m.model.layers[2].mlp.experts, "model.layers.2.mlp.experts."
    want = torch.cat([ck[c + "3.gate_proj.weight"][16:], ck[c + "3.up_proj.weight"][16:]])
    torch.testing.assert_close(ex.gate_up_proj[3], want, rtol=0, atol=0)
    torch.testing.assert_close(ex.down_proj[1], ck[c + "1.down_proj.weight"][:, 16:], rtol=0, atol=0)
    path = family_dirs["gpt_oss"]
    m, ck = load_model(path), load_file(os.path.join(path, "model.safetensors"))
    ex, c = m.model.layers[1].mlp.experts, "model.layers.1.mlp.experts."
    gate_up = ck[c + "gate_up_proj"].transpose(1, 2)                  # [E, 2I, d], gate / up interleaved
    want = torch.cat([gate_up[:, 0::2][:, 16:], gate_up[:, 1::2][:, 16:]], 1)
    torch.testing.assert_close(ex.gate_up_proj, want, rtol=0, atol=0)
    torch.testing.assert_close(ex.down_proj, ck[c + "down_proj"].transpose(1, 2)[:, :, 16:], rtol=0, atol=0)
    torch.testing.assert_close(ex.down_proj_bias, ck[c + "down_proj_bias"], rtol=0, atol=0)


def test_dspark_under_dp_attention_a2a_and_cp(moe_dirs, a2a_calls, tmp_path):
    """What SGLang refuses without a static verify mode: DSpark under DP attention with an
    all-to-all MoE. Verify batches of any size (ragged: each group its own drafts) meet in the
    dispatch; group 0 idles (no rows, still in every all-to-all) while group 1 verifies, then both
    run; with CP each group also splits its long prefills."""
    path, sp = moe_dirs["kimi"], {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = PROMPTS + [LONG]
    plain = Engine(path, **COMMON).generate(input_ids=prompts, sampling_params=sp)
    draft = make_oracle_draft(path, str(tmp_path / "draft"),
                              bigram_of(prompts, [o["output_ids"] for o in plain], KIMI_VOCAB), block_size=4)
    for layout in ("dp2", "dp2cp2"):
        with Engine(path, **LAYOUTS[layout], speculative_algorithm="DSPARK",
                    speculative_draft_model_path=draft, **COMMON) as eng:
            a2a_calls.clear()                   # (start-up forwards measure step costs)
            routed = eng.generate(input_ids=prompts, sampling_params=sp, routed_dp_rank=1)
            idle_sends = [s for s, _ in a2a_calls[0::2]]      # dispatches (combines send back)
            both = eng.generate(input_ids=prompts, sampling_params=sp)
            hist = eng.scheduler.load().spec_accept_hist
        for got in (routed, both):
            assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
        assert idle_sends and not any(sum(s) for s in idle_sends)       # rank 0 sent nothing, took part
        assert sum(k * v for k, v in hist.items()) > 0 and hist.get(0, 0) > 0, hist


def test_a2a_sends_a_token_once_per_expert_rank(moe_dirs, monkeypatch):
    """DeepEP's dispatch (top-2 of 8 experts, 4 a rank): rank 0 sends each of its tokens once to each
    rank owning one of its experts, counted against its own router's choices, with the two slots'
    weights and ids in the row (64 floats + 4); a token whose two experts share a rank travels once
    where a row per slot sent it twice, so fewer bytes go out than per slot; tokens still equal."""
    path = moe_dirs["kimi"]
    want = run_mixed(Engine(path, **COMMON))
    calls: list[tuple[int, list[int], list[int]]] = []
    real = ep.all_to_all_rows

    def recording(x, send, recv):
        calls.append((x[:1].numel() * x.element_size(), list(send), list(recv)))
        return real(x, send, recv)
    with Engine(path, **LAYOUTS["tp2"], **COMMON) as eng:
        routed: list[torch.Tensor] = []
        for block in (m for m in _driver_model(eng).modules() if isinstance(m, MoEBlock)):
            block.gate.register_forward_hook(lambda mod, args, out: routed.append(out[1].clone()))
        monkeypatch.setattr(ep, "all_to_all_rows", recording)
        got = run_mixed(eng)
    dispatches = calls[0::2]
    assert len(dispatches) == len(routed) > 0
    sent = per_slot = 0
    for (row_bytes, send, _), ids in zip(dispatches, routed):
        on = [(ids // 4 == r) for r in range(2)]          # [T, 2]: the slots each rank serves
        assert send == [int(o.any(1).sum()) for o in on]
        assert row_bytes == 64 * 4 + 2 * 2 * 4
        sent += send[1] * row_bytes
        per_slot += int(on[1].sum()) * 64 * 4
    assert 0 < sent < per_slot, (sent, per_slot)
    assert_same(got, want)


def _without_upper_experts(src: str, dst: str) -> str:
    """The Kimi checkpoint with experts 4..7 (rank 1's of 2) never chosen: their score-correction
    bias far below the others' (a routing choice only; the weights of chosen experts keep their
    scores)."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "model.safetensors":
            os.link(os.path.join(src, f), os.path.join(dst, f))
    ck = load_file(os.path.join(src, "model.safetensors"))
    biased = [k for k in ck if k.endswith("e_score_correction_bias")]
    assert biased
    for k in biased:
        ck[k][4:] = -100.0
    save_file(ck, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_rank_without_tokens(moe_dirs, a2a_calls, tmp_path):
    """No token routes to rank 1's experts: it receives no rows in any step yet runs every
    all-to-all (and, under DP attention with every request on group 1, rank 0 sends none either)."""
    path = _without_upper_experts(moe_dirs["kimi"], str(tmp_path / "kimi_low"))
    one = Engine(path, **COMMON)
    want = run_mixed(one)
    with Engine(path, **LAYOUTS["tp2"], **COMMON) as eng:
        got = run_mixed(eng)
        load = eng.scheduler.load()
    assert load.moe_rank_tokens[0] > 0 and load.moe_rank_tokens[1] == 0
    assert a2a_calls and all(s[1] == 0 for s, _ in a2a_calls[0::2])     # dispatches: nothing to rank 1
    assert_same(got, want)
    a2a_calls.clear()
    with Engine(path, **LAYOUTS["dp2"], **COMMON) as eng:
        got = [eng.generate(input_ids=p, sampling_params=SP_LONG, routed_dp_rank=1) for p in PROMPTS[:2]]
    assert all(sum(s) == 0 and r[0] == 0 for s, r in a2a_calls[0::2])  # rank 0 (idle group): no rows out
    assert any(r[1] for s, r in a2a_calls[0::2])                        # rank 1's rows to rank 0's experts
    assert_same(got, [one.generate(input_ids=p, sampling_params=SP_LONG) for p in PROMPTS[:2]])


def _samples(text: str, metric: str, label: str) -> dict[int, float]:
    """{label value: sample} of a sparkserve:<metric> gauge in a Prometheus text page."""
    pattern = rf'^sparkserve:{metric}{{[^}}]*{label}="(\d+)"[^}}]*}} (\S+)$'
    return {int(m[1]): float(m[2]) for m in re.finditer(pattern, text, re.M)}


@pytest.mark.parametrize("layout", [("--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "a2a"),
                                    ("--pp-size", "2")], ids=["a2a", "pp2"])
def test_metrics_report_expert_and_rank_tokens(moe_dirs, layout):
    """/metrics against the single-process engine's counts for the same request: over 2 expert
    ranks, and over 2 pipeline stages (1 of the model's 3 MoE layers on the driver's stage, 2 on
    the other, whose counts the driver gathers)."""
    path = moe_dirs["kimi"]
    server = ServerProcess("--model-path", path, *layout, "--max-total-tokens", "2048",
                           "--chunked-prefill-size", "16")
    try:
        one = Engine(path, **COMMON)
        sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        one.generate(input_ids=PROMPTS[1], sampling_params=sp)
        want = routed_token_counts(one.scheduler.runner.model)
        r = httpx.post(server.url + "/generate", timeout=120,
                       json={"input_ids": PROMPTS[1], "sampling_params": sp})
        assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    experts = _samples(text, "moe_expert_tokens", "expert")
    ranks = _samples(text, "moe_rank_tokens", "ep_rank")
    assert [experts[e] for e in sorted(experts)] == want
    assert ranks == ({0: sum(want[:4]), 1: sum(want[4:])} if "--ep-size" in layout else {0: sum(want)})
    # 40 prompt tokens and 7 decoded ones, 2 of 8 experts each, on the model's MoE layers
    moe_layers = sum(isinstance(m, MoEBlock) for m in one.scheduler.runner.model.modules())
    assert sum(want) == (40 + 7) * 2 * moe_layers


def test_tp_moe_widths_that_do_not_split(moe_dirs):
    cfg = load_config(moe_dirs["kimi"])
    check_tp(cfg, 2, 1, model_class(cfg).tp_dims(cfg))                  # 32 channels: 16 a rank
    with pytest.raises(ValueError, match=r"--tp-size 3 --ep-size 1 \(experts by width\): the model's 32 "
                                         "expert channels do not split over 3 ranks; use one of 1, 2, 4, 8"):
        check_tp(cfg, 3, 1, model_class(cfg).tp_dims(cfg))


def test_a2a_serves_shared_experts_that_do_not_split(tmp_path):
    """MiniMax-M3 with a 33-channel shared expert over 2 ranks: the all-reduce backend (shared experts
    split by width) is refused naming those channels; the all-to-all backend keeps shared experts
    whole on every rank, so the start-up check lets it through and it serves the model, equal to
    one process."""
    path = make_minimax(str(tmp_path / "odd_shared"), shared_intermediate_size=33)
    cfg = load_config(path)
    dims = model_class(cfg).tp_dims(cfg)
    with pytest.raises(ValueError, match="--tp-size 2: the model's 33 shared-expert channels do not split"):
        check_tp(cfg, 2, 2, dims)
    with pytest.raises(ValueError, match="33 shared-expert channels"):     # a2a needs --ep-size > 1
        check_tp(cfg, 2, 1, dims, a2a=True)
    check_tp(cfg, 2, 2, dims, a2a=True)
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, **LAYOUTS["tp2"], **COMMON) as eng:
        shared = [m.shared_experts for m in _driver_model(eng).modules() if isinstance(m, MoEBlock)]
        assert shared and all(s.down_proj.parts == 1 for s in shared)
        got = run_mixed(eng)
    assert_same(got, want)


def test_a2a_flags_are_checked(moe_dirs):
    def refused(match: str, **kw) -> None:
        with pytest.raises(ValueError, match=match):
            ServerArgs(model_path=moe_dirs["kimi"], **kw).validate()
    refused("--moe-a2a-backend a2a dispatches .* give --ep-size 2", tp_size=2, moe_a2a_backend="a2a")
    for other in ("mooncake", "mori", "flashinfer"):        # SGLang's other backends: the values taken named
        refused(rf"--moe-a2a-backend {other}: use one of none, a2a, deepep \(deepep runs sparkserve's a2a",
                tp_size=2, ep_size=2, moe_a2a_backend=other)
    refused("--moe-a2a-backend deepep dispatches .* give --ep-size 2", tp_size=2, moe_a2a_backend="deepep")


def test_deepep_runs_the_a2a_backend(moe_dirs, a2a_calls, caplog):
    """SGLang's `--moe-a2a-backend deepep` is taken (on the command line too) and runs the all-to-all
    backend, saying so in the log; tokens equal one process."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep"])
    args = ServerArgs.from_cli_args(ns).validate()
    assert args.parallel_config().moe_a2a_backend == "a2a"
    path = moe_dirs["kimi"]
    want = run_mixed(Engine(path, **COMMON))
    with caplog.at_level(logging.INFO, logger="sparkserve.scheduler.runtime"):
        with Engine(path, tp_size=2, ep_size=2, moe_a2a_backend="deepep", **COMMON) as eng:
            blocks = [m for m in _driver_model(eng).modules() if isinstance(m, MoEBlock)]
            assert blocks and all(b.a2a for b in blocks)
            got = run_mixed(eng)
    assert "MoE backend: a2a (--moe-a2a-backend deepep)" in caplog.text
    assert a2a_calls and any(sum(s) for s, _ in a2a_calls)
    assert_same(got, want)


def test_tp_moe_keeps_quantized_experts_as_blocks(family_dirs, tmp_path):
    """A Q8_0 Mixtral GGUF with one tensor per expert, served with int8 activations: under TP MoE
    each rank holds its slice of every expert as the file's blocks (gate / up block rows, down block
    columns: 64 of 128 channels, two blocks), and the tokens stay the single-process engine's."""
    path = write_gguf(family_dirs["mixtral"].removesuffix(".gguf"), str(tmp_path / "q8.gguf"), "q8_0",
                      per_expert=True)
    common = dict(COMMON, kv_cache_dtype="float32")
    want = run_mixed(Engine(path, **common))
    with Engine(path, tp_size=2, **common) as eng:
        ex = [m.experts for m in eng.scheduler.runner.model.modules() if isinstance(m, MoEBlock)]
        assert ex and all(e.block_experts is not None and e.width_parts == 2 for e in ex)
        gate_up, down = ex[0].block_experts[0]
        assert (gate_up.out_features, down.in_features) == (2 * ex[0].width, ex[0].width)
        got = run_mixed(eng)
    assert_same(got, want)
