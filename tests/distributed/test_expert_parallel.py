"""MoE models under tensor parallelism (--tp-size 2 --ep-size 2, gloo, 1 torch thread per rank): Kimi-Linear,
MiniMax-M3, Qwen3-MoE and Mixtral split their attention heads (MLA, KDA, full and block-sparse attention,
the lightning indexer's heads; KV and index heads replicated when fewer than the ranks), dense MLP and
shared-expert widths, and routed experts over the ranks, and give the single-process engine's tokens and
logprobs, under pipeline stages too, and with DSpark (KDA state committed per rank). Each rank holds only
its slice of the checkpoint (module and pool shapes, rank 1's weights); layouts that do not split are
refused at start-up naming the flags."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from dspark_fixtures import make_oracle_draft
from family_fixtures import make_family_checkpoint, write_gguf
from kimi_fixtures import VOCAB as KIMI_VOCAB
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from parallel_fixtures import COMMON, PROMPTS, act_as_rank, assert_same, bigram_of, run_mixed
from safetensors.torch import load_file

from sparkserve import Engine
from sparkserve.distributed.sharding import check_tp
from sparkserve.models.registry import load_config, load_model, model_class

TP2 = dict(tp_size=2, ep_size=2)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "kimi_qlora": make_kimi(str(root / "kimi_qlora"), "mla_kda"),
            "minimax": with_index_value(make_minimax(str(root / "minimax"))),
            # one KV head and one index head: both replicated on the two ranks
            "minimax_shared": with_index_value(make_minimax(str(root / "minimax_shared"),
                                                            num_key_value_heads=1, index_n_heads=1))}


def _split_sizes(model, pool) -> set[tuple]:
    """What this rank holds of each layer: heads, widths, experts, pool items."""
    out = set()
    for i in model.layer_range:
        layer = model.model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        kind = type(attn).__name__
        if kind == "KimiDeltaAttention":
            out.add((kind, attn.h, attn.conv_weight.shape[0], attn.o_proj.in_features,
                     tuple(pool.get("kda_state", i).shape[1:]), tuple(pool.get("kda_conv", i).shape[1:])))
        elif kind == "MLAttention":
            out.add((kind, attn.h, attn.kv_b_proj.weight.shape[0], attn.o_proj.in_features,
                     tuple(pool.get("kv_latent", i).shape[1:])))
        else:
            idx = attn.indexer
            out.add((kind, attn.h, attn.hkv, attn.o_proj.in_features, tuple(pool.get("k", i).shape[1:]),
                     idx and (idx.h, idx.qkv_proj.out_features, tuple(pool.get("index_k", i).shape[1:]))))
        if hasattr(mlp, "experts"):
            out.add(("moe", mlp.experts.local, mlp.shared_experts.down_proj.in_features))
        else:
            out.add(("mlp", mlp.down_proj.in_features))
    return out


# (model, layout) -> what the driver (tp rank 0) holds
SPLITS = {
    ("kimi", "tp2"): {("KimiDeltaAttention", 2, 96, 32, (2, 16, 16), (3, 96)), ("mlp", 48),
                      ("MLAttention", 2, 64, 32, (24,)), ("moe", 4, 16)},
    ("kimi_qlora", "tp2"): {("MLAttention", 2, 64, 32, (24,)), ("KimiDeltaAttention", 2, 96, 32, (2, 16, 16),
                                                                  (3, 96)), ("moe", 4, 32), ("mlp", 48)},
    ("kimi", "tp2pp2"): {("KimiDeltaAttention", 2, 96, 32, (2, 16, 16), (3, 96)), ("mlp", 48),
                         ("MLAttention", 2, 64, 32, (24,)), ("moe", 4, 16)},
    ("minimax", "tp2"): {("M3Attention", 2, 1, 32, (1, 16), None), ("mlp", 48),
                         ("M3Attention", 2, 1, 32, (1, 16), (1, 48, (16,))),      # + index V on layer 2
                         ("M3Attention", 2, 1, 32, (1, 16), (1, 32, (16,))), ("moe", 2, 16)},
    ("minimax_shared", "tp2"): {("M3Attention", 2, 1, 32, (1, 16), None), ("mlp", 48),
                                ("M3Attention", 2, 1, 32, (1, 16), (1, 48, (16,))),
                                ("M3Attention", 2, 1, 32, (1, 16), (1, 32, (16,))), ("moe", 2, 16)},
    ("minimax", "pp2"): {("M3Attention", 4, 2, 64, (2, 16), None), ("mlp", 96),
                         ("M3Attention", 4, 2, 64, (2, 16), (2, 48, (16,))), ("moe", 4, 32)},
}
LAYOUTS = {"tp2": TP2, "tp2pp2": dict(TP2, pp_size=2), "pp2": dict(pp_size=2)}


@pytest.mark.parametrize("model,layout", list(SPLITS))
def test_split_ranks_equal_one_process(moe_dirs, model, layout):
    path = moe_dirs[model]
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, **LAYOUTS[layout], **COMMON) as eng:
        runner = eng.scheduler.runner
        assert _split_sizes(runner.model, runner.kv_pool) == SPLITS[model, layout]
        got = run_mixed(eng)
    assert_same(got, want)


def _rank1(monkeypatch, path: str):
    """Rank 1 of two, built and loaded in this process."""
    act_as_rank(monkeypatch, tp_rank=1, tp_size=2, ep_size=2)
    return load_model(path), load_file(os.path.join(path, "model.safetensors"))


def test_rank1_keeps_its_slices_kimi(moe_dirs, monkeypatch):
    m, ck = _rank1(monkeypatch, moe_dirs["kimi"])
    kda, mla = m.model.layers[0].self_attn, m.model.layers[1].self_attn
    c = "model.layers.0.self_attn."
    torch.testing.assert_close(kda.in_proj.weight[:32], ck[c + "q_proj.weight"][32:], rtol=0, atol=0)
    torch.testing.assert_close(kda.in_proj.weight[96:112], ck[c + "f_a_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(kda.in_proj.weight[128:], ck[c + "b_proj.weight"][2:], rtol=0, atol=0)
    torch.testing.assert_close(kda.conv_weight[32:64], ck[c + "k_conv1d.weight"][32:, 0], rtol=0, atol=0)
    torch.testing.assert_close(kda.A_log, ck[c + "A_log"].reshape(-1)[2:], rtol=0, atol=0)
    torch.testing.assert_close(kda.dt_bias, ck[c + "dt_bias"][32:], rtol=0, atol=0)
    torch.testing.assert_close(kda.g_b_proj.weight, ck[c + "g_b_proj.weight"][32:], rtol=0, atol=0)
    torch.testing.assert_close(kda.o_proj.weight, ck[c + "o_proj.weight"][:, 32:], rtol=0, atol=0)
    c = "model.layers.1.self_attn."
    torch.testing.assert_close(mla.q_proj.weight, ck[c + "q_proj.weight"][48:], rtol=0, atol=0)
    torch.testing.assert_close(mla.kv_b_proj.weight, ck[c + "kv_b_proj.weight"][64:], rtol=0, atol=0)
    torch.testing.assert_close(mla.kv_a_proj_with_mqa.weight, ck[c + "kv_a_proj_with_mqa.weight"], rtol=0,
                               atol=0)
    torch.testing.assert_close(mla.o_proj.weight, ck[c + "o_proj.weight"][:, 32:], rtol=0, atol=0)
    moe = m.model.layers[1].mlp
    c = "model.layers.1.block_sparse_moe."
    torch.testing.assert_close(moe.shared_experts.gate_up_proj.weight[16:],
                               ck[c + "shared_experts.up_proj.weight"][16:], rtol=0, atol=0)
    torch.testing.assert_close(moe.experts.down_proj[0], ck[c + "experts.4.w2.weight"], rtol=0, atol=0)


def test_rank1_keeps_its_slices_minimax(moe_dirs, monkeypatch):
    m, ck = _rank1(monkeypatch, moe_dirs["minimax"])
    attn, idx = m.model.layers[2].self_attn, m.model.layers[2].self_attn.indexer
    c = "model.layers.2.self_attn."
    torch.testing.assert_close(attn.qkv_proj.weight[:32], ck[c + "q_proj.weight"][32:], rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj.weight[32:48], ck[c + "k_proj.weight"][16:], rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.weight, ck[c + "o_proj.weight"][:, 32:], rtol=0, atol=0)
    torch.testing.assert_close(idx.qkv_proj.weight[:16], ck[c + "indexer.q_proj.weight"][16:], rtol=0, atol=0)
    torch.testing.assert_close(idx.qkv_proj.weight[16:32], ck[c + "indexer.k_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(idx.o_proj.weight, ck[c + "indexer.o_proj.weight"][:, 16:], rtol=0, atol=0)
    assert idx.adds_value
    w = ck["model.layers.0.mlp.gate_up_proj.weight"]           # gate rows 0..95, up rows 96..191
    torch.testing.assert_close(m.model.layers[0].mlp.gate_up_proj.weight, torch.cat([w[48:96], w[144:]]),
                               rtol=0, atol=0)
    m, ck = _rank1(monkeypatch, moe_dirs["minimax_shared"])
    attn, idx = m.model.layers[2].self_attn, m.model.layers[2].self_attn.indexer
    torch.testing.assert_close(attn.qkv_proj.weight[32:48], ck[c + "k_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(idx.o_proj.weight, ck[c + "indexer.o_proj.weight"], rtol=0, atol=0)
    assert not idx.adds_value           # rank 0 adds the one index head's value output


@pytest.fixture(scope="module")
def family_moe_dirs(tmp_path_factory):
    """Qwen3-MoE's HF directory (per-expert tensors) and Mixtral's GGUF file (stacked ffn_*_exps)."""
    root = tmp_path_factory.mktemp("family_moe")
    mixtral = make_family_checkpoint("mixtral", str(root / "mixtral"))
    return {"qwen3_moe": make_family_checkpoint("qwen3_moe", str(root / "qwen3_moe")),
            "mixtral": write_gguf(mixtral, str(root / "mixtral.gguf")),
            "gpt_oss": make_family_checkpoint("gpt_oss", str(root / "gpt_oss"))}


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_llama_moe_split_ranks_equal_one_process(family_moe_dirs, name):
    """Qwen3-MoE / Mixtral / GPT-OSS (the Llama model with MoE layers; Qwen3-MoE's layer 1 dense;
    GPT-OSS's sinks split with the heads, its experts' biases with the experts) on --tp-size 2
    --ep-size 2: heads and the dense MLP split, 2 of the 4 experts (whole width) on each rank."""
    path, common = family_moe_dirs[name], dict(COMMON, activation_quant="none", kv_cache_dtype="float32")
    want = run_mixed(Engine(path, **common))
    with Engine(path, **TP2, **common) as eng:
        layers = eng.scheduler.runner.model.model.layers
        held = [(l.self_attn.h, l.self_attn.hkv, l.mlp.experts.local if hasattr(l.mlp, "experts") else
                 l.mlp.down_proj.in_features) for l in layers]
        got = run_mixed(eng)
    assert held == ([(2, 1, 2), (2, 1, 64), (2, 1, 2)] if name == "qwen3_moe" else [(2, 1, 2)] * 2)
    assert_same(got, want)


def test_rank1_keeps_its_experts_qwen3_moe(family_moe_dirs, monkeypatch):
    m, ck = _rank1(monkeypatch, family_moe_dirs["qwen3_moe"])
    ex, c = m.model.layers[2].mlp.experts, "model.layers.2.mlp.experts."
    assert (ex.first, ex.local) == (2, 2)
    torch.testing.assert_close(ex.gate_up_proj[0], torch.cat([ck[c + "2.gate_proj.weight"],
                                                              ck[c + "2.up_proj.weight"]]), rtol=0, atol=0)
    torch.testing.assert_close(ex.down_proj[1], ck[c + "3.down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(m.model.layers[2].mlp.gate.weight, ck["model.layers.2.mlp.gate.weight"],
                               rtol=0, atol=0)


def test_dspark_kimi_under_tp(moe_dirs, tmp_path):
    """VERIFY leaves each rank's KDA heads untouched; every rank commits its own heads' state."""
    path, sp = moe_dirs["kimi"], {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    plain = Engine(path, **COMMON).generate(input_ids=PROMPTS, sampling_params=sp)
    draft = make_oracle_draft(path, str(tmp_path / "draft"),
                              bigram_of(PROMPTS, [o["output_ids"] for o in plain], KIMI_VOCAB), block_size=4)
    with Engine(path, **TP2, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
                speculative_dspark_verify_mode="full", **COMMON) as eng:
        got = eng.generate(input_ids=PROMPTS, sampling_params=sp)
        hist = dict(eng.scheduler.accept_hist)
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    assert sum(k * v for k, v in hist.items()) > 0 and hist.get(0, 0) > 0, hist    # accepts and misses


def test_bad_expert_layouts(moe_dirs, llama_dir):
    """(--tp-size 2 alone splits every expert by width: tests/distributed/test_moe_a2a.py.)"""
    with pytest.raises(ValueError, match="--ep-size 2: LlamaForCausalLM has no experts"):
        Engine(llama_dir, tp_size=2, ep_size=2, **COMMON)
    with pytest.raises(ValueError, match="--ep-size 3: the model's 4 experts do not split over 3 ranks"):
        Engine(moe_dirs["minimax"], tp_size=3, ep_size=3, **COMMON)
    with pytest.raises(ValueError, match="--ep-size 2: experts split over a tensor-parallel group"):
        Engine(moe_dirs["kimi"], ep_size=2, **COMMON)


def _config_copy(src: str, dst: str, **changes) -> str:
    """A model directory with only a changed config.json: enough for the start-up check."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(dict(cfg, **changes), f)
    return dst


