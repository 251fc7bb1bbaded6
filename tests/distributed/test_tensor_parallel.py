"""Tensor parallelism on torch.distributed (gloo, 1 torch thread per rank): two ranks give the
single-process engine's greedy tokens and logprobs, with chunked prefill, a prefix-cache hit,
retraction, return_hidden_states and DSpark; KV heads split or replicated; the vocab split over
the ranks, tied LM head or not, padded when it does not divide (3 ranks); a draft without its own
embedding / LM head gets the target's full ones; two launches on 127.0.0.1 as two nodes; bad
layouts refused at start-up naming the flags, and a second engine beside a parallel one."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_CONFIGS, assert_no_kv_leak
from dspark_fixtures import make_oracle_draft
from parallel_fixtures import COMMON, PROMPTS, assert_same, bigram_of, make_tp3_llama, run_mixed
from server_harness import free_port

from sparkserve import Engine


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory) -> str:
    """Llama with a single KV head: two ranks replicate it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(5)
    cfg = AutoConfig.for_model("llama", **dict(TINY_CONFIGS["llama"], num_key_value_heads=1))
    path = str(tmp_path_factory.mktemp("mqa"))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("qwen3", 2), ("mistral", 2), ("mqa", 2), ("untied", 3),
                                     ("tied", 3)])
def test_ranks_equal_one(arch, tp, tiny_dirs, mqa_dir, tmp_path):
    """Llama untied, Qwen3 tied (320 rows: 160 a rank); on 3 ranks the vocab pads to 321."""
    path = mqa_dir if arch == "mqa" else tiny_dirs.get(arch) or make_tp3_llama(str(tmp_path), arch == "tied")
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, tp_size=tp, **COMMON) as eng:
        assert eng.scheduler.runner.model.lm_head.out_features == -(-320 // tp)   # the driver's slice
        got = run_mixed(eng)
        assert got[3]["meta_info"]["cached_tokens"] >= 16             # the prefix cache served it
        assert_no_kv_leak(eng.scheduler.cache)
        if arch == "llama":          # another engine beside it is refused, not left waiting for ranks
            with pytest.raises(ValueError, match="shut that one down first"):
                Engine(path, **COMMON)
    assert_same(got, want)


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied"])
def test_qwen2_ranks_equal_one(name, tmp_path):
    """Qwen2 (q/k/v biases split with their heads, every 1-D parameter off its init value; tied:
    the vocab-split LM head is the embedding) on two ranks equals one process."""
    from family_fixtures import make_family_checkpoint
    path = make_family_checkpoint(name, str(tmp_path / name))
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, tp_size=2, **COMMON) as eng:
        attn = eng.scheduler.runner.model.model.layers[0].self_attn
        assert attn.qkv_proj.bias.shape == (2 * 16 + 16 + 16,) and attn.o_proj.bias is None  # q 2, k 1, v 1
        got = run_mixed(eng)
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3_longrope", "olmo2", "olmo3"])
def test_families_ranks_equal_one(name, tmp_path):
    """Gemma (the scaled embedding summed over the vocab-split ranks, q/k norms and soft-capped
    scores per head, the final soft-cap on the gathered logits), Phi-3 (its fused q|k|v and
    gate|up tensors cut into each rank's heads and channels) and OLMo 2 / 3 (q/k norms over the whole
    projection, their sums of squares summed over the ranks; OLMo 3's windowed layers with their
    own rope) on two ranks equal one process."""
    from family_fixtures import make_family_checkpoint
    path = make_family_checkpoint(name, str(tmp_path / name))
    want = run_mixed(Engine(path, **COMMON))
    with Engine(path, tp_size=2, **COMMON) as eng:
        got = run_mixed(eng)
        assert_no_kv_leak(eng.scheduler.cache)
    assert_same(got, want)


def test_retraction_and_hidden_states_under_tp(llama_dir):
    kw = dict(COMMON, max_total_tokens=96, max_running_requests=4, disable_radix_cache=True,
              enable_return_hidden_states=True)
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    prompts = [list(range(3, 3 + n)) for n in (9, 13, 11, 7)]       # 4 x (~10 + 20) > 96 slots
    want = Engine(llama_dir, **kw).generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True)
    with Engine(llama_dir, tp_size=2, **kw) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True)
        assert eng.scheduler.num_retractions > 0
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g["meta_info"]["hidden_states"], w["meta_info"]["hidden_states"],
                                   atol=1e-4, rtol=1e-4)


