"""Strict tools under tool_choice auto on a gpt-oss (harmony) server (--tool-call-parser gpt-oss):
a harmony call ends on <|call|>, which gpt-oss counts as EOS (a grammar cannot end a call on one),
between calls come channels of special tokens, so the server cannot enforce them and says so: a
400 naming tools.N.function.strict and the reason, through the real openai client, on chat and on
/v1/responses, before anything is queued. The same tool under tool_choice required (a JSON grammar
any model can follow) or with strict false is served. A scheduler link that answers one token
stands in for the scheduler."""
from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from sparkserve.args import ServerArgs
from sparkserve.core.finish_reason import FINISH_LENGTH
from sparkserve.entrypoints.http_server import create_app
from sparkserve.entrypoints.metrics import Metrics
from sparkserve.entrypoints.tokenizer_manager import TokenizerManager
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.messages import BatchOut, GenerateReq, ReqOutput, SchedulerLoad, SchedulerReady


def weather(strict: bool) -> dict:
    return {"type": "function", "function": {
        "name": "get_weather", "strict": strict,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}}


class OneTokenLink:
    def __init__(self) -> None:
        args = ServerArgs(tool_call_parser="gpt-oss").validate()
        ready = SchedulerReady(pid=0, vocab_size=49152, context_length=512, max_total_num_tokens=2048,
                               max_running_requests=8, eos_token_ids=[2], architecture="LlamaForCausalLM")
        self.tm = TokenizerManager(args, load_tokenizer_for(args), ready, self, None, Metrics("m"),
                                   lambda: None)
        self.http = TestClient(create_app(args, self.tm), raise_server_exceptions=False)
        self.sent: list[GenerateReq] = []

    def send_pyobj(self, msg, *a) -> None:
        if isinstance(msg, GenerateReq):
            self.sent.append(msg)
            out = ReqOutput(msg.rid, [7], FINISH_LENGTH(1), len(msg.input_ids), 1, 0)
            self.tm._on_batch(BatchOut([out], SchedulerLoad()))


@pytest.fixture(scope="module")
def link() -> OneTokenLink:
    return OneTokenLink()


@pytest.fixture(scope="module")
def client(link) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=link.http, max_retries=0)


MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def test_strict_tools_under_auto_are_refused_naming_the_field(link, client):
    link.sent.clear()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=[weather(False), weather(True)],
                                       max_tokens=4)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "tools", err
    assert err["message"].startswith("tools.1.function.strict: --tool-call-parser gpt-oss"), err
    assert "<|call|>" in err["message"] and "EOS" in err["message"] and "strict: false" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=4,
                                tools=[{"type": "function", "name": "get_weather", "strict": True,
                                        "parameters": weather(True)["function"]["parameters"]}])
    assert e.value.status_code == 400 and "function.strict" in e.value.body["message"], e.value.body
    assert not link.sent                                 # nothing reached the scheduler


def test_the_same_tool_is_served_when_it_can_be_honoured(link, client):
    link.sent.clear()
    client.chat.completions.create(model=MODEL, messages=MSGS, tools=[weather(True)], tool_choice="required",
                                   max_tokens=4)
    assert link.sent[-1].params.json_schema is not None      # the calls' grammar, any model
    client.chat.completions.create(model=MODEL, messages=MSGS, tools=[weather(False)], max_tokens=4)
    assert link.sent[-1].params.structural_tag is None and link.sent[-1].params.json_schema is None
