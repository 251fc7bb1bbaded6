"""--device: on CUDA the engine (torch's kernels, fp32 weights) gives transformers' greedy tokens
and logprobs on the same GPU, keeps its pools there, and DSpark there stays lossless against
plain decoding; where CUDA is missing or the flags or the model rule it out, start-up says which
flag and what to do. The CUDA tests run where torch sees a GPU (a GPU machine runs this file)."""
from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, assert_no_kv_leak
from dspark_fixtures import load_hf, make_oracle_draft, make_random_draft, make_target
from kimi_fixtures import make_kimi

from sparkserve import Engine
from sparkserve.args import ServerArgs
from sparkserve.core.device import resolve
from sparkserve.models.registry import load_config, load_model
from sparkserve.scheduler.runtime import model_device

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: run on a GPU machine")
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def prompts_of(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- start-up rules (any machine) -----------------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA: the refusal cannot happen here")
def test_cuda_without_a_gpu_is_a_startup_error(llama_dir):
    with pytest.raises(ValueError, match=r"--device cuda: torch .* sees no CUDA device.*--device cpu"):
        Engine(llama_dir, device="cuda")


def test_flags_that_rule_cuda_out_name_themselves(llama_dir):
    with pytest.raises(ValueError, match="--device cuda with --tp-size 2 --pp-size 1"):
        ServerArgs(model_path=llama_dir, device="cuda", tp_size=2).validate()
    with pytest.raises(ValueError, match="--device cuda with --disaggregation-mode prefill"):
        ServerArgs(model_path=llama_dir, device="cuda", disaggregation_mode="prefill").validate()
    with pytest.raises(ValueError, match="--device tpu: use one of auto, cpu, cuda"):
        ServerArgs(model_path=llama_dir, device="tpu").validate()
    # auto with the same flags is not an error: it stays on the CPU
    assert model_device(ServerArgs(model_path=llama_dir, tp_size=2).validate(),
                        load_config(llama_dir)).type == "cpu"


def test_auto_takes_cuda_only_where_nothing_rules_it_out():
    assert resolve("cpu", None).type == "cpu"
    assert resolve("auto", "with --tp-size 2: ...").type == "cpu"
    assert resolve("auto", None).type == ("cuda" if HAS_CUDA else "cpu")
    with pytest.raises(ValueError, match="--device cuda with X: use --device cpu"):
        resolve("cuda", "with X: use --device cpu")


def test_models_without_cuda_layers_refuse_it(tmp_path):
    path = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    with pytest.raises(ValueError, match="--device cuda with KimiLinearForCausalLM: its layers run on cpu"):
        model_device(ServerArgs(model_path=path, device="cuda").validate(), load_config(path))
    assert model_device(ServerArgs(model_path=path).validate(), load_config(path)).type == "cpu"


def test_gguf_blocks_give_way_to_the_fp32_weights_torch_kernels_read(smollm2_path):
    """registry.to_device's first half, run on the CPU: every block-backed layer of an int8-served
    GGUF model (blocks held packed, most fp32 weights let go) takes its fp32 weight back and drops
    the blocks, as torch's kernels on another device need; it then computes what the exact model
    (activation_quant none) does."""
    from sparkserve.layers.block_backed import BlockBacked, drop_blocks
    from sparkserve.training.feature_cache import capture
    served = load_model(smollm2_path, activation_quant="int8")
    exact = load_model(smollm2_path, activation_quant="none", pack=False)
    layers = [m for m in served.modules() if isinstance(m, BlockBacked)]
    assert any(m.weight.is_meta for m in layers) and all(m.held_blocks is not None for m in layers)
    drop_blocks(served)
    assert all(m.held_blocks is None and not m.weight.is_meta for m in layers)
    exact_layers = [m for m in exact.modules() if isinstance(m, BlockBacked)]
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(layers, exact_layers, strict=True))
    tokens = prompts_of([12], 49152, seed=6)[0]
    for m in (served, exact):
        m.enable_native_step(False)
    (_, got), = capture(served, [tokens], [1])
    (_, want), = capture(exact, [tokens], [1])
    # torch's F.linear against the exact model's fp32 block kernel: the same values, summed in
    # another order
    torch.testing.assert_close(served.compute_logits(got), exact.compute_logits(want), atol=1e-3, rtol=1e-4)


# ---- on the GPU -------------------------------------------------------------------------------
@torch.inference_mode()
def hf_greedy_with_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, on the model's device."""
    dev = model.device
    out = model.generate(torch.tensor([prompt], device=dev), attention_mask=torch.ones(1, len(prompt),
                         dtype=torch.long, device=dev), do_sample=False, max_new_tokens=n, pad_token_id=0,
                         eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, toks)]
    return toks, lps


@needs_cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_match_transformers_on_cuda(arch, tiny_dirs):
    eng = Engine(tiny_dirs[arch], device="cuda", max_total_tokens=2048, page_size=4, chunked_prefill_size=16)
    runner = eng.scheduler.runner
    assert runner.device.type == "cuda"
    assert all(t.is_cuda for c in runner.kv_pool.components() for t in c.tensors)
    assert all(p.is_cuda for p in runner.model.parameters())
    hf = load_hf(tiny_dirs[arch]).to("cuda")
    prompts = prompts_of([3, 40, 9, 17, 1], hf.config.vocab_size, seed=1)   # 40: chunked prefill
    params = dict(GREEDY, return_logprob=True)
    for _ in range(2):                    # the second round hits the prefix cache
        out = eng.generate(input_ids=prompts, sampling_params=params)
        for p, r in zip(prompts, out):
            toks, lps = hf_greedy_with_logprobs(hf, p, GREEDY["max_new_tokens"])
            assert r["output_ids"] == toks
            got = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(lps, abs=1e-4)
    assert_no_kv_leak(eng.scheduler.cache)


