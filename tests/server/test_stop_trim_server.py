"""Two things SGLang and vLLM do that a client sees (tiny random chat model on a running server):
the stop token that ends an answer (EOS or a stop_token_ids entry) is not part of its text even
with skip_special_tokens false, unless no_stop_trim (text checked against the tokenizer's own
decode of the output ids); an assistant turn of only tool_calls (`content: null`) renders through
SmolLM2's chat template, which cannot take a null content, as content "" (checked against
transformers' rendering)."""
from __future__ import annotations

import os
import re

import httpx
import openai
import pytest
from server_harness import ServerProcess
from tiny_chat_fixtures import make_tiny_chat_checkpoint
from tokenizers import Tokenizer

from sparkserve.embedded import default_model_path
from sparkserve.frontend.tokenizer import load_tokenizer

EOS = 257                       # <|im_end|>
A = 97                          # the byte "a"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    with open(os.path.join(path, "smollm2.jinja"), "w") as f:
        f.write(load_tokenizer(default_model_path()).chat_templates["default"])
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProcess("--model-path", model_dir, "--served-model-name", "tiny", "--max-total-tokens", "4096",
                      "--chat-template", os.path.join(model_dir, "smollm2.jinja"))
    yield s
    s.stop()
    s.remove_log()


def generate(server, **sp) -> dict:
    r = httpx.post(server.url + "/generate", timeout=120, json={"text": "q", "sampling_params": {
        "temperature": 1, "max_new_tokens": 40, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


def test_matched_stop_token_is_trimmed(server, model_dir):
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ended = 0
    for seed in range(4):
        for sp, stop in [({"logit_bias": {str(EOS): 4}}, EOS),
                         ({"logit_bias": {str(A): 4}, "stop_token_ids": [A]}, A)]:
            sp = {**sp, "seed": seed, "skip_special_tokens": False}
            out = generate(server, **sp)
            ids, reason = out["output_ids"], out["meta_info"]["finish_reason"]
            if reason.get("matched") != stop:
                continue
            ended += 1
            assert ids[-1] == stop
            assert out["text"] == tok.decode(ids[:-1], skip_special_tokens=False)
            kept = generate(server, **sp, no_stop_trim=True)
            assert kept["output_ids"] == ids and kept["text"] == tok.decode(ids, skip_special_tokens=False)
    assert ended >= 4
    # a complete grammar ends the answer on its own last token: that one is the answer's
    for skip in (True, False):
        out = generate(server, regex="[a-z]{3}", seed=1, skip_special_tokens=skip)
        assert out["meta_info"]["finish_reason"]["matched"] == out["output_ids"][-1]
        assert re.fullmatch("[a-z]{3}", out["text"]), out["text"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    for seed in range(3):
        sp = {"seed": seed, "skip_special_tokens": False, "logit_bias": {str(EOS): 4}}
        ref = generate(server, **sp)
        c = client.completions.create(model="tiny", prompt="q", max_tokens=40, temperature=1, seed=seed,
                                      logit_bias={str(EOS): 4}, extra_body={"skip_special_tokens": False})
        assert c.choices[0].text == ref["text"]
        if c.choices[0].finish_reason == "stop":
            assert not c.choices[0].text.endswith("<|im_end|>")


def test_assistant_tool_calls_with_null_content(server, model_dir):
    from transformers import PreTrainedTokenizerFast
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "Time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "smollm2.jinja")) as f:
        template = f.read()
    with pytest.raises(Exception):          # the template itself cannot take it
        hf.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)
    filled = [{**m, "content": m["content"] or ""} for m in msgs]
    want = hf.apply_chat_template(filled, chat_template=template, tokenize=False, add_generation_prompt=True)
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == hf.encode(want, add_special_tokens=False)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3)
    assert out.usage.prompt_tokens == len(r.json()["tokens"])
    # a message the template refuses for another reason is still a 400 naming messages
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user"}], max_tokens=3)
    assert "messages" in str(e.value)
