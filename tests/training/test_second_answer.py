"""--second-answer-temperature: each training prompt distilled twice, its greedy answer and one
sampled at T seeded by the prompt's line, both kept as training sequences (validation stays
greedy); the sampled answer is what the engine samples for that prompt, seed and temperature
alone, and a rerun stopped part way resumes to the same lines."""
import json
import os

import pytest
from conftest import EXACT, EXACT_FLAGS
from train_data_fixtures import (  # noqa: F401
    data_flags,
    make_char_chat_checkpoint,
    one_thread,
    torchrun,
    write_prompts,
)

from sparkserve import Engine
from sparkserve.cli import main
from sparkserve.training.feature_cache import FeatureCache

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Count to three.", "Why?"]


def lines(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_char_chat_checkpoint(str(tmp_path_factory.mktemp("charchat")))


def test_two_answers_per_prompt_the_second_sampled_with_its_seed(tmp_path, model):
    pfile = write_prompts(str(tmp_path / "p.jsonl"), PROMPTS)
    out = str(tmp_path / "run")
    flags = data_flags(out, model, pfile) + EXACT_FLAGS + [
        "--second-answer-temperature", "0.7", "--val-prompts", "1", "--max-new-tokens", "16",
        "--stages", "prompts,distill,features"]
    assert main(flags) == 0
    rows, val = lines(os.path.join(out, "distill.jsonl")), lines(os.path.join(out, "val", "distill.jsonl"))
    n = len(PROMPTS) - 1
    assert len(rows) == 2 * n and len(val) == 1 and "seed" not in val[0]
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    with Engine(model, **EXACT) as eng:
        greedy = eng.generate(messages=msgs, sampling_params={"temperature": 0, "max_new_tokens": 16})
        for i in range(n):
            first, second = rows[2 * i], rows[2 * i + 1]
            assert first["output_ids"] == greedy[i]["output_ids"] and "seed" not in first
            assert (second["seed"], second["temperature"]) == (i, 0.7)
            assert second["prompt_ids"] == first["prompt_ids"]
            alone = eng.generate(input_ids=second["prompt_ids"], sampling_params={
                "temperature": 0.7, "seed": i, "max_new_tokens": 16})
            assert second["output_ids"] == alone["output_ids"]
        other = eng.generate(input_ids=rows[1]["prompt_ids"], sampling_params={
            "temperature": 0.7, "seed": 99, "max_new_tokens": 16})
    assert val[0]["output_ids"] == greedy[-1]["output_ids"]
    assert any(rows[2 * i]["output_ids"] != rows[2 * i + 1]["output_ids"] for i in range(n))
    assert other["output_ids"] != rows[1]["output_ids"]            # the seed decides the sample
    cache = FeatureCache.open(os.path.join(out, "features"))      # both answers are training data
    assert len(cache) == 2 * n
    assert [cache.token_ids(k)[0].tolist() for k in range(2 * n)] == [
        r["prompt_ids"] + r["output_ids"] for r in rows]

    # a run stopped after two prompts resumes at the third's greedy answer, its sample seeded 2, ...
    part = str(tmp_path / "part")
    train_lines = open(os.path.join(out, "prompts.jsonl")).readlines()
    os.makedirs(part)
    again = data_flags(part, model, pfile) + EXACT_FLAGS + [
        "--second-answer-temperature", "0.7", "--max-new-tokens", "16", "--stages", "distill"]
    for k in (2, n):
        with open(os.path.join(part, "prompts.jsonl"), "w") as f:
            f.writelines(train_lines[:k])
        assert main(again) == 0
        assert len(lines(os.path.join(part, "distill.jsonl"))) == 2 * k
    assert lines(os.path.join(part, "distill.jsonl")) == rows


def test_second_answer_flags_are_checked(tmp_path, model):
    pfile = write_prompts(str(tmp_path / "p.jsonl"), PROMPTS)
    base = data_flags(str(tmp_path / "x"), model, pfile)
    assert main(base + ["--second-answer-temperature", "0"]) == 2
    assert main(base + ["--second-answer-temperature", "0.7", "--walk-anchor-frac", "0.5"]) == 2


def test_two_ranks_distil_the_lines_one_process_does(tmp_path, model):
    """7 prompts, 14 lines: the ranks' shares [0, 7) and [7, 14) split prompt 3's two answers."""
    pfile = write_prompts(str(tmp_path / "p.jsonl"), (PROMPTS + ["Spell cat.", "Pick a number."])[:7])
    flags = ["--second-answer-temperature", "0.7", "--val-prompts", "0", "--stages", "prompts,distill"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(data_flags(one, model, pfile) + flags) == 0
    res = torchrun(2, data_flags(two, model, pfile) + flags)
    assert res.returncode == 0, res.stderr[-4000:]
    assert sorted(os.listdir(os.path.join(two, "shards"))) == ["distill-0-7", "distill-7-14"]
    want = lines(os.path.join(one, "distill.jsonl"))
    assert len(want) == 14 and [r.get("seed") for r in want[1::2]] == list(range(7))
    assert lines(os.path.join(two, "distill.jsonl")) == want
