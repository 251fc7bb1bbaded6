"""Kimi-Linear (KDA + MLA + MoE) and MiniMax-M3 (block-sparse attention, lightning indexer,
index value) on CUDA: greedy tokens and logprobs equal transformers' on the same GPU (the index
value path, which transformers lacks, equals the CPU engine), and DSpark there, with the KDA
state's rollback, stays lossless. Until these pass on a GPU machine the two models keep cuda out
of their DEVICES (a start-up error names it), so the tests let it in for their own run."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_no_kv_leak
from dspark_fixtures import make_random_draft
from kimi_fixtures import CONFIGS as KIMI_CONFIGS
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from test_device import needs_cuda, prompts_of

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.layers.kda import KimiDeltaAttention
from sparkserve.models.kimi_linear import KimiLinearForCausalLM
from sparkserve.models.minimax_m3 import MiniMaxM3ForCausalLM

NEW = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True, "return_logprob": True}
PROMPT_LENGTHS = [3, 41, 9, 17]          # 41: chunked prefill, and the indexer drops blocks


@pytest.fixture(autouse=True)
def cuda_let_in(monkeypatch):
    for cls in (KimiLinearForCausalLM, MiniMaxM3ForCausalLM):
        monkeypatch.setattr(cls, "DEVICES", ("cpu", "cuda"))


def on_cuda(path: str, **kw) -> Engine:
    eng = Engine(path, device="cuda", max_total_tokens=2048, chunked_prefill_size=16, **kw)
    runner = eng.scheduler.runner
    assert runner.device.type == "cuda" and all(p.is_cuda for p in runner.model.parameters())
    assert all(t.is_cuda for c in runner.kv_pool.components() for t in c.tensors)
    return eng


def tokens_and_logprobs(eng: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    out = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    return [(r["output_ids"], [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]) for r in out]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation by full forwards (no cache: nothing of its decode path)."""
    ids, lps = list(prompt), []
    for _ in range(NEW):
        logp = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0, -1].float(), -1)
        ids.append(int(logp.argmax()))
        lps.append(logp[ids[-1]].item())
    return ids[len(prompt):], lps


def assert_same(got, want) -> None:
    for (toks, lps), (ref_toks, ref_lps) in zip(got, want):
        assert toks == ref_toks
        assert lps == pytest.approx(ref_lps, abs=1e-4)


def load_hf_cuda(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager") \
        .eval().requires_grad_(False).to("cuda")


@needs_cuda
@pytest.mark.parametrize("name", list(KIMI_CONFIGS))
def test_kimi_linear_on_cuda_matches_transformers(name, tmp_path):
    path = make_kimi(str(tmp_path / name), name)
    eng = on_cuda(path)
    prompts = prompts_of(PROMPT_LENGTHS, 256, seed=2)
    hf = load_hf_cuda(path)
    want = [hf_greedy(hf, p) for p in prompts]
    for _ in range(2):                   # the second round resumes from cached prefixes
        assert_same(tokens_and_logprobs(eng, prompts), want)
    assert_no_kv_leak(eng.scheduler.cache)


@needs_cuda
def test_minimax_m3_on_cuda_matches_transformers_and_the_cpu_index_value_path(tmp_path):
    path = make_minimax(str(tmp_path / "k_only"))
    prompts = prompts_of(PROMPT_LENGTHS, 256, seed=3)
    hf = load_hf_cuda(path)
    eng = on_cuda(path)
    assert_same(tokens_and_logprobs(eng, prompts), [hf_greedy(hf, p) for p in prompts])
    assert_no_kv_leak(eng.scheduler.cache)
    value = with_index_value(make_minimax(str(tmp_path / "value")))
    cpu = Engine(value, device="cpu", max_total_tokens=2048, chunked_prefill_size=16)
    assert_same(tokens_and_logprobs(on_cuda(value), prompts), tokens_and_logprobs(cpu, prompts))


@needs_cuda
@pytest.mark.parametrize("model,rollback", [("kimi", "replay"), ("kimi", "snapshot"), ("minimax", None)])
def test_dspark_on_cuda_stays_lossless_for_hybrid_models(model, rollback, tmp_path, monkeypatch):
    if rollback is not None:
        monkeypatch.setattr(KimiDeltaAttention, "rollback", rollback)
    path = (make_kimi(str(tmp_path / "t"), "kda_mla") if model == "kimi"
            else make_minimax(str(tmp_path / "t")))
    draft = make_random_draft(path, str(tmp_path / "draft"))
    prompts = prompts_of(PROMPT_LENGTHS, 256, seed=4)
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    ref = [r["output_ids"] for r in on_cuda(path).generate(input_ids=prompts, sampling_params=params)]
    eng = on_cuda(path, speculative_algorithm="DSPARK", speculative_draft_model_path=draft,
                  speculative_dspark_verify_mode="full")
    assert [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)] == ref
    assert eng.scheduler.forward_count[ForwardMode.VERIFY] > 0
    assert_no_kv_leak(eng.scheduler.cache)
