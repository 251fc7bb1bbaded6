"""--enable-mixed-chunk: while prompts prefill in chunks, the running requests decode in the same
forward (one-token extends after the chunks). Their tokens equal the unmixed engine's (greedy, and
seeded sampling), the decodes really ride in prefill forwards, fewer forwards run in all, and no
KV slot leaks; the flag is refused beside DSpark."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import assert_no_kv_leak, engine, make_target

from sparkserve.args import ServerArgs
from sparkserve.scheduler.scheduler import Scheduler

LENGTHS = [5, 40, 23, 60, 7]
NEW = [20, 10, 15, 8, 12]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(str(tmp_path_factory.mktemp("mixed") / "llama"), "llama")


def _params():
    out = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in NEW]
    out[2] = {"temperature": 1.0, "top_k": 20, "seed": 7, "max_new_tokens": NEW[2], "ignore_eos": True}
    return out


def test_mixed_decodes_equal_unmixed_ones(target, monkeypatch):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in LENGTHS]
    runs = {}
    for mixed in (False, True):
        eng = engine(target, max_total_tokens=1024, chunked_prefill_size=16, enable_mixed_chunk=mixed)
        shapes = []     # per prefill forward: (prompt tokens, decodes riding along)
        run_prefill = Scheduler._run_prefill

        def spy(self, batch, decoding=(), _shapes=shapes, _run=run_prefill):
            _shapes.append((sum(n for _, _, n in batch), len(decoding)))
            return _run(self, batch, decoding)
        monkeypatch.setattr(Scheduler, "_run_prefill", spy)
        # the 5-token prompt finishes in the first chunk and decodes while the others prefill
        outs = eng.generate(input_ids=prompts, sampling_params=_params())
        runs[mixed] = ([o["output_ids"] for o in outs], shapes, eng.scheduler.num_forwards)
        assert_no_kv_leak(eng)
        monkeypatch.undo()
    (plain, plain_shapes, plain_forwards), (mixed, mixed_shapes, mixed_forwards) = runs[False], runs[True]
    assert mixed == plain
    assert all(len(o) == n for o, n in zip(mixed, NEW))
    # forwards that prefill a chunk and decode others at once, only with the flag
    riding = [(n, d) for n, d in mixed_shapes if d]
    assert riding and not [d for _, d in plain_shapes if d]
    assert all(n + d <= 16 for n, d in riding)         # the chunk budget covers the decodes too
    assert mixed_forwards < plain_forwards


def test_refused_with_dspark():
    with pytest.raises(ValueError, match="--enable-mixed-chunk with --speculative-algorithm"):
        # the embedded model, whose draft is shipped: only the flag pair is wrong
        ServerArgs(enable_mixed_chunk=True, speculative_algorithm="DSPARK").validate()
