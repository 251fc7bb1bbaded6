"""`train-draft --device cuda`: the train stage on a GPU makes the CPU run's loss trajectory, its
checkpoints (CPU tensors) resume on the other device where an uninterrupted run would be, and a
torchrun rank trains over NCCL as one process does. Skipped where torch sees no CUDA device
(`--device cuda` there is a start-up error: test_train_settings.py)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from tiny_chat_fixtures import make_tiny_chat_checkpoint
from train_data_fixtures import (
    PROMPTS,
    data_flags,
    one_thread,  # noqa: F401 (autouse)
    torchrun,
    train_flags,
    train_log,
    write_prompts,
)

from sparkserve.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")

# Same data, anchors and starting draft; float32 on both devices (torch's default keeps TF32 off
# for matmuls), but other kernels and summation orders, whose rounding 6 AdamW steps carry along.
DEVICE_RTOL = 1e-3
# Same device and kernels; an all-reduce over one rank leaves every sum as it was, so only CUDA's
# nondeterministic atomics could part the two.
SAME_DEVICE_RTOL = 1e-5
STEPS = range(1, 7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny data, trained 6 steps on CPU (`cpu`) and, from a copy of the same data, on CUDA
    (`gpu`)."""
    root = tmp_path_factory.mktemp("device")
    model = make_tiny_chat_checkpoint(str(root / "model"))
    pfile = write_prompts(str(root / "prompts.jsonl"), PROMPTS[:7])
    cpu = str(root / "cpu")
    assert main(data_flags(cpu, model, pfile) + train_flags(6) + ["--device", "cpu"]) == 0

    def data(name: str) -> str:
        """A run folder with the CPU run's data and no draft."""
        out = str(root / name)
        shutil.copytree(cpu, out, ignore=shutil.ignore_patterns("draft"))
        return out

    def train(out: str, device: str, *extra: str) -> None:
        args = data_flags(out, model, pfile) + train_flags(6) + ["--stages", "train", "--device", device]
        assert main(args + list(extra)) == 0

    gpu = data("gpu")
    train(gpu, "cuda")
    return {"cpu": cpu, "gpu": gpu, "data": data, "train": train, "model": model, "pfile": pfile}


def _losses(out: str) -> list[float]:
    got = train_log(out, "loss")
    assert sorted(got) == list(STEPS), got
    return [got[s] for s in STEPS]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def test_cuda_trains_as_cpu_and_checkpoints_resume_across(runs):
    want = _losses(runs["cpu"])
    assert len(set(want)) == len(want)                  # the loss moves: the comparison means something
    assert train_log(runs["gpu"], "blocks") == train_log(runs["cpu"], "blocks")     # the same anchors
    np.testing.assert_allclose(_losses(runs["gpu"]), want, rtol=DEVICE_RTOL)
    # a CUDA run's checkpoint holds CPU tensors only (it loads where there is no GPU)
    state = torch.load(os.path.join(runs["gpu"], "draft", "train_state.pt"), weights_only=False)
    devices = {t.device.type for t in _tensors(state)}
    assert devices == {"cpu"}, devices
    # stopped at step 3 on one device, resumed on the other: the uninterrupted CPU run's losses
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        out = runs["data"](f"{first}-then-{then}")
        runs["train"](out, first, "--stop-after", "3")
        assert torch.load(os.path.join(out, "draft", "train_state.pt"), weights_only=False)["step"] == 3
        runs["train"](out, then)
        np.testing.assert_allclose(_losses(out), want, rtol=DEVICE_RTOL, err_msg=f"{first} -> {then}")


def test_one_rank_torchrun_over_nccl_trains_as_one_process(runs):
    out = runs["data"]("nccl")
    res = torchrun(1, data_flags(out, runs["model"], runs["pfile"]) + train_flags(6)
                   + ["--stages", "train", "--device", "cuda"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "process group over nccl" in res.stdout, res.stdout[-2000:]
    np.testing.assert_allclose(_losses(out), _losses(runs["gpu"]), rtol=SAME_DEVICE_RTOL)
