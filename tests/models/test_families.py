"""The families of issue #45 against transformers: Qwen2 / Qwen2.5 (q/k/v bias without o bias, tied or
not, sliding-window fields honoured as Qwen2 applies them), Llama 3.x (llama3 rope scaling; from
GGUF as llama.cpp writes it, a `rope_freqs` tensor), Qwen3-MoE (a dense layer among MoE ones;
norm_topk_prob on and off) and Mixtral (GGUF arch llama with stacked experts), from HF directories and
GGUF files, through the Python layer path and the native step (which MoE models take only with
int8 activations: tests/models/test_moe_decode.py).
Checkpoints: tests/family_fixtures.py (every 1-D parameter moved off its init value; the GGUF files
mirror convert_hf_to_gguf.py, not run)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import EXACT, assert_no_kv_leak, hf_greedy, load_hf_reference
from family_fixtures import FAMILIES, FP32_NATIVE_FAMILIES, LLAMA3_ROPE, make_family_checkpoint, write_gguf
from test_model_logits import Driver, check_against_hf, make_runner, run_schedule
from test_native_mla import NativeCalls
from test_native_step import Counter

from sparkserve import Engine
from sparkserve.config import ModelConfig
from sparkserve.executor.model_runner import ModelRunner
from sparkserve.layers.rotary import _inv_freq
from sparkserve.loader.gguf import gguf_config
from sparkserve.models.llama_native import unsupported

# llama.cpp's qwen2 applies no sliding window (its converter writes none): the windowed variant is HF only.
GGUF_FAMILIES = ["qwen2", "qwen2_tied", "qwen2_yarn", "llama3", "llama3_tied", "llama_linear", "qwen3_moe",
                 "mixtral", "gemma2", "gemma3", "gemma3_local_base", "phi3", "phi3_longrope", "smollm3",
                 "granite", "olmo2", "olmo3", "gpt_oss_gguf", "deepseek_v2", "deepseek_v2_qlora_gguf"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> fp32 directory, name + "_bf16" -> its bf16 copy (block weights: the native step)."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name in FAMILIES:
        dirs[name] = make_family_checkpoint(name, str(root / name), str(root / f"{name}_bf16"))
        dirs[f"{name}_bf16"] = str(root / f"{name}_bf16")
    return dirs


@pytest.fixture(scope="module")
def family_refs(family_dirs) -> dict:
    return {name: load_hf_reference(family_dirs[name]) for name in FAMILIES}


@pytest.fixture(scope="module")
def family_ggufs(family_dirs, tmp_path_factory) -> dict[tuple[str, str], str]:
    root = tmp_path_factory.mktemp("family_ggufs")
    return {(name, ftype): write_gguf(family_dirs[name], str(root / f"{name}.{ftype}.gguf"), ftype)
            for name in GGUF_FAMILIES for ftype in ("f32", "f16")}


def run_checked(path: str, ref, native: bool, monkeypatch) -> int:
    """The test_model_logits schedule (chunked prefill, batched decode, a mixed extend) on `path`;
    every logits row vs `ref`, over the pool the model makes (as the engine does: MLA's latents too).
    Returns how many forwards ran natively (the Llama-family step or DeepSeek-V2's)."""
    count, mla = Counter(monkeypatch), NativeCalls(monkeypatch)
    runner, cache = make_runner(path, 1)
    runner = ModelRunner(runner.model, runner.model.make_pool(cache.num_slots, 8), cache.req_to_token.table)
    runner.model.enable_native_step(native)
    driver = Driver(runner, cache)
    run_schedule(driver, runner.model.config.vocab_size, [13, 1, 23, 6], decode_steps=6, seed=2)
    check_against_hf(driver, ref)
    driver.release()
    assert cache.allocator.free_slots == cache.num_slots
    return len(count.calls) + len(mla.calls)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_match_transformers(name, native, family_dirs, family_refs, monkeypatch):
    """Python path on the fp32 directory; native step (decode and small extends) on its bf16 copy."""
    path = family_dirs[f"{name}_bf16" if native else name]
    ran = run_checked(path, family_refs[name], native, monkeypatch)
    assert (ran >= 6) if native else ran == 0


@pytest.mark.parametrize("ftype", ["f32", "f16"])
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_family_gguf_equals_hf_dir(name, ftype, family_ggufs, family_dirs, family_refs, monkeypatch):
    """The GGUF file (F32; F16 blocks, which the native step runs; DeepSeek-V2's runs both) gives the HF
    directory's logits."""
    path = family_ggufs[name, ftype]
    cfg, hf_cfg = gguf_config(path), ModelConfig.from_hf_dir(family_dirs[name])
    fields = ("architecture", "qkv_bias", "o_bias", "qk_norm", "tie_word_embeddings", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "moe_router", "moe_layers", "layer_windows",
              "embed_scale", "attn_scale", "attn_softcap", "final_softcap", "norm_layout", "activation",
              "norm_offset", "local_rope_theta", "residual_scale", "logits_scaling", "rope_layers",
              "rotary_dim", "qk_norm_full_width")
    for f in fields:          # GGUF metadata holds float32
        got, want = getattr(cfg, f), getattr(hf_cfg, f)
        assert got == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), f
    ran = run_checked(path, family_refs[name], True, monkeypatch)
    assert (ran >= 6) if ftype == "f16" or name in FP32_NATIVE_FAMILIES else ran == 0


@pytest.mark.parametrize("ftype", ["f32", "f16"])
def test_mixtral_gguf_per_expert_tensors(ftype, family_dirs, family_refs, tmp_path, monkeypatch):
    """An older Mixtral GGUF, one tensor per expert (blk.N.ffn_gate.E; F16 ones as blocks, natively),
    equals HF."""
    path = write_gguf(family_dirs["mixtral"], str(tmp_path / "old.gguf"), ftype, per_expert=True)
    ran = run_checked(path, family_refs["mixtral"], True, monkeypatch)
    assert (ran >= 6) if ftype == "f16" else ran == 0


def test_gguf_rope_freqs_equal_llama3_scaling(family_ggufs):
    """The rope_freqs divisors of a Llama 3.1+ GGUF give HF's llama3 inv_freq."""
    cfg = gguf_config(family_ggufs["llama3", "f32"])
    assert cfg.rope_scaling["rope_type"] == "freq_factors" and len(cfg.rope_scaling["factors"]) == 8
    want = _inv_freq(16, LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE)
    got = _inv_freq(16, cfg.rope_theta, cfg.rope_scaling)
    assert not torch.allclose(want, _inv_freq(16, cfg.rope_theta, None), rtol=1e-3)   # it does scale
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied", "llama3_tied", "phi3"])
def test_family_greedy_tokens_match_transformers(name, family_dirs, family_refs):
    """Engine generations (native decode on the bf16 copy) equal transformers' greedy tokens."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (4, 19, 11)]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(family_dirs[f"{name}_bf16"], max_total_tokens=1024, **EXACT) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        assert eng.scheduler.runner.model.native._step is not None, "the native step did not run"
        assert_no_kv_leak(eng.scheduler.cache)
    for p, r in zip(prompts, out):
        assert r["output_ids"] == hf_greedy(family_refs[name], p, 12)


def _cfg(**kw) -> ModelConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=320)
    return ModelConfig.from_hf_dict(dict(base, **kw))


def test_family_config_fields():
    """q/k/v and o bias are apart: HF Llama's attention_bias sets both, Qwen2 implies q/k/v only;
    Qwen2's sliding window only where transformers applies it (use_sliding_window, from layer
    max_window_layers up), so Qwen2.5's shipped configs get none."""
    qwen = _cfg(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                sliding_window=131072, max_window_layers=28)
    assert (qwen.qkv_bias, qwen.o_bias, qwen.qk_norm) == (True, False, False)
    assert qwen.layer_windows == [None] * 4
    assert _cfg(model_type="qwen2", use_sliding_window=True, sliding_window=8,
                max_window_layers=3).layer_windows == [None, None, None, 8]
    llama = _cfg(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True)
    assert (llama.qkv_bias, llama.o_bias) == (True, True)
    assert _cfg(architectures=["Qwen3ForCausalLM"], model_type="qwen3").qk_norm
    assert _cfg(model_type="mistral", sliding_window=8).layer_windows == [8] * 4


