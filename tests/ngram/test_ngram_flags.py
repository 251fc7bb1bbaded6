"""NGRAM takes SGLang's flags; a value sparkserve cannot honour (a tree of drafts, SGLang's shared
n-gram cache) or a flag of the other algorithm is a start-up error naming the flag, before any
model loads, never silently ignored."""
from __future__ import annotations

import pytest

from sparkserve import cli
from sparkserve.args import ServerArgs


def test_defaults_are_sglangs():
    args = ServerArgs(speculative_algorithm="ngram").validate()
    assert args.speculative_algorithm == "NGRAM"
    assert args.speculative_ngram_min_match_window_size == 1
    assert args.speculative_ngram_max_match_window_size == 12
    assert args.speculative_num_draft_tokens == 12          # SGLang: the max match window
    assert args.speculative_ngram_match_type == "BFS"
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_max_match_window_size=6,
                      speculative_ngram_min_bfs_breadth=1, speculative_ngram_max_bfs_breadth=1,
                      speculative_ngram_match_type="prob").validate()
    assert args.speculative_num_draft_tokens == 6 and args.speculative_ngram_match_type == "PROB"


BAD = [
    (dict(speculative_ngram_max_bfs_breadth=10), "--speculative-ngram-max-bfs-breadth 10", "one chain"),
    (dict(speculative_ngram_min_bfs_breadth=2), "--speculative-ngram-min-bfs-breadth 2", "one chain"),
    (dict(speculative_ngram_capacity=10_000_000), "--speculative-ngram-capacity", "shared by all requests"),
    (dict(speculative_ngram_branch_length=18), "--speculative-ngram-branch-length", "drop the flag"),
    (dict(speculative_num_draft_tokens=1), "--speculative-num-draft-tokens 1", ">= 2"),
    (dict(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=3),
     "--speculative-ngram-min-match-window-size 5", "min <= max"),
    (dict(speculative_ngram_match_type="TREE"), "--speculative-ngram-match-type TREE", "BFS or PROB"),
    (dict(speculative_draft_model_path="/tmp"), "--speculative-draft-model-path",
     "needs --speculative-algorithm DSPARK"),
    (dict(speculative_dspark_block_size=4), "--speculative-dspark-block-size", "needs --speculative-algo"),
    (dict(speculative_dspark_verify_mode="threshold"), "--speculative-dspark-verify-mode threshold needs",
     "--speculative-dspark-confidence-threshold"),
]


@pytest.mark.parametrize("kw,flag,why", BAD, ids=[b[1].split()[0].removeprefix("--speculative-")
                                                  for b in BAD])
def test_ngram_refuses_what_it_cannot_honour(kw, flag, why):
    with pytest.raises(ValueError) as e:
        ServerArgs(speculative_algorithm="NGRAM", **kw).validate()
    assert flag in str(e.value) and why in str(e.value), str(e.value)


def test_flags_of_the_other_algorithm_are_refused():
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens: needs --speculative-algorithm NG"):
        ServerArgs(speculative_algorithm="DSPARK", speculative_num_draft_tokens=4).validate()
    with pytest.raises(ValueError, match="--speculative-ngram-max-match-window-size: needs --speculative"):
        ServerArgs(speculative_ngram_max_match_window_size=4).validate()
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE: use DSPARK or NGRAM"):
        ServerArgs(speculative_algorithm="EAGLE").validate()


def test_refused_on_the_command_line_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("sparkserve.scheduler.runtime.load_model",
                        lambda *a, **k: pytest.fail("a model was loaded"))
    argv = ["serve", "--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "10"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--speculative-ngram-max-bfs-breadth 10" in err and "give 1" in err
