"""A run's cache split into its chat and code/maths sequences (training/cache_kinds.py, what
benchmarks/draft_recipes.py --split-kinds scores): each subset holds exactly the sequences
distilled from prompts of its kind, in order, also with two answers per training prompt."""
import json
import os

import torch
from conftest import EXACT_FLAGS
from train_data_fixtures import data_flags, make_char_chat_checkpoint, one_thread, write_prompts  # noqa: F401

from sparkserve.cli import main
from sparkserve.training.cache_kinds import kind_subsets
from sparkserve.training.feature_cache import FeatureCache

CODE = ["Write a Python function that adds 1.", "Solve the equation x + 2 = 7.", "Debug this code: x = ("]
CHAT = ["Name a colour.", "Say hello.", "Tell me a story.", "Why is the sky blue?"]
PROMPTS = [CHAT[0], CODE[0], CHAT[1], CODE[1], CHAT[2], CODE[2], CHAT[3]]


def test_kind_subsets_hold_the_sequences_of_their_prompts(tmp_path):
    model = make_char_chat_checkpoint(str(tmp_path / "model"))
    out = str(tmp_path / "run")
    pfile = write_prompts(str(tmp_path / "p.jsonl"), PROMPTS)
    two = ["--second-answer-temperature", "0.7"]
    assert main(data_flags(out, model, pfile) + EXACT_FLAGS + two + [
        "--val-prompts", "3", "--stages", "prompts,distill,features"]) == 0
    for part, prompts, per in ((out, PROMPTS[:4], 2), (os.path.join(out, "val"), PROMPTS[4:], 1)):
        cache = FeatureCache.open(os.path.join(part, "features"))
        rows = [json.loads(line) for line in open(os.path.join(part, "distill.jsonl"))]
        assert len(rows) == per * len(prompts) and all(r["output_ids"] for r in rows)
        kinds = kind_subsets(cache, part)
        for kind, texts in (("chat", CHAT), ("code", CODE)):
            want = [k for k in range(len(rows)) if prompts[k // per] in texts]
            assert len(kinds[kind]) == len(want) > 0
            for i, k in enumerate(want):
                tokens, taps, final, plen = kinds[kind].sequence(i)
                assert tokens.tolist() == rows[k]["prompt_ids"] + rows[k]["output_ids"]
                assert plen == len(rows[k]["prompt_ids"])
                torch.testing.assert_close(taps, cache.sequence(k)[1], equal_nan=True)