def test_o_bias_equals_transformers(tmp_path):
    """A Llama with attention_bias (q/k/v and o bias) equals transformers, natively (the bf16
    copy's decode steps) and from a GGUF."""
    from family_fixtures import _LLAMA3
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **dict(_LLAMA3, attention_bias=True))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    runner, cache = make_runner(str(tmp_path), 1)
    assert unsupported(runner.model) is None
    d = Driver(runner, cache)
    run_schedule(d, 320, [7, 12], decode_steps=3, seed=4)
    ref = load_hf_reference(str(tmp_path))
    check_against_hf(d, ref)
    # and from a GGUF, whose q/k biases llama.cpp permutes as it does the rows
    path = write_gguf(str(tmp_path), str(tmp_path / "bias.gguf"))
    runner, cache = make_runner(path, 1)
    d = Driver(runner, cache)
    run_schedule(d, 320, [7, 12], decode_steps=3, seed=4)
    check_against_hf(d, ref)


def test_unsupported_rope_or_architecture_fails_at_start_up(tmp_path, family_dirs):
    """A rope scaling the loader cannot honour (Qwen2-VL's mrope in config.json; a type llama.cpp's
    metadata names without what it needs, DeepSeek's YaRN log multiplier), partial rotary on a
    permuted arch and an unknown GGUF architecture are refused when the model loads, naming the key
    and what is supported; never served with plain rope."""
    import json
    import shutil

    import gguf

    from sparkserve.models.registry import load_config, load_model
    mrope = tmp_path / "mrope"
    shutil.copytree(family_dirs["qwen2"], mrope)
    cfg = json.loads((mrope / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    (mrope / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'mrope' is not supported \(supported: default, linear, llama3, "
                                         r"yarn, longrope, dynamic\)"):
        load_model(str(mrope))
    with pytest.raises(ValueError, match="'mrope' is not supported"):
        Engine(str(mrope), max_total_tokens=64)
    for i, (arch, key, value, error) in enumerate((
            ("bloom", None, None, r"'bloom' is not supported.*'qwen2'"),
            ("llama", "llama.rope.dimension_count", 8, "llama.rope.dimension_count"),
            ("qwen2", "qwen2.rope.scaling.type", "longrope", r"rope\.scaling\.type = 'longrope' is not"),
            ("qwen2", "qwen2.rope.scaling.yarn_log_multiplier", 0.1, "yarn_log_multiplier"))):
        path = str(tmp_path / f"{arch}{i}.gguf")
        w = gguf.GGUFWriter(path, arch)
        w.add_head_count(4), w.add_embedding_length(64), w.add_vocab_size(320)
        if key == "qwen2.rope.scaling.yarn_log_multiplier":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key:
            w.add_uint32(key, value)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
        w.close()
        with pytest.raises(ValueError, match=error):
            load_config(path)


@pytest.mark.parametrize("kw", [{}, {"rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                                      "original_max_position_embeddings": 8192}},
                                 {"layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 5}])
def test_olmo3_config_defaults_equal_transformers(kw):
    """An OLMo 3 config.json that leaves the layer pattern or the per-layer rope out (older style
    `rope_scaling`) reads as transformers' Olmo3Config does: windows on all but every 4th layer,
    the windowed layers' rope unscaled at the global base, the full layers' scaled."""
    from transformers import Olmo3Config
    d = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             vocab_size=320, **kw)
    want = Olmo3Config(**d)
    got = ModelConfig.from_hf_dict(dict(d, model_type="olmo3", architectures=["Olmo3ForCausalLM"]))
    assert got.layer_windows == [want.sliding_window if t == "sliding_attention" else None
                                 for t in want.layer_types]
    assert got.local_rope_theta == want.rope_parameters["sliding_attention"]["rope_theta"]
    assert got.rope_theta == want.rope_parameters["full_attention"]["rope_theta"]
    full = want.rope_parameters["full_attention"]
    assert (got.rope_scaling or {}).get("rope_type", "default") == full["rope_type"]
    assert (got.rope_scaling or {}).get("factor") == full.get("factor")
    assert got.qk_norm_full_width and got.norm_layout == "post"


def test_moe_config_fields():
    """The router rule is a named field: Mixtral always renormalises its top-k, Qwen3-MoE when
    norm_topk_prob (transformers' default: off); Qwen3-MoE's dense layers are mlp_only_layers and
    those off decoder_sparse_step; a family without experts has none."""
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    q = _cfg(model_type="qwen3_moe", num_experts=8, mlp_only_layers=[0], decoder_sparse_step=2, **moe)
    assert (q.architecture, q.qk_norm, q.num_experts, q.moe_router) == ("Qwen3MoeForCausalLM", True, 8,
                                                                         "softmax_topk")
    assert q.moe_layers == [False, True, False, True] and q.moe_intermediate_size == 32
    assert _cfg(model_type="qwen3_moe", num_experts=8, norm_topk_prob=True, **moe).moe_router == \
        "softmax_topk_renorm"
    m = _cfg(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    assert (m.moe_router, m.num_experts, m.moe_intermediate_size, m.moe_layers) == \
        ("softmax_topk_renorm", 8, 128, [True] * 4)
    plain = _cfg(model_type="llama", num_local_experts=8)
    assert (plain.num_experts, plain.moe_router, plain.moe_layers) == (0, "", [False] * 4)


def test_moe_fp32_experts_run_natively(family_dirs):
    """Under fp32 activations the experts stay fp32 parameters; the native step runs them in place
    (test_family_logits_match_transformers checks its logits)."""
    runner, _ = make_runner(family_dirs["mixtral_bf16"], 1)
    assert runner.model.model.layers[0].mlp.experts.block_experts is None
    assert unsupported(runner.model) is None


def test_moe_stacked_experts_checkpoint(family_dirs, family_refs, tmp_path, monkeypatch):
    """A checkpoint in transformers 5's runtime names (experts stacked: `experts.gate_up_proj` [E, 2I, d],
    gate rows first, and `experts.down_proj` [E, d, I]) gives the per-expert checkpoint's logits."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    src = family_dirs["qwen3_moe"]
    state = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    shutil.copy(f"{src}/config.json", tmp_path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    assert run_checked(str(tmp_path), family_refs["qwen3_moe"], False, monkeypatch) == 0


def test_moe_gguf_quantized_experts(family_dirs, tmp_path):
    """A Q8_0 Mixtral GGUF (experts stacked and quantized, as --outtype q8_0 writes them): every
    expert holds its Q8_0 values (dequantized: experts are fp32 parameters) and the engine serves it."""
    import gguf
    from safetensors.torch import load_file

    from sparkserve.models.registry import load_model
    path = write_gguf(family_dirs["mixtral"], str(tmp_path / "q8.gguf"), "q8_0")
    model = load_model(path, activation_quant="none", pack=False)
    ck, q8 = load_file(f"{family_dirs['mixtral']}/model.safetensors"), gguf.GGMLQuantizationType.Q8_0

    def q8_values(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8))
    for layer in (0, 1):
        ex, c = model.model.layers[layer].mlp.experts, f"model.layers.{layer}.block_sparse_moe.experts."
        for e in range(4):
            want = torch.cat([q8_values(ck[f"{c}{e}.w1.weight"]), q8_values(ck[f"{c}{e}.w3.weight"])])
            torch.testing.assert_close(ex.gate_up_proj[e], want, rtol=0, atol=0)
            torch.testing.assert_close(ex.down_proj[e], q8_values(ck[f"{c}{e}.w2.weight"]), rtol=0, atol=0)
    with Engine(path, max_total_tokens=256) as eng:
        out = eng.generate(input_ids=[[3, 4, 5, 6]], sampling_params={"max_new_tokens": 4,
                                                                      "ignore_eos": True})
    assert len(out[0]["output_ids"]) == 4


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3_longrope", "smollm3", "granite", "olmo2", "olmo3",
                                  "gpt_oss", "deepseek_v2", "deepseek_v2_qlora"])
def test_python_path_greedy_tokens_match_transformers(name, family_dirs, family_refs):
    """Through the Engine (scheduler; Gemma: a split pool for the sliding layers, prompts past the
    window; Phi: LongRoPE's long factors, partial rotary): transformers' greedy tokens. Every prompt
    is past Phi's pre-training length of 4, where transformers' generate rotates by the long
    factors from the prompt on (shorter, it would switch factors mid-answer)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 21, 12)]
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(family_dirs[name], max_total_tokens=1024, **EXACT) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        assert_no_kv_leak(eng.scheduler.cache)
    for p, r in zip(prompts, out):
        assert r["output_ids"] == hf_greedy(family_refs[name], p, 10)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, monkeypatch):
    """A Gemma 3 4B+ checkpoint (Gemma3ForConditionalGeneration: `text_config`, the language model
    under `language_model.`, a vision tower beside it) serves its language model: the logits of
    transformers' model on text, the vision tensors never read."""
    from family_fixtures import _GEMMA, GEMMA3_ROPE
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = {k: v for k, v in _GEMMA.items() if k != "tie_word_embeddings"}
    text.update(num_hidden_layers=2, rope_parameters=GEMMA3_ROPE,
                layer_types=["sliding_attention", "full_attention"])
    cfg = Gemma3Config(text_config=text, mm_tokens_per_image=4, image_token_index=300, boi_token_index=301,
                       eoi_token_index=302, vision_config=dict(hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2,
                                                               image_size=32, patch_size=16))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    assert ModelConfig.from_hf_dir(str(tmp_path)).layer_windows == [8, None]
    assert run_checked(str(tmp_path), load_hf_reference(str(tmp_path)), False, monkeypatch) == 0


def test_gemma_config_fields():
    """Configs as the Gemma checkpoints ship them (before transformers 5 wrote `layer_types` and
    per-layer-type `rope_parameters`): the sliding layers from the family's pattern, Gemma 3's
    local base and global scaling, the scale from query_pre_attn_scalar, a tied head without the
    key; and what cannot be served is refused, naming the key."""
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=320, sliding_window=8, query_pre_attn_scalar=144)
    g2 = _cfg(**dict(base, model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_hidden_layers=4,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert g2.layer_windows == [8, None, 8, None] and g2.tie_word_embeddings
    assert (g2.attn_scale, g2.attn_softcap, g2.final_softcap) == (144 ** -0.5, 50.0, 30.0)
    assert g2.embed_scale == 8.0
    assert (g2.activation, g2.norm_layout, g2.norm_offset) == ("gelu_tanh", "sandwich", 1.0)
    assert not g2.qk_norm
    g3 = _cfg(**dict(base, model_type="gemma3_text", num_hidden_layers=7, rope_theta=1e6,
                     rope_local_base_freq=1e4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6))
    assert g3.layer_windows == [8] * 5 + [None, 8] and g3.qk_norm and g3.attn_softcap is None
    assert (g3.rope_theta, g3.local_rope_theta, g3.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    # gemma-3-4b-it's config.json: the text model's sizes only, transformers' defaults for the rest
    g3mm = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"],
                                     "model_type": "gemma3",
                                     "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                                     "model_type": "gemma3_text", "num_hidden_layers": 34,
                                                     "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                                     "sliding_window": 1024}})
    assert (g3mm.architecture, g3mm.num_attention_heads, g3mm.num_key_value_heads, g3mm.head_dim) == (
        "Gemma3ForConditionalGeneration", 8, 4, 256)
    assert (g3mm.vocab_size, g3mm.rope_theta, g3mm.local_rope_theta) == (262208, 1e6, 1e4)
    assert g3mm.attn_scale == 1 / 16
    assert g3mm.layer_windows[4:7] == [1024, None, 1024] and g3mm.tie_word_embeddings
    with pytest.raises(ValueError, match="hidden_activation 'relu' is not supported"):
        _cfg(**dict(base, model_type="gemma2", num_hidden_layers=2, hidden_activation="relu"))
    with pytest.raises(ValueError, match="sliding_attention: rope_type 'linear'"):
        _cfg(**dict(base, model_type="gemma3_text", num_hidden_layers=2, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}))


def test_phi3_config_and_longrope_choice():
    """Phi-3 configs as shipped (rope_scaling type "su" or "longrope", the pre-training length at
    the top level, Phi-4-mini's partial_rotary_factor): LongRoPE's short factors serve a context
    within the pre-training length (--context-length 4096 on a 128k model, as llama.cpp decides
    by its context), the long ones beyond it; the attention factor is the model's either way."""
    from sparkserve.layers.rotary import RotaryEmbedding
    short, long = [1.0 + i / 10 for i in range(6)], [2.0 + i for i in range(6)]
    for kind in ("su", "longrope"):
        cfg = _cfg(model_type="phi3", architectures=["Phi3ForCausalLM"], max_position_embeddings=131072,
                   original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                   rope_scaling={"type": kind, "short_factor": short, "long_factor": long})
        assert cfg.rotary_dim == 12 and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
        base = _inv_freq(12, 10000.0, None)
        for context, factors in ((4096, short), (131072, long)):
            want = base / torch.tensor(factors, dtype=torch.float64)
            torch.testing.assert_close(_inv_freq(12, 10000.0, cfg.rope_scaling, context), want)
        for context in (4096, 131072):    # the model's extension, whichever factors serve (as transformers)
            cos = RotaryEmbedding(12, context, 10000.0, cfg.rope_scaling).cos
            assert cos[0, 0] == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},       # Qwen
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},                          # DeepSeek-V2
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.0},
    {"rope_type": "dynamic", "factor": 2.0}])
def test_rope_scaling_equals_transformers(rope):
    """YaRN (ramp bounds, interpolation, attention factor, DeepSeek's mscale ratio) and dynamic NTK
    (at a served context past the pre-training length) as transformers computes them."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sparkserve.layers.rotary import _attention_factor
    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=16384,
                     rope_parameters=dict(rope, rope_theta=50000.0))
    context = 65536
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu", seq_len=context)
    cfg = ModelConfig.from_hf_dict(dict(hf.to_dict(), architectures=["LlamaForCausalLM"]))
    torch.testing.assert_close(_inv_freq(128, cfg.rope_theta, cfg.rope_scaling, context).float(), want_inv,
                               rtol=1e-5, atol=0)
    assert _attention_factor(cfg.rope_scaling) == pytest.approx(want_scale, rel=1e-6)


def test_smollm3_and_granite_config_fields():
    """SmolLM3's NoPE layers from `no_rope_layers`, or every `no_rope_layer_interval`-th (4 by
    default) where a config leaves the list out; Granite's four multipliers."""
    assert _cfg(model_type="smollm3", num_hidden_layers=8).rope_layers == [True, True, True, False] * 2
    assert _cfg(model_type="smollm3", no_rope_layer_interval=2).rope_layers == [True, False] * 2
    assert _cfg(model_type="smollm3", no_rope_layers=[1, 0, 0, 1]).rope_layers == [True, False, False, True]
    assert _cfg(model_type="llama").rope_layers == [True] * 4
    g = _cfg(model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
             attention_multiplier=0.0078125, logits_scaling=8.0)
    assert (g.architecture, g.embed_scale, g.residual_scale, g.attn_scale, g.logits_scaling) == (
        "GraniteForCausalLM", 12.0, 0.22, 0.0078125, 8.0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_quantized_moe_experts_stay_quantized(name, family_dirs, tmp_path):
    """A Q8_0 MoE GGUF served with int8 activations holds every expert as its file's blocks (the
    stacked fp32 parameters gone: meta), their values the file's exactly. Its experts compute what
    the same file's fp32 experts do: exactly through the fp32 block kernel, within int8 rounding
    with int8 activations; the model's greedy tokens are those of the model with fp32 experts."""
    import gguf

    from sparkserve.layers.linear import Linear
    from sparkserve.layers.moe import Experts
    from sparkserve.models.registry import load_model
    path = write_gguf(family_dirs[name], str(tmp_path / "moe.q8_0.gguf"), "q8_0")
    i8, exact = load_model(path, activation_quant="int8"), load_model(path, activation_quant="none")
    held = [(n, m) for n, m in i8.named_modules() if isinstance(m, Experts)]
    assert held and all(m.block_experts is not None and m.gate_up_proj.is_meta for _, m in held)
    assert all(m.block_experts is None for m in exact.modules() if isinstance(m, Experts))
    layer = int(held[0][0].split(".")[2])
    q8 = gguf.GGMLQuantizationType.Q8_0
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    gate_up, down = held[0][1].block_experts[1]
    want = gguf.quants.dequantize(raw[f"blk.{layer}.ffn_down_exps.weight"].data[1], q8)
    assert torch.equal(down.held_blocks.dequantize(), torch.from_numpy(want.astype(np.float32)))
    assert gate_up.weight.is_meta and gate_up.held_blocks.gguf_type == q8

    g = torch.Generator().manual_seed(6)
    x, weights = torch.randn(24, 64, generator=g), torch.rand(24, 2, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    ref = exact.model.layers[layer].mlp.experts(x, weights, ids)
    got = held[0][1](x, weights, ids)
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()          # int8 activations (where they run)
    for m in held[0][1].block_experts.modules():
        if isinstance(m, Linear):
            m.set_activation_quant("none")
    torch.testing.assert_close(held[0][1](x, weights, ids), ref, rtol=1e-5, atol=1e-5)


def test_gpt_oss_mxfp4_experts(family_dirs, tmp_path, monkeypatch):
    """The released GPT-OSS checkpoints keep their experts as MXFP4 (`*_blocks` + `*_scales`): the
    values are transformers' own dequantization, and a checkpoint so stored gives the logits of
    transformers' model holding those values."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from sparkserve.models.gpt_oss import dequantize_mxfp4
    g = torch.Generator().manual_seed(7)
    src, dst = family_dirs["gpt_oss"], tmp_path / "mxfp4"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    ref = load_hf_reference(src)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, cols, rows = tensors.pop(name).shape                  # HF [E, in, out]; blocks are per out row
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 128, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        torch.testing.assert_close(dequantize_mxfp4(blocks, scales).transpose(1, 2), want, rtol=0, atol=0)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        ref.get_parameter(name).data.copy_(want)
    save_file(tensors, str(dst / "model.safetensors"))
    assert run_checked(str(dst), ref, False, monkeypatch) == 0


def test_gpt_oss_mxfp4_gguf(family_dirs, tmp_path, monkeypatch):
    """A GPT-OSS GGUF with MXFP4 experts (as llama.cpp ships them): exactly as Q8_0 blocks under int8
    activations (the doubled e2m1 values, d = 2^(e - 128)), and with fp32 experts the logits of
    transformers' model holding the file's values."""
    import gguf

    from sparkserve.layers.moe import Experts
    from sparkserve.models.registry import load_model
    path = write_gguf(family_dirs["gpt_oss_gguf"], str(tmp_path / "mxfp4.gguf"), "mxfp4")
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    mx = gguf.GGMLQuantizationType.MXFP4
    assert raw["blk.0.ffn_gate_exps.weight"].tensor_type == mx

    def values(name: str) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(raw[name].data, mx).astype(np.float32))
    i8 = load_model(path, activation_quant="int8")
    experts = [m for m in i8.modules() if isinstance(m, Experts)]
    assert all(m.block_experts is not None for m in experts)
    gate_up, down = experts[1].block_experts[2]
    assert gate_up.held_blocks.gguf_type == gguf.GGMLQuantizationType.Q8_0
    torch.testing.assert_close(down.held_blocks.dequantize(), values("blk.1.ffn_down_exps.weight")[2],
                               rtol=0, atol=0)
    want_gate_up = torch.cat([values("blk.1.ffn_gate_exps.weight")[2], values("blk.1.ffn_up_exps.weight")[2]])
    torch.testing.assert_close(gate_up.held_blocks.dequantize(), want_gate_up, rtol=0, atol=0)

    ref = load_hf_reference(family_dirs["gpt_oss_gguf"])
    for layer in range(2):
        gate, up = values(f"blk.{layer}.ffn_gate_exps.weight"), values(f"blk.{layer}.ffn_up_exps.weight")
        hf = ref.model.layers[layer].mlp.experts
        hf.gate_up_proj.data[:, :, 0::2] = gate.transpose(1, 2)
        hf.gate_up_proj.data[:, :, 1::2] = up.transpose(1, 2)
        hf.down_proj.data.copy_(values(f"blk.{layer}.ffn_down_exps.weight").transpose(1, 2))
    assert run_checked(path, ref, False, monkeypatch) == 0


def test_context_length_past_trained_positions(family_dirs, family_refs, caplog, monkeypatch):
    """--context-length past the model's positions (256 here) is refused at start-up, naming the
    environment variable that allows it (as SGLang); allowed, it sizes the rope tables to it: a
    300-token prompt decodes as transformers' (which rotates any position) does, with a warning that
    the rope extrapolates."""
    from sparkserve.scheduler.runtime import ALLOW_LONGER_CONTEXT
    monkeypatch.delenv(ALLOW_LONGER_CONTEXT, raising=False)
    with pytest.raises(ValueError, match=f"past the 256 positions.*{ALLOW_LONGER_CONTEXT}=1"):
        Engine(family_dirs["qwen2_tied"], context_length=512, max_total_tokens=1024, **EXACT)
    monkeypatch.setenv(ALLOW_LONGER_CONTEXT, "1")
    prompt = torch.randint(0, 320, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with caplog.at_level("WARNING"):
        eng = Engine(family_dirs["qwen2_tied"], context_length=512, max_total_tokens=1024, **EXACT)
    assert "past the 256 positions" in caplog.text
    with eng:
        assert eng.generate(input_ids=prompt, sampling_params=sp)["output_ids"] == hf_greedy(
            family_refs["qwen2_tied"], prompt, 6)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v2_qlora"])
def test_deepseek_v2_ranks_equal_one(name, family_dirs):
    """DeepSeek-V2 on two ranks (--tp-size 2 --ep-size 2: each rank its MLA heads' rows of q / kv_b
    and o_proj's columns over the replicated latent, half the routed experts, half the shared and
    dense MLP widths) gives one process's greedy tokens and logprobs."""
    from parallel_fixtures import COMMON, assert_same, run_mixed
    path = family_dirs[name]
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, tp_size=2, ep_size=2, **COMMON) as eng:
        layer = eng.scheduler.runner.model.model.layers[1]
        assert layer.self_attn.h == 2 and layer.mlp.experts.local == 2
        got = run_mixed(eng)
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)


