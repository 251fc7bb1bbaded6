"""The whole greedy draft pass as one native call (NativeDraft.propose: block pass, LM head over
the drafts' rows, Markov loop, confidence head) proposes the tokens of the piece-by-piece path
(DSparkWorker._draft_pass, the Python reference) with its confidences, for requests with
different contexts at scattered slots; batches it cannot run fall back to the pieces."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import dspark_single_thread, make_target  # noqa: F401 (autouse)

GAMMA = 5
RANK = 8
VOCAB = 100          # a reduced draft vocab: the draft's own LM head, not a whole number of tiles


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from sparkserve.models.registry import load_model
    return load_model(make_target(str(tmp_path_factory.mktemp("propose") / "qwen3"), "qwen3"))


def make_worker(target, *, conf: bool = True, conf_markov: bool = True, shift: bool = False,
                gated: bool = False):
    """An int8 draft (Q8_0 blocks: what the native step runs) with three requests' contexts injected."""
    from sparkserve.core.req import Req
    from sparkserve.core.sampling_state import RequestSamplingState
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft
    from sparkserve.sampling_params import SamplingParams
    from sparkserve.speculative.dspark_worker import DSparkWorker
    from sparkserve.speculative.planner import VerifyPlanner
    c = target.config
    g = torch.Generator().manual_seed(11)
    cfg = dspark_config_dict(c, block_size=GAMMA + shift, markov_rank=RANK, draft_vocab_size=VOCAB,
                             enable_confidence_head=conf, markov_head_type="gated" if gated else "vanilla",
                             num_layers=2)
    cfg.update(confidence_head_with_markov=conf_markov, sample_from_anchor=shift)
    with torch.inference_mode(False):
        vocab = torch.randperm(c.vocab_size, generator=g)[:VOCAB]
        draft = init_dspark_draft(cfg, target, std=0.3, vocab=vocab)
        draft.norm.weight.data.fill_(1.0)                      # block logits and Markov biases alike
        if conf:
            draft.confidence_head.proj.bias.data.fill_(0.4)
        draft.set_activation_quant("int8")
    blocks = 3 * (GAMMA + shift)
    pool = draft.new_kv_pool(80, block_rows=blocks)
    ctx_lens = [7, 19, 12]
    table = torch.zeros(4, 32, dtype=torch.long)
    slots = torch.randperm(80, generator=g)[:sum(ctx_lens)] + 1
    reqs, off = [], 0
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    for i, (row, n) in enumerate(zip([3, 0, 2], ctx_lens)):
        table[row, :n] = slots[off:off + n]
        taps = [torch.randn(n, c.hidden_size, generator=g) for _ in draft.config.target_layer_ids]
        draft.inject(taps, torch.arange(n), table[row, :n], pool)
        off += n
        req = Req(f"r{i}", [1], params, RequestSamplingState(params))
        req.row, req.kv_len, req.output_ids = row, n, [int(torch.randint(0, c.vocab_size, (1,), generator=g))]
        reqs.append(req)
    worker = DSparkWorker(draft, pool, VerifyPlanner("full"), table, torch.arange(81, 81 + blocks))
    return worker, reqs


def passes(monkeypatch) -> list[str]:
    """Which path each propose took."""
    from sparkserve.speculative.dspark_worker import DSparkWorker
    taken, real = [], DSparkWorker._draft_pass
    monkeypatch.setattr(DSparkWorker, "_draft_pass",
                        lambda self, *a: taken.append("pieces") or real(self, *a))
    return taken


@pytest.mark.parametrize("case", [dict(), dict(conf_markov=False), dict(conf=False), dict(shift=True)])
@torch.inference_mode()
def test_native_pass_proposes_what_the_pieces_do(target, case, monkeypatch):
    worker, reqs = make_worker(target, **case)
    taken = passes(monkeypatch)
    worker.draft.enable_native_step(False)
    python = worker.propose(reqs)
    worker.draft.enable_native_step(True)
    native = worker.propose(reqs)
    assert taken == ["pieces"]                         # the second pass was the one native call
    for p, n in zip(python, native):
        assert n.tokens == p.tokens and len(n.tokens) == GAMMA
        assert (n.confidence is None) == (p.confidence is None) == (not case.get("conf", True))
        if p.confidence is not None:
            assert torch.allclose(n.confidence, p.confidence, atol=1e-5), (n.confidence, p.confidence)
    assert len({t for p in python for t in p.tokens}) > GAMMA     # the slots did not all pick one id
    if case.get("conf", True):
        confs = torch.stack([p.confidence for p in python])
        assert confs.std() > 0.01                        # the confidences depend on the slot


@torch.inference_mode()
def test_batches_the_native_pass_cannot_run_take_the_pieces(target, monkeypatch):
    from sparkserve.sampling_params import SamplingParams
    worker, reqs = make_worker(target, gated=True)    # the gate reads the slot's hidden state
    worker.draft.enable_native_step(True)
    taken = passes(monkeypatch)
    worker.propose(reqs)
    assert taken == ["pieces"]
    worker, reqs = make_worker(target)
    worker.draft.enable_native_step(True)
    reqs[1].params = SamplingParams(temperature=0.7, max_new_tokens=100)     # a sampled request
    taken = passes(monkeypatch)
    assert worker.propose(reqs)[1].q_probs is not None
    assert taken == ["pieces"]
    worker, reqs = make_worker(target)
    worker.draft.enable_native_step(True)
    worker.req_to_token[reqs[1].row, 4] = 0            # a slot a sliding-window target gave up
    blocks = [k[worker.block_slots].clone() for k in worker.pool.k]
    taken = passes(monkeypatch)
    worker.propose(reqs)
    assert taken == ["pieces"]
    for k, before in zip(worker.pool.k, blocks):       # the native call stopped before its pool writes
        assert torch.equal(k[worker.block_slots], before)
