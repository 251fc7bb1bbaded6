"""Sampling parameters through the whole Engine: seeds, stop strings (cut text exactly, also when
streamed), stop token ids, length finish, parameter validation, context checks, and logprobs
equal to log_softmax of transformers' logits."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_no_kv_leak, hf_logits

from sparkserve import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama_engine(llama_dir) -> Engine:
    return Engine(llama_dir, max_total_tokens=1024, max_running_requests=8)


def test_seeded_sampling_is_reproducible(llama_engine):
    p = _prompt(9, 1)
    sp = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 20, "ignore_eos": True}
    a = llama_engine.generate(input_ids=p, sampling_params=dict(sp, seed=42))["output_ids"]
    # Same seed in a different batch position and with other traffic: same tokens.
    batch = llama_engine.generate(input_ids=[_prompt(5, 2), p, p],
                                  sampling_params=[dict(sp, seed=1), dict(sp, seed=42), dict(sp, seed=43)])
    assert batch[1]["output_ids"] == a
    c = llama_engine.generate(input_ids=p, sampling_params=dict(sp, seed=43))["output_ids"]
    assert batch[2]["output_ids"] == c
    assert c != a, "different seeds should give different samples"
    greedy = llama_engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=24))["output_ids"]
    assert a != greedy, "temperature 1 sampling should not collapse to greedy on this model"
    assert_no_kv_leak(llama_engine.scheduler.cache)


def test_unseeded_sampling_follows_global_seed(llama_dir):
    sp = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    p = _prompt(6, 3)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        e = Engine(llama_dir, max_total_tokens=256)
        runs.append(e.generate(input_ids=p, sampling_params=sp)["output_ids"])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_max_new_tokens_finishes_with_length(llama_engine):
    for n in (1, 5):
        r = llama_engine.generate(input_ids=_prompt(4, 4), sampling_params=dict(GREEDY, max_new_tokens=n))
        assert len(r["output_ids"]) == n
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert r["meta_info"]["completion_tokens"] == n
    r = llama_engine.generate(input_ids=_prompt(4, 4), sampling_params=dict(GREEDY, max_new_tokens=0))
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ids(llama_engine):
    p = _prompt(10, 5)
    full = llama_engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=20))["output_ids"]
    for pick in (0, 6, 13):
        tok = full[pick]
        first = full.index(tok)
        r = llama_engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=20,
                                                                    stop_token_ids=[tok]))
        assert r["output_ids"] == full[:first + 1]
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    # A stop id the model never produces changes nothing.
    unused = next(t for t in range(320) if t not in full)
    r = llama_engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=20,
                                                                stop_token_ids=[unused]))
    assert r["output_ids"] == full and r["meta_info"]["finish_reason"]["type"] == "length"
    assert_no_kv_leak(llama_engine.scheduler.cache)


@pytest.mark.parametrize("sp,name", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temprature": 0.5}, "temprature"),
    ({"stop_token_ids": [10_000]}, "stop_token_ids"),
])
def test_bad_sampling_params_raise_value_error(sp, name, llama_engine):
    with pytest.raises(ValueError, match=name):
        llama_engine.generate(input_ids=_prompt(4), sampling_params=sp)
    # Nothing was queued, and the engine still serves.
    assert not llama_engine.scheduler.has_work()
    r = llama_engine.generate(input_ids=_prompt(4), sampling_params=dict(GREEDY, max_new_tokens=2))
    assert len(r["output_ids"]) == 2
    assert_no_kv_leak(llama_engine.scheduler.cache)


def test_bad_param_in_a_batch_queues_nothing(llama_engine):
    with pytest.raises(ValueError, match="top_p"):
        llama_engine.generate(input_ids=[_prompt(4), _prompt(5)], sampling_params=[GREEDY, dict(GREEDY,
                                                                                                top_p=1.5)])
    assert not llama_engine.scheduler.has_work()


def test_input_too_long_for_context(llama_engine):
    ctx = llama_engine.context_length
    assert ctx == 256
    with pytest.raises(ValueError) as e:
        llama_engine.generate(input_ids=_prompt(250), sampling_params=dict(GREEDY, max_new_tokens=16))
    for number in ("250", "16", "266", "256"):
        assert number in str(e.value)
    with pytest.raises(ValueError, match="300"):
        llama_engine.generate(input_ids=_prompt(300), sampling_params=dict(GREEDY, max_new_tokens=1))
    # Exactly the context length is fine.
    r = llama_engine.generate(input_ids=_prompt(250), sampling_params=dict(GREEDY, max_new_tokens=6))
    assert len(r["output_ids"]) == 6
    assert not llama_engine.scheduler.has_work()


def test_input_too_long_for_kv_pool(llama_dir):
    e = Engine(llama_dir, max_total_tokens=64)
    with pytest.raises(ValueError) as err:
        e.generate(input_ids=_prompt(60), sampling_params=dict(GREEDY, max_new_tokens=10))
    assert "70" in str(err.value) and "64" in str(err.value)


def test_out_of_vocab_input_rejected(llama_engine):
    with pytest.raises(ValueError, match="320"):
        llama_engine.generate(input_ids=[1, 2, 320], sampling_params=GREEDY)


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_equal_transformers_log_softmax(sampled, llama_engine, hf_tiny):
    p = _prompt(11, 6)
    sp = dict(GREEDY, max_new_tokens=10, return_logprob=True, top_logprobs_num=3)
    if sampled:
        sp.update(temperature=0.9, top_k=50, seed=3)
    r = llama_engine.generate(input_ids=p, sampling_params=sp)
    out = r["output_ids"]
    # rows predicting out
    ref = torch.log_softmax(hf_logits(hf_tiny["llama"], p + out), dim=-1)[len(p) - 1:-1]
    lps = r["meta_info"]["output_token_logprobs"]
    assert [t for _, t in lps] == out
    got = torch.tensor([lp for lp, _ in lps])
    want = ref[torch.arange(len(out)), torch.tensor(out)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    tops = r["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(out)
    for row, top in zip(ref, tops):
        v, i = row.topk(3)
        assert [t for _, t in top] == i.tolist()
        assert torch.allclose(torch.tensor([x for x, _ in top]), v, atol=1e-4)
    if not sampled:
        assert all(row.argmax().item() == t for row, t in zip(ref, out))


# ---------------------------------------------------------------- stop strings (SmolLM2, real text)

STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def story(smollm2_engine) -> dict:
    return smollm2_engine.generate(messages=STORY, sampling_params={"temperature": 0, "max_new_tokens": 20,
                                                                    "ignore_eos": True})


def _stop_from(text: str, start: int, width: int) -> str:
    """A substring of the greedy output to use as a stop string (starting at a non-space)."""
    while start < len(text) and text[start].isspace():
        start += 1
    s = text[start:start + width]
    assert len(s) == width, f"cannot pick a stop from {text!r}"
    return s


@pytest.mark.parametrize("where,width", [(0.5, 4), (0.3, 1)])
def test_stop_string_cuts_text_exactly(where, width, smollm2_engine, story):
    text = story["text"]
    assert len(text) > 40, text
    stop = _stop_from(text, int(len(text) * where), width)
    expected = text[:text.find(stop)]
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True, "stop": [stop, "\u2603never\u2603"]}
    r = smollm2_engine.generate(messages=STORY, sampling_params=sp)
    assert r["text"] == expected
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Generation stopped at the token that completed the stop string, not later.
    n = len(r["output_ids"])
    assert r["output_ids"] == story["output_ids"][:n]
    tok = smollm2_engine.tokenizer
    assert stop in tok.decode(r["output_ids"]) and stop not in tok.decode(r["output_ids"][:-1])

    chunks = list(smollm2_engine.generate(messages=STORY, sampling_params=sp, stream=True))
    deltas = [c["text"] for c in chunks]
    assert "".join(deltas) == expected
    assert all(stop not in d for d in deltas)
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["finish_reason"]["matched"] == stop
    assert sum((c["output_ids"] for c in chunks), []) == r["output_ids"]
    assert_no_kv_leak(smollm2_engine.scheduler.cache)


def test_stream_without_stop_equals_non_streamed(smollm2_engine, story):
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    chunks = list(smollm2_engine.generate(messages=STORY, sampling_params=sp, stream=True))
    assert "".join(c["text"] for c in chunks) == story["text"]
    assert sum((c["output_ids"] for c in chunks), []) == story["output_ids"]


def test_no_stop_trim_keeps_stop_string(smollm2_engine, story):
    text = story["text"]
    stop = _stop_from(text, len(text) // 2, 3)
    r = smollm2_engine.generate(messages=STORY, sampling_params={
        "temperature": 0, "max_new_tokens": 20, "ignore_eos": True, "stop": stop, "no_stop_trim": True})
    assert r["text"].startswith(text[:text.find(stop) + len(stop)])
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