@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_deepseek_v2_gguf_before_the_mla_split(ftype, family_dirs, family_refs, monkeypatch, tmp_path):
    """A deepseek2 GGUF as older converters wrote it (kv_b_proj whole as `attn_kv_b`, key_length /
    value_length a head's) equals the HF directory (F32); its Q8_0 form (q, kv_a, kv_b and the
    experts quantized, norms and router F32) serves greedy tokens close to transformers'."""
    path = write_gguf(family_dirs["deepseek_v2"], str(tmp_path / "old.gguf"), ftype, old_mla=True)
    assert gguf_config(path).raw["qk_nope_head_dim"] == 8 and gguf_config(path).raw["v_head_dim"] == 12
    if ftype == "f32":
        assert run_checked(path, family_refs["deepseek_v2"], False, monkeypatch) == 0
        return
    prompt = list(range(3, 19))
    with Engine(path, max_total_tokens=256, **EXACT) as eng:
        out = eng.generate(input_ids=[prompt], sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                                "ignore_eos": True})
    assert out[0]["output_ids"][:2] == hf_greedy(family_refs["deepseek_v2"], prompt, 2)


_V2_LITE_YARN = {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                 "beta_slow": 1, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("rope", [_V2_LITE_YARN, dict(_V2_LITE_YARN, mscale=1.0, mscale_all_dim=0.5),
                                  dict(_V2_LITE_YARN, factor=1.0), None])
def test_deepseek_v2_scales_equal_transformers(rope):
    """A config as DeepSeek-V2-Lite ships it (rope_scaling with `type`, no head_dim): the softmax
    scale (qk_head_dim ** -0.5 x mscale(mscale_all_dim) ** 2), the rope's cos/sin factor and its
    frequencies are transformers' DeepseekV2Attention.scaling, attention_scaling and inv_freq."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2Attention,
        DeepseekV2RotaryEmbedding,
    )

    from sparkserve.layers.rotary import _attention_factor
    from sparkserve.models.deepseek_v2 import DeepseekV2Args
    d = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
             max_position_embeddings=163840, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=24,
             qk_rope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
             rope_theta=10000.0, rope_scaling=rope)
    cfg = ModelConfig.from_hf_dict(d)
    params = {"rope_type": "default"} if rope is None else {k: v for k, v in rope.items() if k != "type"}
    hf_cfg = DeepseekV2Config(**{k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")},
                              rope_parameters=dict(params, rope_type=(rope or {}).get("type", "default"),
                                                   rope_theta=10000.0))
    ours = DeepseekV2Args.from_raw(cfg.raw, cfg.rope_scaling)
    assert ours.softmax_scale == pytest.approx(DeepseekV2Attention(hf_cfg, 0).scaling, rel=1e-12)
    rotary = DeepseekV2RotaryEmbedding(hf_cfg)
    assert _attention_factor(cfg.rope_scaling) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    torch.testing.assert_close(_inv_freq(16, cfg.rope_theta, cfg.rope_scaling).float(), rotary.inv_freq,
                               rtol=1e-6, atol=0)


def test_deepseek_v2_refuses_what_it_does_not_run(family_dirs, tmp_path):
    """A router DeepSeek-V2 does not have here (V3's noaux_tc, sigmoid scores) fails at start-up."""
    import json
    import shutil

    from sparkserve.models.registry import load_model
    for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        shutil.copytree(family_dirs["deepseek_v2"], tmp_path / key)
        with open(tmp_path / key / "config.json") as f:
            cfg = json.load(f)
        with open(tmp_path / key / "config.json", "w") as f:
            json.dump(dict(cfg, **{key: value}), f)
        with pytest.raises(ValueError, match=key):
            load_model(str(tmp_path / key))
