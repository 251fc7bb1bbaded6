"""Tool-call parsers under SGLang's --tool-call-parser names (one format per file; base.py holds
what they share: the whole parse and the streamed deltas)."""
from __future__ import annotations

from sparkserve.frontend.tool_parsers.base import ToolCall, ToolParser, ToolStream
from sparkserve.frontend.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from sparkserve.frontend.tool_parsers.gpt_oss import GptOssParser
from sparkserve.frontend.tool_parsers.hermes import HermesParser, Qwen25Parser
from sparkserve.frontend.tool_parsers.llama3 import Llama3Parser
from sparkserve.frontend.tool_parsers.mistral import MistralParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Qwen25Parser, Llama3Parser, MistralParser, DeepSeekV3Parser, DeepSeekV31Parser,
    GptOssParser)}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "ToolStream"]
