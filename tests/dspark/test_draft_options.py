"""The DSpark draft's architecture options (checkpoint config: tap_norm, prev_context_fusion, a
wider num_key_value_heads, num_hidden_layers > 1): per option the training path
(training/blocks.py) and the serving paths (DSparkDraft.inject + block_hidden from Python, and the
native inject + block pass) compute the same draft logits, and greedy DSpark serving equals plain
decoding. A config without the options is DeepSpec's, unchanged."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import (
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    install_context_check,
    load_hf,
    make_target,
)

GAMMA = 4
OPTIONS = {
    "base": {},
    "tap_norm": dict(tap_norm=True),
    "fusion": dict(prev_context_fusion=True),
    "wide_kv": dict(kv_heads=4),              # the target's 4 attention heads (its KV heads: 2)
    "two_layers": dict(num_layers=2),
    "all": dict(tap_norm=True, prev_context_fusion=True, kv_heads=4, num_layers=3),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(str(tmp_path_factory.mktemp("draft_options") / "llama"), "llama")


def make_draft(target_dir: str, option: str, seed: int = 0):
    """A random draft with the option; its option weights random too (fuse_proj starts at zero
    and tap norms at one when trained: both would hide a path that skips them)."""
    from sparkserve.config import ModelConfig
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft
    kw = dict(OPTIONS[option])
    cfg = dspark_config_dict(ModelConfig.from_hf_dir(target_dir), num_layers=kw.pop("num_layers", 1),
                             block_size=GAMMA, mask_token_id=3, markov_rank=16, **kw)
    draft = init_dspark_draft(cfg, seed=seed, std=0.2)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        draft.norm.weight.fill_(1.0)
        if draft.fuse_proj is not None:
            draft.fuse_proj.weight.copy_(torch.randn(draft.fuse_proj.weight.shape, generator=g) * 0.2)
        if draft.tap_norm is not None:
            draft.tap_norm.weight.copy_(1 + 0.3 * torch.randn(draft.tap_norm.weight.shape, generator=g))
    return draft


def sequence(draft, S: int = 24, seed: int = 5):
    """Tokens, taps [S, n * d] at RMS 3 / 10 / 30 by tap (as SmolLM2's), sorted anchors."""
    g = torch.Generator().manual_seed(seed)
    d, n = draft.config.hidden_size, len(draft.config.target_layer_ids)
    scales = torch.tensor([3.0, 10.0, 30.0])[:n].repeat_interleave(d)
    taps = torch.randn(S, n * d, generator=g) * scales
    tokens = torch.randint(0, draft.config.vocab_size, (S,), generator=g)
    return tokens, taps, torch.tensor([1, 6, 7, 13, 19])


def serving_logits(draft, tokens, taps, anchors, native: bool):
    """The draft logits of every anchor's block through the serving path: the context (rows
    < each anchor) injected at scattered slots of the draft's pool, all blocks in one batched
    block pass (contexts of different lengths), the Markov bias on the true previous tokens."""
    S, A = len(tokens), len(anchors)
    g = torch.Generator().manual_seed(9)
    draft.enable_native_step(native)
    pool = draft.new_kv_pool(64, block_rows=A * GAMMA)
    slots = torch.randperm(64, generator=g)[:S] + 1
    split = [9, S]                                   # two inject calls, as prefill then a cycle
    for lo, hi in zip([0] + split[:-1], split):
        draft.inject([taps[lo:hi]], torch.arange(lo, hi), slots[lo:hi], pool)
    L = int(anchors.max())
    kv_indices = torch.zeros(A, L, dtype=torch.long)
    for b, a in enumerate(anchors.tolist()):
        kv_indices[b, :a] = slots[:a]
    spare = torch.arange(65, 65 + A * GAMMA) if native else None
    h = draft.block_hidden(tokens[anchors], anchors, kv_indices, anchors.tolist(), pool, spare)
    pos = anchors[:, None] + torch.arange(GAMMA)[None, :]
    emb = draft.markov_head.prev_embedding(tokens[pos.clamp(max=S - 1)]).view(A * GAMMA, -1)
    h = h.reshape(A * GAMMA, -1)
    return draft.lm_head(h) + draft.markov_head.bias(emb, h)


def training_logits(draft, tokens, taps, anchors, dense: bool = True):
    from sparkserve.training.blocks import BlockSeq, blocks_forward
    return blocks_forward(draft, [BlockSeq(tokens, taps, anchors)], dense=dense)[1]


def native_calls(monkeypatch) -> list[str]:
    from sparkserve.models.dspark_native import NativeDraftStep
    calls = []
    for name in ("inject", "block_hidden", "propose_greedy"):
        real = getattr(NativeDraftStep, name)

        def record(self, *a, _n=name, _r=real):
            out = _r(self, *a)
            if out is not None or _n == "inject":       # propose_greedy: None where it does not run
                calls.append(_n.removesuffix("_greedy"))
            return out
        monkeypatch.setattr(NativeDraftStep, name, record)
    return calls


@pytest.mark.parametrize("option", list(OPTIONS))
@torch.inference_mode()
def test_training_and_python_serving_compute_one_draft(target_dir, option):
    draft = make_draft(target_dir, option).eval()
    tokens, taps, anchors = sequence(draft)
    train = training_logits(draft, tokens, taps, anchors)
    serve = serving_logits(draft, tokens, taps, anchors, native=False)
    assert train.shape == serve.shape == (len(anchors) * GAMMA, draft.config.out_vocab)
    torch.testing.assert_close(serve, train, atol=2e-4, rtol=1e-4)
    # training's block attention (TrainConfig.block_attention) too
    torch.testing.assert_close(training_logits(draft, tokens, taps, anchors, dense=False), serve, atol=2e-4,
                               rtol=1e-4)
    # the option is in the computation: the draft without it computes other logits
    if option != "base":
        base = training_logits(make_draft(target_dir, "base"), tokens, taps, anchors)
        assert (train - base).abs().max() > 1e-2


@pytest.mark.parametrize("option", list(OPTIONS))
@torch.inference_mode()
def test_native_serving_computes_the_training_draft(target_dir, option, tmp_path, monkeypatch):
    """An fp16 checkpoint (F16 blocks: what the native step runs): the native inject and block
    pass give the training path's logits of the same loaded draft."""
    from sparkserve.models.dspark_draft import load_dspark_draft, save_dspark_draft
    save_dspark_draft(make_draft(target_dir, option), str(tmp_path), include_shared=True, dtype=torch.float16)
    draft = load_dspark_draft(str(tmp_path))
    tokens, taps, anchors = sequence(draft)
    calls = native_calls(monkeypatch)
    native = serving_logits(draft, tokens, taps, anchors, native=True)
    assert calls == ["inject", "inject", "block_hidden"]
    torch.testing.assert_close(native, training_logits(draft, tokens, taps, anchors), atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("option", ["base", "fusion", "all"])
@torch.inference_mode()
def test_native_greedy_pass_proposes_what_the_pieces_do(target_dir, option, tmp_path):
    """The one-call greedy pass (NativeDraftStep.propose_greedy) against the piece-by-piece
    reference (DSparkWorker._draft_pass): for one request, alternating with another context so a
    fused draft's mask row must follow its request; for both requests in one call (a fused
    draft's mask row per request); and for contexts with rows left out (a dark request's
    draft_gaps: the anchors sit past their contexts' ends)."""
    from sparkserve.core.req import Req
    from sparkserve.core.sampling_state import RequestSamplingState
    from sparkserve.models.dspark_draft import load_dspark_draft, save_dspark_draft
    from sparkserve.sampling_params import SamplingParams
    from sparkserve.speculative.dspark_worker import DSparkWorker, without_gaps
    from sparkserve.speculative.planner import VerifyPlanner
    save_dspark_draft(make_draft(target_dir, option), str(tmp_path), include_shared=True, dtype=torch.float16)
    draft = load_dspark_draft(str(tmp_path))
    draft.enable_native_step(True)
    tokens, taps, _ = sequence(draft, S=30)
    pool = draft.new_kv_pool(64, block_rows=2 * GAMMA)
    table = torch.stack([torch.arange(1, 31), torch.arange(31, 61)])
    for row, shift in ((0, 0), (1, 7)):
        draft.inject([taps.roll(shift, 0)], torch.arange(30), table[row], pool)
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    reqs = []
    for row, n in ((0, 17), (1, 29)):
        req = Req(f"r{row}", [1], params, RequestSamplingState(params))
        req.row, req.kv_len, req.output_ids = row, n, [int(tokens[n])]
        reqs.append(req)
    worker = DSparkWorker(draft, pool, VerifyPlanner("full"), table, torch.arange(65, 65 + 2 * GAMMA))

    def agree(batch, kv, ctx_lens, positions=None):
        anchors = torch.tensor([r.output_ids[-1] for r in batch])
        native = draft.native.propose_greedy(
            draft, anchors, kv, ctx_lens, pool, worker.block_slots, positions)
        ref_tokens, ref_conf, _ = worker._draft_pass(batch, anchors, kv, ctx_lens, positions)
        assert native is not None and torch.equal(native[0], ref_tokens)
        torch.testing.assert_close(native[1], ref_conf, atol=1e-5, rtol=1e-5)
        return native

    for req in reqs + reqs:
        agree([req], table[req.row:req.row + 1, :req.kv_len], [req.kv_len])
    both = agree(reqs, table[:, :29], [17, 29])
    for b, n in enumerate((17, 29)):      # each request's row of the batch is its own pass
        alone = agree(reqs[b:b + 1], table[b:b + 1, :n], [n])
        assert torch.equal(both[0][b], alone[0][0])
        torch.testing.assert_close(both[1][b], alone[1][0], atol=1e-5, rtol=1e-5)
    reqs[0].draft_gaps, reqs[1].draft_gaps = [[3, 6], [10, 17]], [[20, 26]]
    kv, lens = without_gaps(table[:, :29], reqs)
    assert lens == [7, 23] and kv[0, :7].tolist() == [1, 2, 3, 7, 8, 9, 10]
    gapped = agree(reqs, kv, lens, [17, 29])
    # the rows left out are out of the pass: the confidences move
    assert (gapped[1] - both[1]).abs().max() > 1e-3


@torch.inference_mode()
def test_fused_draft_keeps_its_context_rows(target_dir):
    """prev_context_fusion: the pool holds each injected slot's fused context row (a component
    the PD transfer carries), and the block reads the row of position anchor - 1: another row
    there changes the block, one elsewhere does not."""
    draft = make_draft(target_dir, "fusion").eval()
    tokens, taps, anchors = sequence(draft)
    pool = draft.new_kv_pool(32)
    assert "draft_context" in [c.name for c in pool.components()]
    slots = torch.arange(1, 25)
    draft.inject([taps], torch.arange(24), slots, pool)
    torch.testing.assert_close(pool.context[slots], draft.context_hidden([taps]))
    args = (tokens[anchors[-1:]], anchors[-1:], slots[None, :19], [19], pool)
    ref = draft.block_hidden(*args)
    pool.context[slots[5]] += 1.0
    assert torch.equal(draft.block_hidden(*args), ref)
    pool.context[slots[18]] += 1.0
    assert not torch.allclose(draft.block_hidden(*args), ref)


@torch.inference_mode()
def test_fused_rows_move_with_a_pd_transfer(target_dir):
    """A request's rows read from one fused draft's pool (mem/transfer.py, as a PD transfer sends
    them) and written at other slots of another pool give the same block there."""
    from sparkserve.mem.transfer import RequestPages, read_request, write_request
    draft = make_draft(target_dir, "fusion").eval()
    tokens, taps, _ = sequence(draft)
    src, dst = draft.new_kv_pool(40), draft.new_kv_pool(40)
    here, there = torch.arange(1, 20), torch.arange(21, 40)
    draft.inject([taps[:19]], torch.arange(19), here, src)
    write_request([dst], RequestPages(there, None, 0), read_request([src], RequestPages(here, None, 0)), 0)
    block = [draft.block_hidden(tokens[19:20], torch.tensor([19]), s[None], [19], pool)
             for s, pool in ((here, src), (there, dst))]
    assert torch.equal(block[0], block[1])
    dst.context[there[-1]] = 0                           # without the row the block differs
    assert not torch.allclose(draft.block_hidden(tokens[19:20], torch.tensor([19]), there[None], [19], dst),
                              block[0])


def test_default_config_is_deepspecs(target_dir):
    """No option asked: the config holds no key of them (a DeepSpec checkpoint, as before)."""
    from sparkserve.config import ModelConfig
    from sparkserve.models.dspark_draft import DSparkConfig, dspark_config_dict
    tc = ModelConfig.from_hf_dir(target_dir)
    cfg = dspark_config_dict(tc, block_size=GAMMA)
    assert not {"tap_norm", "prev_context_fusion"} & set(cfg)
    assert cfg["num_key_value_heads"] == tc.num_key_value_heads
    c = DSparkConfig.from_dict(cfg)
    assert not c.tap_norm and not c.prev_context_fusion
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DSparkConfig.from_dict({**cfg, "num_key_value_heads": 3})


@pytest.fixture(scope="module")
def plain(target_dir):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 6, 23, 11)]
    params = [dict(temperature=0, max_new_tokens=m) for m in (18, 2, 21, 13)]
    return prompts, params, generate_ids(engine(target_dir), prompts, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "base"])
