"""gpt-oss (harmony) tool calls: a message to a function,
`<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>` (as the gpt-oss reasoning
parser leaves it in the content; the name may also sit in `<|start|>assistant to=functions.NAME`,
which that parser folds into this form). Text outside such messages is content."""
from __future__ import annotations

import json

from sparkserve.frontend.tool_parsers.base import Split, ToolParser, held_back

HEAD, MESSAGE, CALL = "<|channel|>commentary to=functions.", "<|message|>", "<|call|>"


class GptOssParser(ToolParser):
    name = "gpt-oss"
    skip_special_tokens = False          # harmony's markers are special tokens
    # No strict form (structure is None): a harmony call ends on <|call|>, which gpt-oss counts as
    # an EOS token (the end of its turn), and a grammar can only end where EOS is allowed, never
    # consume one; and the text around calls is channels opened by special tokens (<|channel|>,
    # <|end|>, <|start|>), which a grammar's free text cannot hold. tool_choice required or a named
    # function is enforced instead (a JSON grammar, any model).
    no_structure_reason = ("a gpt-oss (harmony) call ends on <|call|>, an EOS token a grammar cannot "
                           "end a call on, and the text between calls is channels of special tokens "
                           "a grammar's free text cannot hold")

    def split(self, text: str, final: bool) -> Split:
        outside, objs, pos, closed = [], [], 0, True
        while True:
            i = text.find(HEAD, pos)
            if i < 0:
                rest = text[pos:]
                outside.append(rest if final else rest[:len(rest) - held_back(rest, HEAD)])
                break
            outside.append(text[pos:i])
            m = text.find(MESSAGE, i)
            if m < 0:
                closed = final
                break                                # the name is not complete yet
            name = text[i + len(HEAD):m].split()[0] if text[i + len(HEAD):m].split() else ""
            j = text.find(CALL, m)
            body = text[m + len(MESSAGE):j if j >= 0 else len(text)]
            whole = j >= 0 or final
            if not whole:
                body = body[:len(body) - held_back(body, CALL)]
            body = body.strip()
            objs.append(f'{{"name": {json.dumps(name)}, "arguments": {body or "{}" if whole else body}'
                        + ("}" if whole else ""))
            if j < 0:
                closed = final
                break
            pos = j + len(CALL)
        if not objs:
            return Split("".join(outside), None)
        return Split("".join(outside), "[" + ",".join(objs) + ("]" if closed else ""))