def test_dspark_under_tp_is_lossless(llama_dir, tmp_path):
    """The draft runs on the driver over the full hidden rows every rank computes; drafts that
    follow the plain answers' bigrams accept some tokens and miss others."""
    sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    plain = Engine(llama_dir, **COMMON).generate(input_ids=PROMPTS, sampling_params=sp)
    bigram = bigram_of(PROMPTS, [o["output_ids"] for o in plain], TINY_CONFIGS["llama"]["vocab_size"])
    draft = make_oracle_draft(llama_dir, str(tmp_path / "draft"), bigram, block_size=4)
    with Engine(llama_dir, tp_size=2, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
                speculative_dspark_verify_mode="full", **COMMON) as eng:
        got = eng.generate(input_ids=PROMPTS, sampling_params=sp)
        hist = eng.scheduler.accept_hist
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in plain]
    assert sum(k * v for k, v in hist.items()) > 0 and hist.get(0, 0) + hist.get(1, 0) > 0, hist


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_draft_gets_full_vocab_under_tp(arch, tiny_dirs, tmp_path):
    """A draft checkpoint without embed_tokens / lm_head: under TP the driver reads the target's
    full ones from its checkpoint (the target keeps a slice); drafting equals one process's."""
    from dspark_fixtures import make_random_draft
    from safetensors.torch import load_file
    path = tiny_dirs[arch]
    draft = make_random_draft(path, str(tmp_path / "draft"), include_shared=False, std=0.05)
    ckpt = load_file(f"{path}/model.safetensors")
    tied = TINY_CONFIGS[arch]["tie_word_embeddings"]
    head = ckpt["model.embed_tokens.weight" if tied else "lm_head.weight"]
    kw = dict(COMMON, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
              speculative_dspark_verify_mode="full")
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    one = Engine(path, **kw)
    want, want_hist = one.generate(input_ids=PROMPTS, sampling_params=sp), dict(one.scheduler.accept_hist)
    with Engine(path, tp_size=2, **kw) as eng:
        d = eng.scheduler.spec.draft
        assert torch.equal(d.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
        assert torch.equal(d.lm_head.weight, head)
        assert eng.scheduler.runner.model.lm_head.weight.shape[0] == 160
        got = eng.generate(input_ids=PROMPTS, sampling_params=sp)
        assert dict(eng.scheduler.accept_hist) == want_hist
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_two_nodes_on_one_machine(llama_dir):
    """`sparkserve serve --nnodes 2 --node-rank 1` runs rank 1 only; node 0 (this Engine) drives."""
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model-path", llama_dir, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr,
             "--num-threads", "1", "--chunked-prefill-size", "16", "--max-total-tokens", "2048"]
    node1 = subprocess.Popen([sys.executable, "-m", "sparkserve", "serve", "--node-rank", "1", *flags],
                             env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    try:
        want = run_mixed(Engine(llama_dir, **COMMON))
        with Engine(llama_dir, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **COMMON) as eng:
            got = run_mixed(eng)
        assert node1.wait(60) == 0
    finally:
        node1.kill()
    assert_same(got, want)


def test_bad_layouts_are_refused(llama_dir):
    with pytest.raises(ValueError, match=r"--tp-size 3: the model's 4 attention heads .* use one of 1, 2, 4"):
        Engine(llama_dir, tp_size=3, **COMMON)
    with pytest.raises(ValueError, match="--nnodes 3: the 2 ranks"):
        Engine(llama_dir, tp_size=2, nnodes=3, dist_init_addr="127.0.0.1:1", **COMMON)
    with pytest.raises(ValueError, match="--nnodes > 1 needs --dist-init-addr"):
        Engine(llama_dir, tp_size=2, nnodes=2, **COMMON)
    with pytest.raises(ValueError, match="--node-rank 2: must be in"):
        Engine(llama_dir, tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1", **COMMON)
    with pytest.raises(ValueError, match="--pp-size 4: the model has only 3 layers"):
        Engine(llama_dir, pp_size=4, **COMMON)
    with pytest.raises(ValueError,
                       match="--pp-layer-partition 1,1: give 2 positive layer counts .* 3 layers"):
        Engine(llama_dir, pp_size=2, pp_layer_partition=[1, 1], **COMMON)
    with pytest.raises(ValueError, match="--pp-layer-partition needs one layer count per stage"):
        Engine(llama_dir, pp_size=2, pp_layer_partition=[3], **COMMON)


def test_gguf_blocks_shard(smollm2_path):
    """The embedded SmolLM2 GGUF on 3 ranks (9 heads, 3 KV heads): every rank keeps its slice of
    the Q4_1 blocks (row slices for q|k|v and gate|up, column slices for o_proj and down_proj, the
    vocab rows of the tied embedding / LM head) and the block kernel runs on them; greedy chat
    answers equal one rank's (exact activations: int8 rounding would let the ranks' fp32 summation
    order flip greedy near-ties)."""
    kw = dict(num_threads=1, max_total_tokens=1024, activation_quant="none")
    chats = [[{"role": "user", "content": "Name a color."}], [{"role": "user", "content": "What is 2+3?"}]]
    sp = {"temperature": 0, "max_new_tokens": 12}
    want = Engine(smollm2_path, **kw).generate(messages=chats, sampling_params=sp)
    with pytest.raises(ValueError, match="9 attention heads .* use one of 1, 3, 9"):
        Engine(smollm2_path, tp_size=2, **kw)
    with Engine(smollm2_path, tp_size=3, **kw) as eng:
        layer = eng.scheduler.runner.model.model.layers[0]
        assert layer.self_attn.o_proj._blocks is not None and layer.self_attn.o_proj.in_features == 192
        assert layer.mlp.down_proj._blocks is not None and layer.mlp.gate_up_proj._blocks is not None
        model = eng.scheduler.runner.model          # tied: the LM head is the embedding's slice
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.lm_head._blocks is not None and model.lm_head._blocks.shape == (49152 // 3, 576)
        got = eng.generate(messages=chats, sampling_params=sp)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
