"""Helpers for the scale-out / served-target / prefill-label / device training tests (not a
conftest): the tiny chat Llama (hidden 64, vocab 320, a byte tokenizer), a prompts file, the
train-draft flags those tests share, a torchrun launcher, and readers of a run's feature cache and
training log."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import TINY_CONFIGS, make_tiny_checkpoint
from tiny_chat_fixtures import CHATML

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "One word, please.", "Count to three.",
           "Spell cat.", "Pick a number.", "Why?"]


def make_char_chat_checkpoint(path: str) -> str:
    """The tiny chat Llama with a tokenizer of one character per id (printable ASCII, newline,
    then CJK characters; no bytes): any answer it writes decodes to text that encodes back to
    the same ids, so its own answers can be handed back as a prompts file's answer text."""
    from tokenizers import Tokenizer, decoders, models
    make_tiny_checkpoint("llama", path)
    n = TINY_CONFIGS["llama"]["vocab_size"] - 2
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(0x4E00 + i) for i in range(n - len(chars))]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "add_bos_token": False}, f)
    return path


def write_prompts(path: str, prompts: list, answers: list[str] | None = None) -> str:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            msgs = [{"role": "user", "content": p}]
            if answers is not None:
                msgs.append({"role": "assistant", "content": answers[i]})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def data_flags(out: str, model: str, prompts_file: str) -> list[str]:
    """Small, fast settings: 2 taps of the 3-layer target, a full-vocab draft."""
    return ["train-draft", "--out", out, "--model-path", model, "--prompts-file", prompts_file,
            "--max-new-tokens", "12", "--val-prompts", "0", "--target-layer-ids", "0,1",
            "--draft-vocab-size", "0", "--markov-rank", "16", "--block-size", "4", "--distill-batch", "4",
            "--stages", "prompts,distill,features,train"]


def train_flags(steps: int) -> list[str]:
    return ["--steps", str(steps), "--seqs-per-step", "4", "--anchors-per-seq", "4", "--log-every", "1",
            "--save-every", "1", "--warmup-frac", "0.3", "--lr", "3e-3"]


def features(out: str) -> dict[str, np.ndarray]:
    d = os.path.join(out, "features")
    return {n: np.load(os.path.join(d, f"{n}.npy")) for n in ("tokens", "taps", "final")}


def assert_same_features(got: dict, want: dict, atol: float = 2e-3) -> None:
    assert np.array_equal(got["tokens"], want["tokens"])
    for n in ("taps", "final"):
        a, b = got[n].astype(np.float32), want[n].astype(np.float32)
        assert np.array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), atol=atol, rtol=1e-2)


def train_log(out: str, key: str) -> dict[int, float]:
    """Step -> the logged `key` (loss, blocks: the draft blocks of the step's global batch)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "draft", "train_log.jsonl"))]
    return {r["step"]: r[key] for r in rows if key in r}


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc -m sparkserve.cli ARGS`, one thread per rank."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "sparkserve.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while a module of multi-process training tests runs (its ranks take one
    each); the previous setting is restored afterwards. A module opts in by importing it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
