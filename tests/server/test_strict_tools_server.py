"""Strict tools under tool_choice auto and SGLang's structural_tag on a running `sparkserve serve`
(tiny random model, its tokenizer given hermes' `<tool_call>` / `</tool_call>` as added tokens as
Qwen2.5's has). A logit bias makes the random model open calls; the grammar must then write each
call whole, its arguments valid under the tool's schema (checked with jsonschema through the real
`openai` client). The same requests with strict off write broken calls, so the checks can fail."""
from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest
from conftest import TINY_CONFIGS, make_tiny_checkpoint
from server_harness import ServerProcess
from tiny_chat_fixtures import CHATML, _bytes_to_unicode

CALL, CALL_END = "<tool_call>", "</tool_call>"
CALL_ID = 258                       # (make_added_tokens_checkpoint)
ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 5},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
USER = [{"role": "user", "content": "Weather?"}]
SEEDS = range(6)


def weather(strict: bool) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": ARGS, "strict": strict}}


def make_added_tokens_checkpoint(path: str, added: list[str]) -> str:
    """tiny_chat_fixtures' byte-level tiny chat model with `added` as ordinary added tokens (ids
    258 on, after the two ChatML markers), as Qwen2.5's `<tool_call>` or `<think>` are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    make_tiny_checkpoint("llama", path)
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(added)
    tok.add_tokens([f"<x{i}>" for i in range(TINY_CONFIGS["llama"]["vocab_size"] - tok.get_vocab_size())])
    assert [tok.token_to_id(t) for t in added] == list(range(258, 258 + len(added)))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "add_bos_token": False}, f)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_added_tokens_checkpoint(str(tmp_path_factory.mktemp("tiny_tools") / "llama"),
                                        [CALL, CALL_END])
    s = ServerProcess("--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096",
                      "--tool-call-parser", "hermes")
    yield s
    s.stop()
    s.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def ask(client, strict: bool, seed: int, bias: float = 6, **kw):
    return client.chat.completions.create(
        model="tiny", messages=USER, tools=[weather(strict)], temperature=1, seed=seed, max_tokens=200,
        logit_bias={str(CALL_ID): bias}, **kw)


def test_strict_auto_calls_follow_the_schema(client):
    """parallel_tool_calls false: the answer ends after its first call (SGLang's stop_after_first)."""
    called = 0
    for seed in SEEDS:
        choice = ask(client, True, seed, parallel_tool_calls=False).choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "length":
            continue                                            # cut inside a call: content
        assert CALL not in (choice.message.content or "")      # every call opened was written whole
        if calls:
            called += 1
            assert choice.finish_reason == "tool_calls" and len(calls) == 1
            assert calls[0].function.name == "get_weather"
            jsonschema.validate(json.loads(calls[0].function.arguments), ARGS)
    assert called >= 3
    # the control: the same requests, strict off, open calls the random model never finishes
    loose = [ask(client, False, seed, parallel_tool_calls=False).choices[0] for seed in SEEDS]
    assert sum(CALL in (c.message.content or "") for c in loose) >= 3
    assert not any(c.message.tool_calls for c in loose)


def test_strict_auto_parallel_calls_and_text(client):
    """Parallel calls are allowed; text around them stays text; whatever the model opened before
    max_tokens cut it is complete (a cut call is content, as a malformed one)."""
    whole = 0
    for seed in SEEDS:
        r = client.chat.completions.create(
            model="tiny", messages=USER, tools=[weather(True)], temperature=1, seed=seed, max_tokens=200,
            logit_bias={str(CALL_ID): 4, "257": 3})      # 257: <|im_end|>, so some answers end
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            whole += 1
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), ARGS)
    assert whole >= 2


def test_strict_auto_stream_equals_full(client):
    full = ask(client, True, 1, parallel_tool_calls=False).choices[0]
    assert full.message.tool_calls
    with client.chat.completions.stream(model="tiny", messages=USER, tools=[weather(True)], temperature=1,
                                        seed=1, max_tokens=200, logit_bias={str(CALL_ID): 6},
                                        parallel_tool_calls=False) as s:
        streamed = s.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in full.message.tool_calls]


