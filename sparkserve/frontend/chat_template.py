"""Render Hugging Face jinja chat templates exactly as transformers does, without transformers.

Same environment (sandboxed, trim_blocks/lstrip_blocks, loopcontrols, `{% generation %}` tag), same
globals (`raise_exception`, `strftime_now`, `dict`, `namespace`) and the same `tojson` filter, so a
prompt rendered here tokenizes to what the model was trained on. OpenAI-style messages are normalized
first: list-of-parts content becomes one string, None-valued keys are dropped, tool-call arguments given
as JSON strings become dicts (templates index into them).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Stands for the last message's content where continue_final_message looks for its end.
CONTINUE_MARKER = "\x00sparkserve-continue\x00"
# How text parts of one message are joined (vLLM's choice for string-content templates).
PART_SEPARATOR = "\n"
_TEXT_PART_TYPES = ("text",)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore attributes (as HF does) so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False
) -> str:
    # HF semantics: no HTML escaping, unicode kept, indent/separators/sort_keys exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Pydantic models and other mappings -> plain dicts/lists, so the sandbox only sees JSON data."""
    if hasattr(value, "model_dump") and callable(value.model_dump):
        value = value.model_dump()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts, got "
                         f"{type(content).__name__}")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"messages[{i}].content[{j}] must be an object with a 'type'")
        kind = part.get("type")
        if kind not in _TEXT_PART_TYPES:
            raise ValueError(f"messages[{i}].content[{j}].type {kind!r} is not supported (only 'text')")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def _tool_calls(calls: Any) -> Any:
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass  # leave malformed arguments as the string the client sent
        out.append(call)
    return out


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages and flatten them into what HF templates expect."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError("messages must be a list of message objects")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(messages):
        msg = _plain(raw)
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(raw).__name__}")
        msg = {k: v for k, v in msg.items() if v is not None}
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}].role is missing or not a string")
        if "content" in msg:
            msg["content"] = _content_text(msg["content"], i)
        elif not msg.get("tool_calls"):
            raise ValueError(f"messages[{i}].content is missing")
        if "tool_calls" in msg:
            msg["tool_calls"] = _tool_calls(msg["tool_calls"])
        out.append(msg)
    return out


def render_chat_template(
    template: str | None,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template`; `special_tokens` (bos_token, eos_token, ...) are
    template variables."""
    if template is None:
        raise ValueError("this model has no chat template; send a plain prompt (completions API) instead")
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(_plain(extra))  # caller's extras override special tokens, as in HF
    return compile_template(template).render(
        messages=normalize_messages(messages),
        tools=_plain(tools) if tools is not None else None,
        documents=variables.pop("documents", None),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


def load_chat_template(value: str) -> str:
    """--chat-template: a Jinja file, or the template itself; compiled here so a broken one stops
    the server at start-up, not at its first chat."""
    text = value
    if "{" not in value:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: "
                         f"{e.message})") from None
    return text


def continue_final(render: Callable[[list[dict[str, Any]]], str], messages: Sequence[Any]) -> str:
    """The prompt `render` writes for `messages`, cut right after the last message's content, so
    the model continues that message (vLLM's continue_final_message): the end of turn the template
    writes after it goes. Where the content ends is found by rendering once more with a marker for
    it: the text after the marker is the end of turn (the content itself may come out changed, a
    template may strip it), which then comes off the real prompt. A template whose end of turn
    depends on the content falls back on the content's last occurrence (vLLM's rule)."""
    messages = normalize_messages(messages)
    prompt = render(messages)
    marked = render([*messages[:-1], {**messages[-1], "content": CONTINUE_MARKER}])
    at = marked.find(CONTINUE_MARKER)
    tail = marked[at + len(CONTINUE_MARKER):]
    if at >= 0 and marked.count(CONTINUE_MARKER) == 1 and prompt.startswith(marked[:at]) and \
            prompt.endswith(tail) and len(prompt) - len(tail) >= at:
        return prompt[:len(prompt) - len(tail)]
    content = messages[-1].get("content", "")
    end = prompt.rfind(content) if content else -1
    if end < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's "
                         "content as it is, so there is nothing to continue")
    return prompt[:end + len(content)]
