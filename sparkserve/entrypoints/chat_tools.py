"""A chat request's tools and tool_choice: checked (a choice the server cannot honour is a 400,
never a hope), constrained by a grammar where the choice forces calls (`required`, a named
function) or a strict tool asks its calls checked (`auto`), and the parser its answer is read with."""
from __future__ import annotations

from sparkserve.constrained.check import check_grammar
from sparkserve.entrypoints.openai_protocol import ApiError, ChatCompletionRequest, short_repr
from sparkserve.frontend.tool_parsers import TOOL_PARSERS, ToolParser
from sparkserve.frontend.tool_parsers.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced_schema,
    is_strict,
    strict_calls_tag,
)
from sparkserve.sampling_params import SamplingParams


def checked_tools(req: ChatCompletionRequest, parser: ToolParser | None) -> list[dict] | None:
    """The request's tools when its answer is to be parsed for calls (they are also what the
    template renders); None for none (no tools, or tool_choice none). A choice this server
    cannot honour is a 400, never a hope."""
    choice, tools = req.tool_choice, req.tools or []
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise ApiError(400, f"tools.{i}: a tool is {{\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}}", "tools")
    named = isinstance(choice, dict)
    if named:
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise ApiError(400, "tool_choice: a named choice is {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}", "tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise ApiError(400, f"tool_choice: {short_repr(choice)} is not one of none, auto, required or "
                            "a named function", "tool_choice")
    if choice not in (None, "none") and not tools:
        raise ApiError(400, "tool_choice: needs tools", "tool_choice")
    if named and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"tool_choice: no tool is named {short_repr(choice['function']['name'])}",
                       "tool_choice")
    if not tools or choice == "none":
        return None
    if named or choice == "required":
        return tools                    # the grammar (forced_tools) makes the calls, any model
    if parser is None:
        raise ApiError(400, "tools: this server does not parse tool calls (start it with "
                            f"--tool-call-parser, one of {', '.join(TOOL_PARSERS)}); or send "
                            "tool_choice: none", "tools")
    return tools

def forced_tools(req: ChatCompletionRequest, backend: str, has_tokenizer: bool,
                 parser: ToolParser | None) -> ChatCompletionRequest:
    """The request constrained by its tools where they ask it (on the grammar engine, as
    response_format is): tool_choice required or named by the calls' JSON schema; auto with a
    `strict: true` tool by the structural tag of the parser's call form (free text, each call it
    opens checked; with a response_format, its JSON or calls). The tools' own schemas must be
    valid ones."""
    choice = req.tool_choice
    forced = choice == "required" or isinstance(choice, dict)
    strict = [i for i, t in enumerate(req.tools or []) if is_strict(t)]
    if not forced and not (strict and choice in (None, "auto")):
        return req
    what = (choice if isinstance(choice, str) else "a named function") if forced else \
        "auto with strict tools"
    field = "tool_choice" if forced else "tools"
    rf = req.response_format and req.response_format.get("type", "text") != "text"
    given = [n for n, v in (("response_format", rf), ("json_schema", req.json_schema),
                            ("regex", req.regex), ("ebnf", req.ebnf),
                            ("structural_tag", req.structural_tag)) if v]
    answer = req.json_schema if not forced and given[:1] in (["response_format"], ["json_schema"]) and \
        not any((req.regex, req.ebnf, req.structural_tag)) else None
    if given and answer is None:
        raise ApiError(400, f"{field}: tool_choice {what} cannot be combined with {given[0]} (one constraint "
                            "per request)", field)
    if backend == "none":
        raise ApiError(400, f"{field}: tool_choice {what} is enforced by a grammar, and this server has "
                            "none (--grammar-backend none)", field)
    if forced:
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        update = {"json_schema": forced_schema(req.tools, named, req.parallel_tool_calls)}
    else:
        assert parser is not None           # checked_tools refused auto without a parser
        try:        # with a response_format: its JSON, or the calls
            update = {"structural_tag": strict_calls_tag(req.tools, parser, req.parallel_tool_calls, answer),
                      "json_schema": None}
        except ValueError as e:
            raise ApiError(400, f"tools.{strict[0]}.function.strict: {e} (send strict: false, or "
                                "tool_choice required)", "tools") from None
    try:
        check_grammar(SamplingParams(**update).validate(), backend, has_tokenizer)
    except ValueError as e:
        raise ApiError(400, f"tools: the tools' parameters cannot constrain the answer "
                            f"(tool_choice {short_repr(choice)}): {e}", "tools") from None
    return req.model_copy(update=update)

def tool_parser_for(req: ChatCompletionRequest, parser: ToolParser | None) -> ToolParser | None:
    """How a request's answer is read for calls (None: it is not); build() checked the choice."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return NamedCallParser(choice["function"]["name"])
    return RequiredCallsParser() if choice == "required" else parser
