"""`torchrun --nproc-per-node 2 -m sparkserve.cli train-draft`: the two ranks distil and capture
their halves of the prompts into the same feature cache one process writes, train with the same
global batch to the same loss trajectory (gloo, one thread per rank), and a two-rank checkpoint
resumes on one rank where an uninterrupted one-rank run would be."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_chat_fixtures import make_tiny_chat_checkpoint
from train_data_fixtures import (
    PROMPTS,
    REPO,
    assert_same_features,
    data_flags,
    features,
    one_thread,  # noqa: F401 (autouse)
    torchrun,
    train_flags,
    train_log,
    write_prompts,
)

from sparkserve.cli import main

# Same global batch, other summation order (two ranks' sums all-reduced): float32 rounding only
# (measured: at most 3e-7 relative over 6 steps).
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    model = make_tiny_chat_checkpoint(str(root / "model"))
    pfile = write_prompts(str(root / "prompts.jsonl"), PROMPTS[:7])   # 7: the ranks' shares differ
    one = str(root / "one")
    assert main(data_flags(one, model, pfile) + train_flags(6)) == 0
    return root, model, pfile, one


def test_two_ranks_equal_one_and_resume_on_one(setup):
    root, model, pfile, one = setup
    two = str(root / "two")
    res = torchrun(2, data_flags(two, model, pfile) + train_flags(6) + ["--stop-after", "3"])
    assert res.returncode == 0, res.stderr[-4000:]
    # each rank distilled its share of the 7 prompts, merged in prompt order
    assert sorted(os.listdir(os.path.join(two, "shards"))) == ["distill-0-3", "distill-3-7"]
    assert open(os.path.join(two, "distill.jsonl")).read() == open(os.path.join(one, "distill.jsonl")).read()
    assert_same_features(features(two), features(one))
    # without a distillation log the ranks capture their shares by prefill, merged the same way
    redo = str(root / "redo")
    os.makedirs(redo)
    for name in ("prompts.jsonl", "distill.jsonl"):
        shutil.copy(os.path.join(two, name), redo)
    res = torchrun(2, data_flags(redo, model, pfile) + ["--stages", "features"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "capturing by prefill" in res.stdout
    assert_same_features(features(redo), features(one))
    assert train_log(two, "blocks") == {s: n for s, n in train_log(one, "blocks").items() if s <= 3}
    want = train_log(one, "loss")
    got = train_log(two, "loss")
    assert sorted(got) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)], rtol=LOSS_RTOL)
    assert len(set(want.values())) == len(want)             # the loss moves: the comparison means something
    # the two-rank checkpoint resumes on one rank: steps 4..6 as the one-rank run made them
    assert torch.load(os.path.join(two, "draft", "train_state.pt"), weights_only=False)["step"] == 3
    assert main(data_flags(two, model, pfile) + train_flags(6) + ["--stages", "train"]) == 0
    got = train_log(two, "loss")
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], rtol=LOSS_RTOL)


def test_rank_flag_conflicts_fail_at_start(setup):
    root, model, pfile, _ = setup
    res = torchrun(2, data_flags(str(root / "bad"), model, pfile) + ["--stages", "eval"])
    assert res.returncode != 0 and "--stages eval under torchrun" in res.stderr
    # one rank too: its process group would be in the way of the in-process target's own
    res = torchrun(1, data_flags(str(root / "bad"), model, pfile) + ["--tp-size", "2"])
    assert res.returncode != 0 and "--tp-size/--pp-size with 1 torchrun rank(s)" in res.stderr


def test_two_nodes_train_as_one_rank(setup):
    """`--nnodes 2`: two torchrun launchers of one rank each meet over TCP as two machines would
    (here both on 127.0.0.1, `--out` on one filesystem as the design asks of several nodes), and
    the train stage's losses are the one-rank run's."""
    import socket
    root, model, pfile, one = setup
    nodes = str(root / "nodes")
    shutil.copytree(one, nodes, ignore=shutil.ignore_patterns("draft"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    args = data_flags(nodes, model, pfile) + train_flags(6) + ["--stages", "train", "--stop-after", "2"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
              "--master-addr=127.0.0.1", f"--master-port={port}"]
    procs = [subprocess.Popen([*launch, f"--node-rank={n}", "-m", "sparkserve.cli", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    want, got = train_log(one, "loss"), train_log(nodes, "loss")
    assert sorted(got) == [1, 2]
    np.testing.assert_allclose([got[1], got[2]], [want[1], want[2]], rtol=LOSS_RTOL)


def test_one_rank_torchrun_trains_as_one_process(setup):
    """torchrun of one rank still forms a process group (gloo here, NCCL with --device cuda), whose
    collectives run over that one rank and change no number."""
    root, model, pfile, one = setup
    solo = str(root / "solo")
    shutil.copytree(one, solo, ignore=shutil.ignore_patterns("draft"))
    args = data_flags(solo, model, pfile) + train_flags(6) + ["--stages", "train", "--device", "cpu"]
    res = torchrun(1, args)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "1 rank(s), process group over gloo" in res.stdout, res.stdout[-2000:]
    want, got = train_log(one, "loss"), train_log(solo, "loss")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    np.testing.assert_allclose([got[s] for s in want], [want[s] for s in want], rtol=LOSS_RTOL)
