"""Tools, reasoning and chat-template controls through the real HTTP app and the real `openai`
client, the model replaced by a scripted scheduler link: random weights never write a tool call,
so the link answers each sequence with the tokens of a scripted answer, one token per step, as a
model would. The answers go through the server's own detokenizer, parsers and SSE encoding; the
client's own stream accumulation (`chat.completions.stream`) must rebuild the non-streamed
message. Prompts are checked against transformers' rendering of the same Qwen2.5-style
template (tools, tool calls and tool results, continue_final_message, enable_thinking), given by
--chat-template. A running server (tiny model) is in test_chat_api_server.py."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient
from tiny_chat_fixtures import CHATML, make_tiny_chat_checkpoint

from sparkserve.args import ServerArgs
from sparkserve.core.finish_reason import FINISH_LENGTH, FINISH_MATCHED_TOKEN
from sparkserve.entrypoints.http_server import create_app
from sparkserve.entrypoints.metrics import Metrics
from sparkserve.entrypoints.tokenizer_manager import TokenizerManager
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.messages import BatchOut, GenerateReq, LoadReq, ReqOutput, SchedulerLoad, SchedulerReady

QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are helpful.{% endif %}

# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls | default([]) %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_ARGS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
TWO_CALLS = ("I will check both.\n" + "\n".join(
    f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in CALL_ARGS))
THINK_THEN_CALL = "<think>\nThe user wants the weather.\n</think>\n\n" + TWO_CALLS.split("\n", 1)[1]
USER = [{"role": "user", "content": "Weather in Paris, and the time?"}]


class ScriptedApp:
    """The HTTP app over a scheduler link that answers every sequence with `self.answer`'s tokens,
    one per step, then EOS (the stop token; or a length cut after the answer when `self.length_cut`)."""

    def __init__(self, path: str, **args):
        self.args = ServerArgs(model_path=path, served_model_name="tiny", **args).validate()
        self.tok = load_tokenizer_for(self.args)
        self.sent: list[GenerateReq] = []
        self.answer, self.length_cut = "", False
        ready = SchedulerReady(pid=0, vocab_size=self.tok.vocab_size, context_length=2048,
                               max_total_num_tokens=8192, max_running_requests=8, eos_token_ids=[],
                               architecture="LlamaForCausalLM")
        self.tm = TokenizerManager(self.args, self.tok, ready, self, None, Metrics("m"), lambda: None)
        self.http = TestClient(create_app(self.args, self.tm), raise_server_exceptions=False)
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=self.http,
                                    max_retries=0)

    def send_pyobj(self, msg, *a) -> None:
        if isinstance(msg, GenerateReq):
            self.sent.append(msg)
            ids = self.tok.encode(self.answer) + ([] if self.length_cut else [self.tok.eos_token_id])
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                end = (FINISH_LENGTH(k + 1) if self.length_cut else FINISH_MATCHED_TOKEN(t)) if last else None
                out = ReqOutput(msg.rid, [t], end, len(msg.input_ids), k + 1, 0)
                self.tm._on_batch(BatchOut([out], SchedulerLoad()))
        elif isinstance(msg, LoadReq):
            self.tm._calls[msg.cid].set_result(SchedulerLoad(cid=msg.cid))

    def say(self, answer: str, length_cut: bool = False) -> "ScriptedApp":
        self.answer, self.length_cut = answer, length_cut
        self.sent.clear()
        return self

    def prompt(self) -> str:
        return self.tok.decode(self.sent[0].input_ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    with open(f"{path}/tools.jinja", "w") as f:
        f.write(QWEN_TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def app(model_dir) -> ScriptedApp:
    return ScriptedApp(model_dir, chat_template=f"{model_dir}/tools.jinja", tool_call_parser="qwen25")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def reference(hf, messages, **kw) -> str:
    return hf.apply_chat_template(messages, chat_template=QWEN_TOOLS_TEMPLATE, tokenize=False, **kw)


def streamed(app: ScriptedApp, **kw):
    """The message the openai client's own stream accumulator rebuilds."""
    with app.client.chat.completions.stream(model="tiny", **kw) as s:
        for _ in s:
            pass
        return s.get_final_completion()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_parallel_tool_calls_whole_and_streamed(app, hf):
    app.say(TWO_CALLS)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME])
    assert app.prompt() == reference(hf, USER, tools=[WEATHER, TIME], add_generation_prompt=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == CALL_ARGS
    assert choice.message.content == "I will check both."
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    s = streamed(app, messages=USER, tools=[WEATHER, TIME]).choices[0]
    assert s.finish_reason == "tool_calls"
    assert calls_of(s.message) == CALL_ARGS
    assert [c.function.arguments for c in s.message.tool_calls] == \
        [c.function.arguments for c in choice.message.tool_calls]
    assert s.message.content.strip() == choice.message.content


def test_parallel_tool_calls_false_keeps_the_first(app):
    app.say(TWO_CALLS)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                           parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == CALL_ARGS[:1]
    s = streamed(app, messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False).choices[0]
    assert calls_of(s.message) == CALL_ARGS[:1] and s.finish_reason == "tool_calls"


def test_stream_chunks_carry_index_id_then_fragments(app):
    app.say(TWO_CALLS)
    chunks = list(app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                     stream=True))
    pieces = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    heads = [p for p in pieces if p.id]
    assert [(p.index, p.function.name) for p in heads] == [(0, "get_weather"), (1, "get_time")]
    assert sum(1 for p in pieces if p.index == 0 and not p.id and p.function.arguments) > 2
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_no_call_is_plain_content(app):
    text = "It is sunny in Paris; <tool_call> is how I would call a tool."
    app.say(text)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == \
        (text, None, "stop")
    s = streamed(app, messages=USER, tools=[WEATHER]).choices[0]
    assert (s.message.content, s.message.tool_calls, s.finish_reason) == (text, None, "stop")