def test_option_serves_greedy_as_plain(target_dir, plain, option, dtype, tmp_path, monkeypatch):
    """Greedy DSpark with the option (fp32: the Python path; fp16: the native step) gives plain
    decoding's tokens; after every step the draft's context K/V (and a fused draft's context
    rows) equal those computed from a fresh transformers forward. The draft's Markov head knows
    the target's next-token table of these runs, so blocks are accepted, rejected and cut."""
    from sparkserve.models.dspark_draft import save_dspark_draft
    prompts, params, ref = plain
    draft = make_draft(target_dir, option)
    with torch.no_grad():            # Markov head: the plain runs' bigrams (accepts happen)
        V = draft.config.vocab_size
        w1 = torch.randn(V, 16, generator=torch.Generator().manual_seed(2))
        draft.markov_head.markov_w1.weight.copy_(w1)
        w2 = torch.zeros(V, 16)
        for p, o in zip(prompts, ref):
            for a, b in zip(p[-1:] + o, o):
                w2[b] += 8 * w1[a] / w1[a].norm() ** 2
        draft.markov_head.markov_w2.weight.copy_(w2)
    save_dspark_draft(draft, str(tmp_path), include_shared=True, dtype=dtype)
    eng = engine(target_dir, str(tmp_path))
    stats = install_context_check(eng, load_hf(target_dir))
    calls = native_calls(monkeypatch)
    if option in ("fusion", "all"):
        install_fused_row_check(eng, load_hf(target_dir))
    out = generate_ids(eng, prompts, params)
    assert out == ref
    assert stats["rows"] > 0
    assert_no_kv_leak(eng)
    accepted = sum(k * v for k, v in eng.scheduler.accept_hist.items())
    assert accepted > 0, eng.scheduler.accept_hist
    if dtype == torch.float32:
        assert calls == []
    else:                            # the one-call pass, for several requests too (a fused draft's
        assert "inject" in calls and "propose" in calls     # mask row per request)
        assert "block_hidden" not in calls


def install_fused_row_check(eng, hf_model) -> None:
    """After every step, each running request's fused context rows (pool.context at its slots,
    rows kept back excepted) equal the draft's context of a fresh transformers forward."""
    sched = eng.scheduler
    orig = sched.step

    @torch.inference_mode()
    def step():
        out = orig()
        draft, pool = sched.spec.draft, sched.spec.pool
        kept = torch.cat([s for _, _, s in sched.spec.backlog]) if sched.spec.backlog else torch.empty(0)
        for req in sched.running:
            n = req.kv_len
            if req.row is None or n == 0:
                continue
            hs = hf_model(torch.tensor([req.fill_ids[:n]]), output_hidden_states=True).hidden_states
            ctx = draft.context_hidden([hs[t + 1][0] for t in draft.config.target_layer_ids])
            slots = sched.cache.req_to_token.table[req.row, :n]
            live = ~torch.isin(slots, kept)
            torch.testing.assert_close(pool.context[slots[live]], ctx[live], atol=2e-4, rtol=1e-3)
        return out
    sched.step = step