def tags_of(text: str, begin: str, end: str, finished: bool = True) -> list:
    """The JSON values of every `begin ... end` in text (the reference reading of a structural tag:
    each `<tool_call>` must open a whole tag, but the last one of an answer max_tokens cut);
    raises where one is broken."""
    out, pos, dec = [], 0, json.JSONDecoder()
    while (i := text.find(CALL, pos)) >= 0:
        try:
            assert text.startswith(begin, i) or (len(text) - i < len(begin) and begin.startswith(text[i:]))
            value, j = dec.raw_decode(text, i + len(begin))
            assert text.startswith(end, j) or (len(text) - j < len(end) and end.startswith(text[j:]))
        except (AssertionError, ValueError):
            if finished or text.find(CALL, i + 1) >= 0:
                raise AssertionError(f"a broken tag: {text[i:]!r}") from None
            break                       # the cut one
        if not text.startswith(end, j):
            break
        out.append(value)
        pos = j + len(end)
    return out


LEGACY = {"type": "structural_tag", "triggers": [CALL],
          "structures": [{"begin": CALL + "A=", "schema": ARGS, "end": CALL_END}]}
XGRAMMAR = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": [CALL], "stop_after_first": True, "at_least_one": True,
    "tags": [{"type": "tag", "begin": CALL + "B=", "end": CALL_END,
              "content": {"type": "json_schema", "json_schema": ARGS}}]}}


def test_structural_tag_generate_and_response_format(server, client):
    sp = {"temperature": 1, "max_new_tokens": 160, "logit_bias": {str(CALL_ID): 5},
          "structural_tag": json.dumps(LEGACY)}
    found = 0
    for seed in SEEDS:
        r = httpx.post(server.url + "/generate", json={"text": "q", "sampling_params": {**sp, "seed": seed}},
                       timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        stopped = out["meta_info"]["finish_reason"]["type"] == "stop"
        for value in tags_of(out["text"], CALL + "A=", CALL_END, stopped):
            jsonschema.validate(value, ARGS)
            found += 1
    assert found >= 3
    # xgrammar's format through the openai client: at least one tag, and nothing after the first
    ended = 0
    for seed in SEEDS[:4]:
        choice = client.chat.completions.create(model="tiny", messages=USER, response_format=XGRAMMAR,
                                                temperature=1, seed=seed, max_tokens=200,
                                                logit_bias={str(CALL_ID): 5}).choices[0]
        text, stopped = choice.message.content, choice.finish_reason == "stop"
        values = tags_of(text, CALL + "B=", CALL_END, stopped)
        if stopped:
            ended += 1
            assert len(values) == 1 and text.endswith(CALL_END)
            jsonschema.validate(values[0], ARGS)
    assert ended >= 2


@pytest.mark.parametrize("tag,field", [
    ({"type": "structural_tag", "triggers": ["<x>"], "structures": [{"begin": "<y>", "end": ""}]},
     "structural_tag"),
    ({"type": "structural_tag", "triggers": [CALL], "structures": [{"begin": CALL, "schema": {"type": "nope"},
                                                                    "end": ""}]}, "structural_tag"),
    ({"type": "structural_tag", "format": {"type": "qwen_xml_parameter"}}, "structural_tag")])
def test_bad_structural_tag_is_400(server, client, tag, field):
    r = httpx.post(server.url + "/generate", timeout=60,
                   json={"text": "q", "sampling_params": {"structural_tag": json.dumps(tag)}})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, response_format=tag, max_tokens=4)
    assert "response_format" in str(e.value)
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices


ANSWER = {"type": "object", "additionalProperties": False, "required": ["ok"],
          "properties": {"ok": {"type": "boolean"}}}


def test_strict_tools_with_response_format(client):
    """response_format beside strict tools (as agent frameworks send an output type with their
    tools): each answer is either the format's JSON or calls that validate."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    kinds = set()
    for seed in SEEDS:
        choice = ask(client, True, seed, 1, parallel_tool_calls=False, response_format=fmt).choices[0]
        if choice.finish_reason == "length":
            continue
        if choice.message.tool_calls:
            kinds.add("calls")
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), ARGS)
        else:
            kinds.add("json")
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
    assert kinds == {"calls", "json"}
    with pytest.raises(openai.BadRequestError) as e:          # a regex has no such combination
        client.chat.completions.create(model="tiny", messages=USER, tools=[weather(True)], max_tokens=4,
                                       extra_body={"regex": "[a-z]+"})
    assert "tools" in str(e.value)
