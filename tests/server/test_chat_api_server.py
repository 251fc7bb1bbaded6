"""The chat controls on a running `sparkserve serve` (tiny random model, --chat-template file,
--tool-call-parser, --reasoning-parser) through the real `openai` client: with tools offered, an
answer that makes no call streams to exactly the non-streamed answer, which equals what /generate
writes for the prompt /tokenize renders (greedy); tool_choice the server cannot honour is a 400 and
the server keeps serving. The calls themselves, streamed and whole, are in test_chat_tools.py
(random weights never write one)."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import EXACT_FLAGS
from server_harness import ServerProcess
from test_chat_tools import QWEN_TOOLS_TEMPLATE
from tiny_chat_fixtures import make_tiny_chat_checkpoint

MAX_TOKENS = 12
USER = [{"role": "user", "content": "Hi"}]         # the tiny model's context is 256 (byte) tokens
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    with open(f"{path}/tools.jinja", "w") as f:
        f.write(QWEN_TOOLS_TEMPLATE)
    s = ServerProcess("--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096",
                      "--chat-template", f"{path}/tools.jinja", "--tool-call-parser", "qwen25",
                      "--reasoning-parser", "qwen3", *EXACT_FLAGS)
    yield s
    s.stop()
    s.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_no_call_answer_equals_generate(server, client):
    kw = {"model": "tiny", "messages": USER, "tools": [TOOL], "max_tokens": MAX_TOKENS,
          "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert whole.choices[0].message.tool_calls is None
    assert streamed == whole.choices[0].message.content
    prompt = httpx.post(server.url + "/tokenize", json={"messages": USER, "tools": [TOOL]}).json()
    assert prompt["count"] == whole.usage.prompt_tokens
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    gen = httpx.post(server.url + "/generate", json={"input_ids": prompt["tokens"],
                                                     "sampling_params": params}).json()
    assert gen["text"] == whole.choices[0].message.content
    detok = httpx.post(server.url + "/detokenize", json={"tokens": prompt["tokens"],
                                                         "skip_special_tokens": False}).json()
    assert detok["text"].endswith("<|im_start|>assistant\n") and "\"f\"" in detok["text"]


def test_unhonoured_tool_choice_is_400_and_serving_goes_on(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, tools=[TOOL], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