@needs_cuda
def test_sampling_on_cuda_is_seeded_and_in_vocab(llama_dir):
    eng = Engine(llama_dir, device="cuda", max_total_tokens=2048)
    prompts = prompts_of([5, 12, 7], 320, seed=3)
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16, "ignore_eos": True,
              "sampling_seed": 11}
    a = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)]
    b = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)]
    assert a == b and all(len(x) == 16 and all(0 <= t < 320 for t in x) for x in a)
    c = [r["output_ids"] for r in eng.generate(input_ids=prompts,
                                                sampling_params=dict(params, sampling_seed=12))]
    assert c != a


@needs_cuda
def test_return_hidden_states_on_cuda_equal_transformers(llama_dir):
    eng = Engine(llama_dir, device="cuda", max_total_tokens=2048, disable_radix_cache=True,
                 enable_return_hidden_states=True)
    hf = load_hf(llama_dir).to("cuda")
    prompt = prompts_of([9], 320, seed=4)[0]
    r = eng.generate(input_ids=[prompt], sampling_params=dict(GREEDY, max_new_tokens=3),
                     return_hidden_states=True)[0]
    got = torch.as_tensor(r["meta_info"]["hidden_states"], dtype=torch.float32).cpu()
    with torch.inference_mode():
        ref = hf.model(torch.tensor([prompt + r["output_ids"][:-1]], device="cuda")
                       ).last_hidden_state[0].float().cpu()
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def cuda_dspark(tmp_path_factory):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device: run on a GPU machine")
    root = tmp_path_factory.mktemp("cuda_dspark")
    target = make_target(str(root / "target"), "llama")
    plain = Engine(target, device="cuda", max_total_tokens=4096, max_running_requests=8)
    prompts = prompts_of([1, 5, 17, 40, 9, 3], 256, seed=7)
    params = [dict(temperature=0, max_new_tokens=m) for m in (20, 1, 2, 25, 16, 18)]
    ref = [r["output_ids"] for r in plain.generate(input_ids=prompts, sampling_params=params)]
    bigram = [0] * 256                   # a draft that guesses the target's own continuations
    for p, o in zip(prompts, ref):
        seq = p[-1:] + o
        for a, b in zip(seq, seq[1:]):
            bigram[a] = b
    drafts = {"random": make_random_draft(target, str(root / "random")),
              "fitted": make_oracle_draft(target, str(root / "fitted"), bigram)}
    return target, drafts, prompts, params, ref


@needs_cuda
@pytest.mark.parametrize("mode", ["full", "adaptive"])
@pytest.mark.parametrize("draft", ["random", "fitted"])
def test_dspark_on_cuda_equals_plain_decoding(cuda_dspark, draft, mode):
    target, drafts, prompts, params, ref = cuda_dspark
    eng = Engine(target, device="cuda", max_total_tokens=4096, max_running_requests=8,
                 speculative_algorithm="DSPARK", speculative_draft_model_path=drafts[draft],
                 speculative_dspark_verify_mode=mode)
    spec = eng.scheduler.spec
    assert spec.device.type == "cuda" and all(p.is_cuda for p in spec.draft.parameters())
    out = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)]
    assert out == ref
    if mode == "full":           # adaptive may rightly verify nothing where drafting does not pay
        from sparkserve.core.forward_batch import ForwardMode
        assert eng.scheduler.forward_count[ForwardMode.VERIFY] > 0
        if draft == "fitted":
            assert max(eng.scheduler.accept_hist) >= 2, eng.scheduler.accept_hist
    assert_no_kv_leak(eng.scheduler.cache)
    sampled = [dict(p, temperature=0.9, sampling_seed=5) for p in params]
    got = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=sampled)]
    assert [len(g) for g in got] == [len(r) for r in ref]


@needs_cuda
def test_server_on_cuda_answers_as_the_engine(llama_dir):
    """`sparkserve serve --device cuda`: the scheduler process (spawned) runs on the GPU, and
    /generate returns the Engine's greedy tokens; /server_info names the device."""
    import httpx
    from server_harness import ServerProcess
    prompts = prompts_of([6, 21], 320, seed=5)
    want = [r["output_ids"] for r in Engine(llama_dir, device="cuda", max_total_tokens=2048)
            .generate(input_ids=prompts, sampling_params=GREEDY)]
    srv = ServerProcess("--model-path", llama_dir, "--device", "cuda", "--max-total-tokens", "2048")
    try:
        got = [httpx.post(srv.url + "/generate", json={"input_ids": p, "sampling_params": GREEDY},
                          timeout=120).json()["output_ids"] for p in prompts]
        info = httpx.get(srv.url + "/server_info", timeout=10).json()
    finally:
        srv.stop()
    assert got == want
    assert info["device"] == "cuda:0"