def test_cut_call_is_content_with_length(app):
    app.say(TWO_CALLS[:60], length_cut=True)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (TWO_CALLS[:60], "length")


def test_tool_choice_none_renders_no_tools_and_parses_nothing(app, hf):
    app.say(TWO_CALLS)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="none")
    assert app.prompt() == reference(hf, USER, add_generation_prompt=True)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (TWO_CALLS, None)


def test_tool_results_fed_back(app, hf):
    """An assistant turn with tool_calls (arguments as the JSON strings OpenAI clients send) and
    the tool's results render as the template renders them from dicts."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(CALL_ARGS)]}
    results = [{"role": "tool", "tool_call_id": "call_0", "content": '{"sky": "clear"}'},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    app.say("Clear sky at noon.")
    r = app.client.chat.completions.create(model="tiny", messages=[*USER, turn, *results],
                                           tools=[WEATHER, TIME])
    ref_turn = {"role": "assistant", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(CALL_ARGS)]}
    assert app.prompt() == reference(hf, [*USER, ref_turn, *results], tools=[WEATHER, TIME],
                                     add_generation_prompt=True)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Clear sky at noon.", "stop")


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "nope"}}, "sometimes",
                                    {"type": "function"}, {"function": {"name": "get_weather"}}])
def test_bad_tool_choice_is_400(app, choice):
    app.say("x")
    with pytest.raises(openai.BadRequestError) as e:
        app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice)
    assert e.value.body["param"] == "tool_choice"
    assert not app.sent


NAMED = {"type": "function", "function": {"name": "get_weather"}}
REQUIRED_ANSWER = json.dumps([{"name": n, "parameters": a} for n, a in CALL_ARGS])


@pytest.mark.parametrize("choice, answer", [(NAMED, json.dumps(CALL_ARGS[0][1])),
                                            ("required", REQUIRED_ANSWER)])
def test_forced_tool_choice_is_a_grammar(app, hf, choice, answer):
    """required / a named function: the answer is constrained by a JSON schema made of the tools'
    (the grammar engine enforces it; test_chat_api_server runs it on a model), which the scripted
    answer must satisfy and a call of an unknown tool or bad arguments must not; the answer reads
    as calls, whole and streamed, whatever --tool-call-parser."""
    app.say(answer)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                           tool_choice=choice)
    assert app.prompt() == reference(hf, USER, tools=[WEATHER, TIME], add_generation_prompt=True)
    field, schema = app.sent[0].params.grammar
    assert field == "json_schema"
    jsonschema.validate(json.loads(answer), json.loads(schema))
    wrong = [{"name": "nope", "parameters": {}}] if choice == "required" else {"days": 3}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, json.loads(schema))
    want = CALL_ARGS[:1] if choice == NAMED else CALL_ARGS
    assert calls_of(r.choices[0].message) == want and r.choices[0].message.content is None
    assert r.choices[0].finish_reason == "tool_calls"
    s = streamed(app, messages=USER, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert calls_of(s.message) == want and s.finish_reason == "tool_calls"
    assert [c.function.arguments for c in s.message.tool_calls] == \
        [c.function.arguments for c in r.choices[0].message.tool_calls]


def test_forced_tool_choice_refusals(app):
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    for body, param in [({"tools": [bad_tool], "tool_choice": "required"}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": NAMED, "regex": "a+"}, "tool_choice")]:
        r = app.http.post("/v1/chat/completions", json={"messages": USER, **body})
        assert r.status_code == 400 and r.json()["param"] == param, r.text


def test_forced_tool_choice_needs_a_grammar_engine(model_dir):
    app = ScriptedApp(model_dir, grammar_backend="none")
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": NAMED}
    r = app.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["param"] == "tool_choice" and "grammar" in r.json()["message"]


def test_bad_tools_and_choice_without_tools_are_400(app):
    for kw, param in [({"tools": [{"type": "function"}]}, "tools"), ({"tools": [{"type": "web"}]}, "tools"),
                      ({"tool_choice": "auto"}, "tool_choice")]:
        r = app.http.post("/v1/chat/completions", json={"messages": USER, **kw})
        assert r.status_code == 400 and r.json()["param"] == param, r.text


def test_tools_without_a_parser_are_400(model_dir):
    plain = ScriptedApp(model_dir)
    r = plain.http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["param"] == "tools"
    assert "--tool-call-parser" in r.json()["message"]
    plain.say("fine")
    r = plain.http.post("/v1/chat/completions",
                        json={"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine"


def test_continue_final_message(app, hf):
    chat = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
    app.say(" sunny.")
    r = app.client.chat.completions.create(model="tiny", messages=chat, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    assert app.prompt() == reference(hf, chat, continue_final_message=True)
    assert not app.prompt().endswith("<|im_end|>\n")
    assert r.choices[0].message.content == " sunny."
    for body, param in [({"continue_final_message": True}, "continue_final_message"),
                        ({"continue_final_message": True, "add_generation_prompt": False,
                          "messages": USER}, "continue_final_message"),
                        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
                        ({"add_generation_prompt": "no"}, "add_generation_prompt")]:
        r = app.http.post("/v1/chat/completions", json={"messages": chat, **body})
        assert r.status_code == 400 and r.json()["param"] == param, r.text


def test_continue_final_message_whose_content_is_in_the_end_of_turn(model_dir, hf):
    """A last message ("end") that also appears in the template's end of turn (<|end|>), trimmed by
    the template: the prompt is the assistant turn opened (transformers' rendering) plus the
    content, not a cut inside <|end|> (where the content's last occurrence would put it)."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    app = ScriptedApp(model_dir, chat_template=template)
    app.say("ing.")
    chat = [*USER, {"role": "assistant", "content": " end "}]
    app.client.chat.completions.create(model="tiny", messages=chat, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    opened = hf.apply_chat_template(USER, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert app.prompt() == opened + "end"


def test_add_generation_prompt_false(app, hf):
    app.say("x")
    app.client.chat.completions.create(model="tiny", messages=USER,
                                       extra_body={"add_generation_prompt": False})
    assert app.prompt() == reference(hf, USER, add_generation_prompt=False)


@pytest.fixture(scope="module")
def thinking_app(model_dir) -> ScriptedApp:
    return ScriptedApp(model_dir, chat_template=QWEN_TOOLS_TEMPLATE, tool_call_parser="hermes",
                       reasoning_parser="qwen3")


def test_reasoning_then_calls(thinking_app):
    app = thinking_app.say(THINK_THEN_CALL)
    r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME])
    msg = r.model_dump()["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user wants the weather.\n"
    assert msg["content"] is None and r.choices[0].finish_reason == "tool_calls"
    assert calls_of(r.choices[0].message) == CALL_ARGS
    chunks = list(app.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME],
                                                     stream=True))
    deltas = [ch.delta.model_dump() for c in chunks for ch in c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    s = streamed(app, messages=USER, tools=[WEATHER, TIME]).choices[0]
    assert calls_of(s.message) == CALL_ARGS


def test_enable_thinking_false(thinking_app, hf):
    """enable_thinking reaches the template (which then closes an empty <think>) and the answer is
    not read for reasoning; separate_reasoning: false leaves thinking in the content."""
    app = thinking_app.say("<think>x</think>Sunny.")
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    r = app.client.chat.completions.create(model="tiny", messages=USER, extra_body=kw)
    assert app.prompt() == reference(hf, USER, add_generation_prompt=True, enable_thinking=False)
    msg = r.model_dump()["choices"][0]["message"]
    assert (msg["content"], msg.get("reasoning_content")) == ("<think>x</think>Sunny.", None)
    r = app.client.chat.completions.create(model="tiny", messages=USER)
    msg = r.model_dump()["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Sunny.", "x")
    r = app.client.chat.completions.create(model="tiny", messages=USER,
                                           extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == "<think>x</think>Sunny."


def test_llama3_markers_need_special_tokens(model_dir):
    """llama3's <|python_tag|> and end tokens are special tokens: the answer is detokenized with
    them, and the stop token's own text (here the tiny tokenizer's <|im_end|>) is not content."""
    app = ScriptedApp(model_dir, tool_call_parser="llama3")
    call = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}'      # then EOS, <|im_end|>
    for answer, content, calls in [(call, None, [("get_time", {"tz": "UTC"})]),
                                   ("Hello!", "Hello!", [])]:
        app.say(answer)
        r = app.client.chat.completions.create(model="tiny", messages=USER, tools=[TIME])
        assert app.sent[0].params.skip_special_tokens is False
        assert (r.choices[0].message.content, calls_of(r.choices[0].message)) == (content, calls)
        s = streamed(app, messages=USER, tools=[TIME]).choices[0]
        assert (s.message.content or None, calls_of(s.message)) == (content, calls)   # role chunk: ""
    app.say("Hello!")
    r = app.client.chat.completions.create(model="tiny", messages=USER)      # no tools: as asked
    assert app.sent[0].params.skip_special_tokens is True and r.choices[0].message.content == "Hello!"


def test_gpt_oss_reasoning_keeps_its_markers(model_dir):
    app = ScriptedApp(model_dir, reasoning_parser="gpt-oss")
    app.say("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.")
    r = app.client.chat.completions.create(model="tiny", messages=USER)
    assert app.sent[0].params.skip_special_tokens is False
    msg = r.model_dump()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Think.", "Sunny.")
    chunks = list(app.client.chat.completions.create(model="tiny", messages=USER, stream=True))
    deltas = [ch.delta.model_dump() for c in chunks for ch in c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Think."
    assert "".join(d.get("content") or "" for d in deltas) == "Sunny."


def test_deepseek_r1_template_opens_think(model_dir, hf):
    """A template that opens <think> itself (DeepSeek-R1's way): the answer's text before </think>
    (which arrives one byte per token here) is reasoning, whole and streamed."""
    opens = CHATML.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n")
    app = ScriptedApp(model_dir, chat_template=opens, reasoning_parser="deepseek-r1")
    app.say("The user greets.\n</think>\n\nHello!")
    r = app.client.chat.completions.create(model="tiny", messages=USER)
    assert app.prompt() == hf.apply_chat_template(USER, chat_template=opens, tokenize=False,
                                                  add_generation_prompt=True)
    assert app.prompt().endswith("<think>\n")
    msg = r.model_dump()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user greets.\n", "Hello!")
    chunks = list(app.client.chat.completions.create(model="tiny", messages=USER, stream=True))
    deltas = [ch.delta.model_dump() for c in chunks for ch in c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user greets.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 5          # streamed as it came


def test_bad_chat_template_flag(model_dir, tmp_path):
    with pytest.raises(ValueError, match="--chat-template"):
        ServerArgs(model_path=model_dir, chat_template=str(tmp_path / "missing.jinja")).validate()
    with pytest.raises(ValueError, match="--chat-template"):
        ScriptedApp(model_dir, chat_template="{% for %}")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerArgs(model_path=model_dir, tool_call_parser="nope").validate()


def test_tokenize_and_detokenize(app, hf):
    for body in [{"prompt": "Hello wörld"}, {"text": ["a", "bc"], "add_special_tokens": False}]:
        r = app.http.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        value = body.get("prompt", body.get("text"))
        want = hf(value, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        count = len(want) if isinstance(value, str) else [len(w) for w in want]
        assert r.json() == {"tokens": want, "count": count, "max_model_len": 2048}
    r = app.http.post("/v1/tokenize", json={"messages": USER, "tools": [WEATHER]})
    rendered = reference(hf, USER, tools=[WEATHER], add_generation_prompt=True)
    want = hf(rendered, add_special_tokens=False)["input_ids"]
    assert r.json()["tokens"] == want
    ids = hf("Hello wörld", add_special_tokens=False)["input_ids"]
    r = app.http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"text": hf.decode(ids)}
    for path, body, param in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "text": "b"}, "text"),
                              ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/tokenize", {"messages": USER, "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"), ("/detokenize", {}, "tokens")]:
        r = app.http.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["param"] == param, (path, body, r.text)
