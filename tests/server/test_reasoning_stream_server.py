"""SGLang's separate_reasoning and stream_reasoning on a running `sparkserve serve --reasoning-parser
deepseek-r1` (tiny random model whose tokenizer has `</think>` as an added token; a logit bias makes
it close its thinking): through the real `openai` client, the streamed reasoning_content and
content concatenate to the non-streamed message's; with stream_reasoning false the reasoning comes
in one delta, once whole (SGLang: buffered until `</think>`), before any content; with
separate_reasoning false the thinking stays in the content, `</think>` and all."""
from __future__ import annotations

import openai
import pytest
from server_harness import ServerProcess
from test_strict_tools_server import make_added_tokens_checkpoint

END_ID = 259                    # </think>
USER = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = make_added_tokens_checkpoint(str(tmp_path_factory.mktemp("tiny_think") / "llama"),
                                        ["<think>", "</think>"])
    s = ServerProcess("--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096",
                      "--reasoning-parser", "deepseek-r1")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    s.stop()
    s.remove_log()


def body(seed: int, **kw) -> dict:
    return dict(model="tiny", messages=USER, temperature=1, seed=seed, max_tokens=60,
                logit_bias={str(END_ID): 3}, **kw)


def streamed(client, seed: int, **extra) -> list[tuple[str, str]]:
    """The stream's (reasoning_content, content) delta of each chunk that has either."""
    out = []
    for chunk in client.chat.completions.create(**body(seed, stream=True, extra_body=extra)):
        if chunk.choices:
            d = chunk.choices[0].delta.model_dump()
            if d.get("reasoning_content") or d.get("content"):
                out.append((d.get("reasoning_content") or "", d.get("content") or ""))
    return out


def test_stream_reasoning_and_separate_reasoning(client):
    pieces = 0
    for seed in range(4):
        msg = client.chat.completions.create(**body(seed)).choices[0].message.model_dump()
        reasoning, content = msg["reasoning_content"], msg["content"]
        whole = client.chat.completions.create(**body(seed, extra_body={"separate_reasoning": False}))
        raw = whole.choices[0].message.model_dump()
        assert raw.get("reasoning_content") is None
        head, sep, tail = raw["content"].partition("</think>")
        assert (head.lstrip(), tail.lstrip()) == (reasoning, content if sep else "")
        live = streamed(client, seed)
        assert "".join(r for r, _ in live) == reasoning and "".join(c for _, c in live) == content
        held = streamed(client, seed, stream_reasoning=False)
        assert "".join(c for _, c in held) == content
        with_reasoning = [i for i, (r, _) in enumerate(held) if r]
        if reasoning:
            assert len(with_reasoning) == 1 and held[with_reasoning[0]][0] == reasoning
            assert not any(c for _, c in held[:with_reasoning[0]])     # nothing of the answer before it
            pieces += sum(1 for r, _ in live if r) > 1                   # (streamed live: in pieces)
    assert pieces >= 2


def test_response_format_applies_after_the_thinking(client):
    """SGLang's reasoning grammar: a response_format constrains the answer, not the thinking: the
    model thinks freely (here: until the biased </think>), then writes JSON valid by the schema (the
    grammar from the first token would have left no </think> at all: every answer all reasoning)."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    answered = 0
    for seed in range(4):
        choice = client.chat.completions.create(**body(seed, response_format=fmt)).choices[0]
        msg = choice.message.model_dump()
        if choice.finish_reason == "stop":
            answered += 1
            jsonschema.validate(json.loads(msg["content"]), schema)
            assert msg["reasoning_content"] is not None
    assert answered >= 2
