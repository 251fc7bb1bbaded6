"""--later-turn-frac: ShareGPT's later user turns (with the conversation before them) interleaved
among the first turns at the asked share of every prefix, from the training part only: no
held-out or validation prompt reaches the training prompts, not even in a later turn's history."""
import os

from sparkserve.training.config import PipelineConfig
from sparkserve.training.pipeline import stage_prompts
from sparkserve.training.prompts import (
    humaneval_prompts,
    interleave_later_turns,
    is_code_or_math,
    is_later_turn,
    jsonl_prompts,
    split_sharegpt,
)


def user(t: str) -> dict:
    return {"role": "user", "content": t}


def test_interleave_spreads_later_turns_at_the_share():
    first = [[user(f"first {i}")] for i in range(40)]
    later = [[user(f"q {i}"), {"role": "assistant", "content": "a"}, user(f"then {i}")] for i in range(12)]
    out = interleave_later_turns(first[:20] + later + first[20:], 0.3)
    assert sorted(map(str, out)) == sorted(map(str, first + later))           # each prompt once
    assert [p for p in out if not is_later_turn(p)] == first                  # first turns in order
    assert [sum(map(is_later_turn, out[:n])) for n in (10, 20, 33, 40, 52)] == [3, 6, 9, 12, 12]
    assert interleave_later_turns(first + later, 0.3) == out                  # deterministic
    assert interleave_later_turns(first + later, 0.3, seed=1) != out          # later turns shuffled


def test_sharegpt_later_turns_share_without_heldout_overlap(tmp_path):
    out = str(tmp_path / "run")
    stage_prompts(PipelineConfig(out=out, later_turn_frac=0.3, code_math_frac=0.35, num_prompts=1000,
                                 prompts_offset=50, val_prompts=64))
    train = jsonl_prompts(os.path.join(out, "prompts.jsonl"))
    val = jsonl_prompts(os.path.join(out, "val", "prompts.jsonl"))
    later = [p for p in train if is_later_turn(p)]
    assert len(train) == 1000 and len(later) == 300
    assert all(p[-1]["role"] == "user" and len(p) >= 3 for p in later)
    first = [p for p in train if not is_later_turn(p)]
    # the code/maths share among the first turns: the offset skipped 50 - 15 of them
    assert sum(map(is_code_or_math, first)) == int(735 * 0.35) - int(35 * 0.35)
    all_train, held = split_sharegpt()
    assert val == held[-64:]
    banned = {p[0]["content"] for p in held + humaneval_prompts()}
    assert not [p for p in train if any(m["role"] == "user" and m["content"] in banned for m in p)]
    # later turns come from every part of the training conversations, not a run of one conversation
    known = {str(p) for p in all_train}
    assert all(str(p) in known for p in train)
    assert len({p[0]["content"] for p in later}) > 250


def test_later_turn_frac_outside_0_1_is_refused():
    import pytest

    from sparkserve.training.pipeline import check_flags
    from sparkserve.training.ranks import Ranks
    with pytest.raises(ValueError, match="--later-turn-frac"):
        check_flags(PipelineConfig(out="x", later_turn_frac=1.5), Ranks())
    check_flags(PipelineConfig(out="x", later_turn_frac=0.3), Ranks())
