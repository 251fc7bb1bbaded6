"""Tool-call and reasoning parsers on canned model outputs, one format at a time: the calls come
back as the objects written into the text (json.loads of the arguments equals the dict the text
was made from), text outside them is the content, malformed calls leave the whole text as content.
Streaming feeds the same text in random chunk sizes (tags split anywhere) and the reassembled
deltas must equal the whole-text parse; arguments must stream before the end, not all at once."""
from __future__ import annotations

import json
import random

import pytest

from sparkserve.args import REASONING_PARSERS as REASONING_NAMES
from sparkserve.args import TOOL_CALL_PARSERS
from sparkserve.frontend.chat_output import ChatOutputParser
from sparkserve.frontend.reasoning_parser import REASONING_PARSERS
from sparkserve.frontend.tool_parsers import TOOL_PARSERS

CALLS = [("get_weather", {"city": "Paris \"centre\" }]", "days": [1, 22, 333], "unit": None,
                          "deep": {"ok": True, "ratio": 0.25, "empty": {}, "list": []}}),
         ("get_time", {}),
         ("search", {"q": "caf\u00e9 \u2603 {not json", "n": -12})]


def hermes(calls, before="", between="\n"):
    blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls]
    return before + between.join(blocks)


def llama3(calls, before=""):
    return before + "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def mistral(calls, before=""):
    return before + "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def deepseekv3(calls, before=""):
    blocks = [f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```"
              "<｜tool▁call▁end｜>" for n, a in calls]
    return before + "<｜tool▁calls▁begin｜>" + "\n".join(blocks) + "<｜tool▁calls▁end｜>"


def deepseekv31(calls, before=""):
    blocks = [f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls]
    return before + "<｜tool▁calls▁begin｜>" + "".join(blocks) + "<｜tool▁calls▁end｜>"


def gpt_oss(calls, before=""):
    return before + "".join(f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
                            f"{json.dumps(a)}<|call|>" for n, a in calls)


WRITERS = {"hermes": hermes, "qwen25": hermes, "llama3": llama3, "mistral": mistral, "deepseekv3": deepseekv3,
           "deepseekv31": deepseekv31, "gpt-oss": gpt_oss}


def test_names_agree_with_the_flags():
    assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS)
    assert set(REASONING_PARSERS) == set(REASONING_NAMES)


def stream(parser: ChatOutputParser, text: str, seed: int) -> tuple[list[dict], dict]:
    """Feed `text` in random chunks of 1-6 characters; returns the deltas and their reassembly."""
    rng, st, pos, deltas = random.Random(seed), parser.stream(), 0, []
    while pos < len(text):
        k = rng.randint(1, 6)
        deltas.append(st.feed(text[pos:pos + k], final=False))
        pos += k
    deltas.append(st.feed("", final=True))
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls and c["id"].startswith("call_") and c["type"] == "function"
                calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
            calls[c["index"]]["arguments"] += c["function"].get("arguments", "")
    return deltas, {"content": "".join(d.get("content", "") for d in deltas),
                    "reasoning": "".join(d.get("reasoning_content", "") for d in deltas),
                    "calls": [calls[i] for i in sorted(calls)], "made_calls": st.made_calls}


def check_stream_equals_whole(parser: ChatOutputParser, text: str, seeds=range(12)) -> None:
    whole = parser.parse(text)
    for seed in seeds:
        _, got = stream(parser, text, seed)
        assert (got["content"].strip() or None) == (whole.content.strip() or None if whole.content else None)
        assert (got["reasoning"] or None) == whole.reasoning
        assert got["calls"] == [{"name": c.name, "arguments": c.arguments} for c in whole.calls]
        assert got["made_calls"] == bool(whole.calls)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("count", [1, 3])
def test_calls_parse_to_what_was_written(name, count):
    parser = ChatOutputParser(None, TOOL_PARSERS[name]())
    text = WRITERS[name](CALLS[:count], before="Let me look that up. ")
    out = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS[:count]
    assert out.content == "Let me look that up."
    check_stream_equals_whole(parser, text)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_arguments_stream_before_the_end(name):
    parser = ChatOutputParser(None, TOOL_PARSERS[name]())
    deltas, got = stream(parser, WRITERS[name](CALLS[:1]), seed=0)
    pieces = [c for d in deltas[:-1] for c in d.get("tool_calls", []) if c["function"].get("arguments")]
    assert len(pieces) > 3, "arguments arrived in one piece at the end"
    assert json.loads(got["calls"][0]["arguments"]) == CALLS[0][1]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_answers_and_malformed_calls_are_content(name):
    parser = ChatOutputParser(None, TOOL_PARSERS[name]())
    for text in ["The weather in Paris is mild, about 18 C.", "Use <tool or [TOOL or <|python",
                 "a { brace that is no call"]:
        out = parser.parse(text)
        assert (out.content, out.calls) == (text, [])
        check_stream_equals_whole(parser, text)
    good = WRITERS[name](CALLS[:1])
    cut = good[:good.rindex("}") - 1]                     # inside the arguments (a max_tokens cut)
    bads = [good.replace("{", "{{", 2), cut] + ([good.replace('"name"', '"nam"')] if '"name"' in good else [])
    for bad in bads:
        out = parser.parse(bad)
        assert (out.content, out.calls) == (bad, []), bad


def test_llama3_call_without_the_tag():
    parser = ChatOutputParser(None, TOOL_PARSERS["llama3"]())
    text = json.dumps({"name": "get_time", "parameters": {"tz": "UTC"}})
    out = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_time", {"tz": "UTC"})]
    assert out.content is None
    check_stream_equals_whole(parser, text)
    plain = '{"answer": 42}'                                 # JSON that is no call: content
    assert parser.parse(plain).calls == [] and parser.parse(plain).content == plain
    check_stream_equals_whole(parser, plain)


THOUGHT = "The user wants Paris.\nI should call </thin the tool."


@pytest.mark.parametrize("opened", [True, False])
def test_deepseek_r1_reasoning(opened):
    """deepseek-r1's template opens <think>: what precedes </think> is reasoning, with or without
    the model writing <think> again."""
    parser = ChatOutputParser(REASONING_PARSERS["deepseek-r1"], None)
    text = ("" if opened else "<think>\n") + THOUGHT + "\n</think>\n\nIt is sunny."
    out = parser.parse(text)
    assert (out.reasoning, out.content) == (THOUGHT + "\n", "It is sunny.")
    check_stream_equals_whole(parser, text)
    cut = "<think>" + THOUGHT                     # cut before </think> (max_tokens): all reasoning
    assert (parser.parse(cut).reasoning, parser.parse(cut).content) == (THOUGHT, "")
    check_stream_equals_whole(parser, cut)


def test_qwen3_reasons_only_after_think():
    parser = ChatOutputParser(REASONING_PARSERS["qwen3"], None)
    text = "<think>\n" + THOUGHT + "</think>\n\nSunny."
    out = parser.parse(text)
    assert (out.reasoning, out.content) == (THOUGHT, "Sunny.")
    check_stream_equals_whole(parser, text)
    plain = "No thinking here </think> at all"
    out = parser.parse(plain)
    assert (out.reasoning, out.content) == (None, plain)
    check_stream_equals_whole(parser, plain)


def test_reasoning_then_tool_calls():
    parser = ChatOutputParser(REASONING_PARSERS["qwen3"], TOOL_PARSERS["qwen25"]())
    text = "<think>I need two tools: <tool_call> is how.</think>\n\n" + hermes(CALLS[:2], before="On it.\n")
    out = parser.parse(text)
    assert out.reasoning == "I need two tools: <tool_call> is how."
    assert out.content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS[:2]
    check_stream_equals_whole(parser, text)


def test_gpt_oss_channels():
    """harmony: the analysis channel is reasoning, final (and commentary) content; whole, streamed,
    cut inside the thinking, and an answer with no channel at all."""
    parser = ChatOutputParser(REASONING_PARSERS["gpt-oss"], None)
    text = ("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant<|channel|>final"
            "<|message|>It is sunny.<|return|>")
    out = parser.parse(text)
    assert (out.reasoning, out.content) == (THOUGHT, "It is sunny.")
    check_stream_equals_whole(parser, text)
    cut = "<|channel|>analysis<|message|>" + THOUGHT[:20]
    assert (parser.parse(cut).reasoning, parser.parse(cut).content) == (THOUGHT[:20], "")
    check_stream_equals_whole(parser, cut)
    plain = "Just an answer <|chan"
    assert (parser.parse(plain).reasoning, parser.parse(plain).content) == (None, plain)
    check_stream_equals_whole(parser, plain)


def test_gpt_oss_thinking_then_calls():
    """Both gpt-oss parsers: the analysis channel is reasoning, a message to a function (named in
    the channel header or in `<|start|>assistant to=...`) a call, a final message content."""
    parser = ChatOutputParser(REASONING_PARSERS["gpt-oss"], TOOL_PARSERS["gpt-oss"]())
    (n0, a0), (n1, a1) = CALLS[:2]
    text = ("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant<|channel|>commentary "
            f"to=functions.{n0} <|constrain|>json<|message|>{json.dumps(a0)}<|call|>"
            f"<|start|>assistant to=functions.{n1}<|channel|>commentary json<|message|>"
            f"{json.dumps(a1)}<|call|>")
    out = parser.parse(text)
    assert out.reasoning == THOUGHT and out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == CALLS[:2]
    check_stream_equals_whole(parser, text)
    answer = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>Done."
    out = parser.parse(answer)
    assert (out.reasoning, out.content, out.calls) == ("x", "Done.", [])
    check_stream_equals_whole(parser, answer)
