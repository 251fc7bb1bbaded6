"""DeepSeek tool calls, between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, one
`<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` block per call. V3 / R1 (`deepseekv3`):
`function<｜tool▁sep｜>NAME` then the arguments in a ```json fence; V3.1 (`deepseekv31`):
`NAME<｜tool▁sep｜>ARGUMENTS`. The name sits outside the JSON, so each block is rewritten as
`{"name": NAME, "arguments": ARGUMENTS}` for base.py to read."""
from __future__ import annotations

import json

from sparkserve.frontend.tool_parsers.base import Split, ToolParser, held_back

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3Parser(ToolParser):
    name = "deepseekv3"
    skip_special_tokens = False          # the markers are added tokens; kept in the text either way

    def structure(self, name: str) -> tuple[str, str, str]:
        return CALL, f"{CALL}function{SEP}{name}\n```json\n", f"\n```{CALL_END}"

    def name_and_body(self, block: str) -> tuple[str, str] | None:
        """(name, raw arguments) of one block so far; None until the name is complete."""
        _, sep, tail = block.partition(SEP)
        name, newline, body = tail.partition("\n")
        if not sep or not newline:
            return None
        return name.strip(), body.strip().removeprefix("```json").strip()

    def split(self, text: str, final: bool) -> Split:
        i = text.find(BEGIN)
        if i < 0:
            return Split(text if final else text[:len(text) - held_back(text, BEGIN)], None)
        content, rest = text[:i], text[i + len(BEGIN):]
        rest, ended, after = rest.partition(END)
        objs = []
        for block in rest.split(CALL)[1:]:
            block, closed, _ = block.partition(CALL_END)
            whole = bool(closed) or final
            parts = self.name_and_body(block if whole else block[:len(block) - held_back(block, CALL_END)])
            if parts is None:
                break
            name, body = parts
            body = body.rstrip().rstrip("`").rstrip()        # the fence's close, or part of it
            objs.append(f'{{"name": {json.dumps(name)}, "arguments": {body or "{}" if whole else body}'
                        + ("}" if whole else ""))
            if not whole:
                break
        return Split(content + after, "[" + ",".join(objs) + ("]" if ended or final else ""))


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseekv31"

    def structure(self, name: str) -> tuple[str, str, str]:
        return CALL, f"{CALL}{name}{SEP}", CALL_END

    def name_and_body(self, block: str) -> tuple[str, str] | None:
        name, sep, body = block.partition(SEP)
        return (name.strip(), body.strip()) if sep else None
