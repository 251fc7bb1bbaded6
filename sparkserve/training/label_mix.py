"""Which training sequences are labelled how: generated (the target answers the prompt itself,
its tokens are its own greedy labels) or prefill (one teacher-forced pass of the target over an
answer the prompts file brings; the labels are the target's argmax at every position, ~3x
cheaper per token than generating here). A mix spreads the prefill ones evenly by prompt index,
so the choice does not depend on how many ranks distil."""
from __future__ import annotations

LABEL_MODES = ("generated", "prefill", "mix")


def check_label_flags(labels: str, prefill_frac: float | None) -> None:
    if labels not in LABEL_MODES:
        raise ValueError(f"--labels {labels}: choose from {', '.join(LABEL_MODES)}")
    if labels == "mix" and (prefill_frac is None or not 0 < prefill_frac < 1):
        raise ValueError(f"--labels mix needs --prefill-frac within (0, 1), got {prefill_frac}")
    if labels != "mix" and prefill_frac is not None:
        raise ValueError(f"--prefill-frac sets the share of a --labels mix; it means nothing with "
                         f"--labels {labels}")


def is_prefill_labelled(index: int, labels: str, prefill_frac: float | None) -> bool:
    """Prompt `index` (its line in prompts.jsonl) takes prefill labels."""
    if labels != "mix":
        return labels == "prefill"
    return int((index + 1) * prefill_frac) > int(index * prefill_frac)


def split_answer(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(the prompt, the answer): a conversation ending in an assistant turn brings its answer."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, None
