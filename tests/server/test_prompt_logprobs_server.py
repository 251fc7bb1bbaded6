"""Prompt logprobs over HTTP on the embedded SmolLM2 (exact path, chunked prefill of 8 tokens, a
warm prefix cache): the real `openai` client's completions with echo (lm-eval's loglikelihood:
echo=True, logprobs=2, max_tokens=0), echo with a completion, n > 1 and streaming (the echoed
prompt first), and SGLang's /generate with logprob_start_len in the middle; every prompt logprob
equals transformers' log-softmax of the prompt."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import EXACT_FLAGS, hf_logits
from server_harness import ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog because it"
TOL = 2e-3
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = ServerProcess("--model-path", smollm2_path, "--max-total-tokens", "4096",
                        "--chunked-prefill-size", "8", *EXACT_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompt_ids) -> torch.Tensor:
    """Row i: transformers' log-distribution of prompt token i + 1."""
    return torch.log_softmax(hf_logits(smollm2_hf, prompt_ids)[:-1], -1)


def check_echo_logprobs(lp, prompt_ids, reference, server) -> None:
    n = len(prompt_ids)
    pieces = [httpx.post(server.url + "/detokenize", json={"tokens": [t], "skip_special_tokens": False},
                         timeout=60).json()["text"] for t in prompt_ids]
    assert lp.tokens[:n] == pieces
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(reference[i - 1, prompt_ids[i]].item(), abs=TOL)
        vals, ids = reference[i - 1].topk(2)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(vals.tolist(), abs=TOL)
    assert lp.text_offset[:n] == [sum(len(p) for p in pieces[:i]) for i in range(n)]


def test_echo_loglikelihood_with_warm_cache(client, server, prompt_ids, reference):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)   # warms the cache
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    check_echo_logprobs(choice.logprobs, prompt_ids, reference, server)
    # token-id prompts echo their text too
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=2, max_tokens=0)
    assert by_ids.choices[0].text == PROMPT
    got = by_ids.choices[0].logprobs.token_logprobs
    assert got == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)


def test_echo_with_completion_and_n(client, server, prompt_ids, reference):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                    echo=True, n=2)
    n = len(prompt_ids)
    for choice in out.choices:
        assert choice.text == PROMPT + plain.choices[0].text
        check_echo_logprobs(choice.logprobs, prompt_ids, reference, server)
        assert choice.logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
        assert choice.logprobs.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                   abs=1e-5)
        offsets = plain.choices[0].logprobs.text_offset
        assert choice.logprobs.text_offset[n:] == [len(PROMPT) + o for o in offsets]
    no_lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert no_lp.choices[0].text == PROMPT + plain.choices[0].text and no_lp.choices[0].logprobs is None


def test_streamed_echo_comes_first(client, server, prompt_ids, reference):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                     echo=True, n=2)
    firsts: dict[int, object] = {}
    texts = {0: "", 1: ""}
    lps: dict[int, list] = {0: [], 1: []}
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True, n=2, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
            texts[c.index] += c.text
            lps[c.index] += c.logprobs.token_logprobs if c.logprobs else []
    for i in (0, 1):
        assert firsts[i].text == PROMPT
        check_echo_logprobs(firsts[i].logprobs, prompt_ids, reference, server)
        assert texts[i] == full.choices[i].text
        assert lps[i] == pytest.approx(full.choices[i].logprobs.token_logprobs, abs=1e-5)


def test_generate_logprob_start_len(server, prompt_ids, reference):
    start = 5
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}
    meta = httpx.post(server.url + "/generate", json=body, timeout=120).json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt_ids[start:]
    for pos, (lp, tok, text) in enumerate(got, start):
        assert lp == pytest.approx(reference[pos - 1, tok].item(), abs=TOL)
        assert isinstance(text, str)
    assert [[t for _, t, _ in top] for top in meta["input_top_logprobs"]] == \
        [reference[pos - 1].topk(2).indices.tolist() for pos in range(start, len(prompt_ids))]
    assert len(meta["output_token_logprobs"]) == 2
    whole = httpx.post(server.url + "/generate", json=dict(body, logprob_start_len=0), timeout=120).json()
    assert whole["meta_info"]["input_token_logprobs"][0][0] is None
    assert whole["meta_info"]["input_top_logprobs"][0] is None
    bad = httpx.post(server.url + "/generate", json=dict(body, return_logprob=False), timeout=60)
    assert bad.status_code == 400 and "logprob_start_len" in bad.text
    bad = httpx.post(server.url + "/generate", json=dict(body, logprob_start_len=len(prompt_ids)), timeout=60)
    assert bad.status_code == 400 and "logprob_start_len" in bad.text