@pytest.mark.parametrize("model,changes,match", [
    ("kimi", dict(linear_num_heads=3), "--tp-size 2: the model's 3 KDA heads do not split over 2 ranks; "
                                       "use one of 1, 3$"),
    ("kimi", dict(num_attention_heads=6, linear_num_heads=6), None),                          # splits
    ("kimi", dict(num_attention_heads=3), "the model's 3 attention heads do not split .* use one of 1, 3$"),
    ("kimi", dict(intermediate_size=95), "the model's 95 dense MLP channels do not split .* 1, 5, 19, 95$"),
    ("kimi", dict(moe_intermediate_size=33), "the model's 33 shared-expert channels do not split"),
    ("minimax", dict(num_attention_heads=6, num_key_value_heads=2, index_n_heads=3),
     "the model's 3 index heads neither split over 2 ranks nor replicate evenly onto them; "
     "use one of 1, 3, 6$"),
    ("minimax", dict(num_key_value_heads=3, num_attention_heads=6, index_n_heads=2),
     "the model's 3 KV heads neither split .* use one of 1, 3, 6$"),
    ("minimax", dict(dense_intermediate_size=97), "the model's 97 dense MLP channels do not split"),
    ("minimax", dict(shared_intermediate_size=31), "the model's 31 shared-expert channels do not split"),
])
def test_heads_and_widths_that_do_not_split(moe_dirs, tmp_path, model, changes, match):
    cfg = load_config(_config_copy(moe_dirs[model], str(tmp_path / "m"), **changes))
    dims = model_class(cfg).tp_dims(cfg)
    if match is None:
        check_tp(cfg, 2, 2, dims)
        return
    with pytest.raises(ValueError, match=match):
        check_tp(cfg, 2, 2, dims)


def test_start_up_refuses_heads_that_do_not_split(moe_dirs, tmp_path):
    """The check runs before any rank joins or loads weights (a config is all it reads)."""
    path = _config_copy(moe_dirs["kimi"], str(tmp_path / "m"), linear_num_heads=3)
    with pytest.raises(ValueError, match="--tp-size 2: the model's 3 KDA heads do not split over 2 ranks"):
        Engine(path, **TP2, **COMMON)
