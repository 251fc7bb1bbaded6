"""DSpark draft training: feature capture against transformers, the objective learns, the
checkpoint serves losslessly, a learnable target reaches high acceptance, held-out splits."""
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sparkserve import Engine
from sparkserve.config import ModelConfig
from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft, load_dspark_draft
from sparkserve.training.feature_cache import FeatureCache, build_feature_cache, capture
from sparkserve.training.train_dspark import TrainConfig, block_forward, sample_anchors, train, walk_anchors
from sparkserve.training.validate import greedy_acceptance, serving_acceptance

V = 64


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory):
    """A target whose greedy next token is a fixed function of the current token (attention
    and MLP outputs zeroed), with a sharp output distribution: a draft can learn it exactly."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                               max_position_embeddings=512, head_dim=16, initializer_range=0.5)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.mul_(4.0)
    path = str(tmp_path_factory.mktemp("bigram"))
    m.save_pretrained(path)
    return path, m


@pytest.fixture(scope="module")
def distilled(bigram_target, tmp_path_factory):
    path, _ = bigram_target
    eng = Engine(path, max_total_tokens=8192)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(48)]
    outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                            "ignore_eos": True})
    seqs = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    dcfg = dspark_config_dict(ModelConfig.from_hf_dir(path), num_layers=1, block_size=4,
                              mask_token_id=3, markov_rank=V)
    fc_dir = str(tmp_path_factory.mktemp("features"))
    target = eng.scheduler.runner.model
    build_feature_cache(target, seqs, [len(p) for p in prompts], dcfg["target_layer_ids"], fc_dir)
    return eng, target, dcfg, fc_dir, prompts, outs, seqs


def test_feature_capture_matches_transformers(bigram_target, distilled):
    _, ref = bigram_target
    _, target, dcfg, fc_dir, _, _, seqs = distilled
    cache = FeatureCache.open(fc_dir)
    for i in (0, 5, len(seqs) - 1):
        tokens, taps, final, plen = cache.sequence(i)
        assert tokens.tolist() == seqs[i]
        with torch.no_grad():
            hs = ref(torch.tensor([seqs[i]]), output_hidden_states=True).hidden_states
        want_taps = torch.cat([hs[l + 1][0] for l in dcfg["target_layer_ids"]], dim=-1)
        torch.testing.assert_close(taps, want_taps, atol=2e-2, rtol=2e-3)      # fp16 storage
        torch.testing.assert_close(final, hs[-1][0], atol=2e-2, rtol=2e-3)
        fresh_taps, fresh_final = capture(target, [seqs[i]], dcfg["target_layer_ids"])[0]
        torch.testing.assert_close(taps, fresh_taps.half().float())
        torch.testing.assert_close(final, fresh_final.half().float())


def test_training_learns_and_serves_losslessly(bigram_target, distilled, tmp_path):
    path, _ = bigram_target
    eng, target, dcfg, fc_dir, prompts, outs, _ = distilled
    draft = init_dspark_draft(dcfg, target)
    out = str(tmp_path / "draft")
    cfg = TrainConfig(steps=240, seqs_per_step=4, anchors_per_seq=16, lr=1e-2, save_every=120)
    train(draft, FeatureCache.open(fc_dir), out, cfg, log_every=20)
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]
    first, last = log[0], log[-1]
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    assert last["tau_est"] > first["tau_est"]
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    spec = Engine(path, max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=out, speculative_dspark_verify_mode="full")
    got = spec.generate(input_ids=prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                                "ignore_eos": True})
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in outs[:8]]
    trained = _mean_accepted(spec.scheduler.accept_hist)
    untrained_dir = str(tmp_path / "untrained")
    from sparkserve.models.dspark_draft import save_dspark_draft
    save_dspark_draft(init_dspark_draft(dcfg, target), untrained_dir)
    base = Engine(path, max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=untrained_dir, speculative_dspark_verify_mode="full")
    base.generate(input_ids=prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                          "ignore_eos": True})
    untrained = _mean_accepted(base.scheduler.accept_hist)
    # The untrained draft already gets slot 0 right here (it shares the target's embedding and
    # LM head, and this target's next token depends on the current token only); training must
    # add the later slots, which only the Markov head / backbone can learn.
    assert trained >= untrained + 0.3, (untrained, trained, spec.scheduler.accept_hist)


def test_offline_acceptance_replays_serving(bigram_target, distilled, tmp_path):
    """The offline validator replays greedy serving from the feature cache: its walk has
    exactly the engine's verify cycles, each accepting the drafts the engine accepted (a
    half-trained draft, so that accept lengths vary)."""
    path, _ = bigram_target
    eng, target, _, fc_dir, prompts, outs, _ = distilled
    out = str(tmp_path / "draft")
    dcfg = distilled[2]
    train(init_dspark_draft(dcfg, target), FeatureCache.open(fc_dir), out,
          TrainConfig(steps=30, seqs_per_step=4, anchors_per_seq=16, lr=1e-2, save_every=30))
    spec = Engine(path, max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=out, speculative_dspark_verify_mode="full")
    got = spec.generate(input_ids=prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                                "ignore_eos": True})
    hist = spec.scheduler.accept_hist
    assert len(hist) >= 3, hist
    res = greedy_acceptance(load_dspark_draft(out, target), FeatureCache.open(fc_dir), max_seqs=8,
                            anchors_per_chunk=5)
    assert res["accept_hist"] == hist
    cycles = sum(g["meta_info"]["spec_verify_ct"] for g in got)
    served = (cycles + sum(g["meta_info"]["spec_accept_token_num"] for g in got)) / cycles   # bonus included
    assert res["tau"] == pytest.approx(served)
    assert res["blocks"] == sum(hist.values())
    reached0 = res["blocks"]
    assert res["slot_accept"][0] == pytest.approx(sum(v for k, v in hist.items() if k > 0) / reached0)
    # the eval stage's parity check serves the cached sequences again and reads the same walk
    served = serving_acceptance(spec, FeatureCache.open(fc_dir), max_seqs=8)
    assert served["accept_hist"] == res["accept_hist"] and served["same_tokens"] == 1.0
    assert served["tau"] == pytest.approx(res["tau"]) and served["slot1_accept"] == pytest.approx(
        res["slot_accept"][0])


def test_walk_anchors_step_like_serving(bigram_target, distilled, tmp_path):
    """Walk anchors are where the engine anchors its next verify cycle: stepping from the first
    response token with walk_anchors alone gives the engine's accept histogram on the same
    greedy requests; training with them runs; a share outside [0, 1] is an error."""
    path, _ = bigram_target
    _, target, dcfg, fc_dir, prompts, _, _ = distilled
    out = str(tmp_path / "draft")
    cache = FeatureCache.open(fc_dir)
    train(init_dspark_draft(dcfg, target), cache, out,
          TrainConfig(steps=30, seqs_per_step=4, anchors_per_seq=16, lr=1e-2, save_every=30))
    draft = load_dspark_draft(out, target)
    spec = Engine(path, max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=out, speculative_dspark_verify_mode="full")
    spec.generate(input_ids=prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                          "ignore_eos": True})
    assert len(spec.scheduler.accept_hist) >= 3, spec.scheduler.accept_hist
    hist: dict[int, int] = {}
    for i in range(8):
        tokens, taps, _, plen = cache.sequence(i)
        S, a = len(tokens), plen
        while a < S - 2:
            nxt = walk_anchors(draft, tokens, taps, torch.tensor([a]), 1.0)
            m = int(nxt[0]) if len(nxt) else S - 1          # dropped: the cycle ran to the end
            hist[m - a - 1] = hist.get(m - a - 1, 0) + 1
            a = m
    assert hist == spec.scheduler.accept_hist
    tokens, taps, _, plen = cache.sequence(0)
    anchors = sample_anchors(len(tokens), plen, 16, torch.Generator().manual_seed(0))
    assert torch.equal(walk_anchors(draft, tokens, taps, anchors, 0.0), anchors)
    half = walk_anchors(draft, tokens, taps, anchors, 0.5)
    kept = [a for a in anchors.tolist() if a in half.tolist()]
    assert len(half) <= 16 and len(kept) >= 8 and not torch.equal(half, anchors)
    log = train(draft, cache, str(tmp_path / "walk"), TrainConfig(steps=3, seqs_per_step=2, anchors_per_seq=8,
                                                                   walk_anchor_frac=0.5))
    assert log["step"] == 3 and log["loss"] > 0
    with pytest.raises(ValueError, match="walk_anchor_frac"):
        train(draft, cache, str(tmp_path / "bad"), TrainConfig(steps=1, walk_anchor_frac=1.5))


def _mean_accepted(hist: dict[int, int]) -> float:
    return sum(k * v for k, v in hist.items()) / sum(hist.values())


def test_training_resumes(distilled, tmp_path):
    _, target, dcfg, fc_dir, *_ = distilled
    out = str(tmp_path / "draft")
    cache = FeatureCache.open(fc_dir)
    train(init_dspark_draft(dcfg, target), cache, out, TrainConfig(steps=4, save_every=2, seqs_per_step=2))
    state = torch.load(os.path.join(out, "train_state.pt"), weights_only=False)
    assert state["step"] == 4
    more = train(init_dspark_draft(dcfg, target), cache, out,
                 TrainConfig(steps=6, save_every=2, seqs_per_step=2), log_every=1)
    assert more["step"] == 6       # resumed at 4, ran 2 more


def test_training_updates_every_draft_weight(distilled, tmp_path):
    """The backbone, fc, Markov and confidence heads all learn; only the shared embedding (and
    the shared LM head of a full-vocab draft) stay frozen. Inference layers are built with
    requires_grad=False, so a trainer that forgets to switch them on trains the norms alone."""
    _, target, dcfg, fc_dir, *_ = distilled
    draft = init_dspark_draft(dcfg, target)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    train(draft, FeatureCache.open(fc_dir), str(tmp_path / "draft"),
          TrainConfig(steps=3, seqs_per_step=2, anchors_per_seq=8, lr=1e-3))
    after = draft.state_dict()
    unchanged = sorted(k for k, v in before.items() if torch.equal(v, after[k]))
    assert unchanged == ["embed_tokens.weight", "lm_head.weight"], unchanged


def test_dropout_only_while_training(distilled, tmp_path):
    """Dropout perturbs the training forward (and so the update) and never the evaluation one,
    which validation and serving rely on."""
    _, target, dcfg, fc_dir, *_ = distilled
    cache = FeatureCache.open(fc_dir)
    tokens, taps, _, plen = cache.sequence(0)
    anchors = sample_anchors(len(tokens), plen, 8, torch.Generator().manual_seed(0))
    draft = init_dspark_draft(dcfg, target).eval()
    with torch.no_grad():
        ref = block_forward(draft, tokens, taps, anchors)[1]
        assert torch.equal(block_forward(draft, tokens, taps, anchors, dropout=0.5)[1], ref)
        draft.train()
        a, b = (block_forward(draft, tokens, taps, anchors, dropout=0.5)[1] for _ in range(2))
        assert not torch.allclose(a, ref) and not torch.allclose(a, b)
        assert torch.equal(block_forward(draft, tokens, taps, anchors)[1], ref)
    weights = []
    for p in (0.0, 0.5):
        d = init_dspark_draft(dcfg, target)
        train(d, cache, str(tmp_path / f"p{p}"), TrainConfig(steps=1, seqs_per_step=2, lr=1e-3, dropout=p))
        weights.append(d.fc.weight.detach().clone())
    assert not torch.equal(*weights)       # the trainer passes its dropout to the forward


def test_concatenated_caches_read_as_one(distilled, tmp_path):
    """Data added in a later run trains together with the first run's cache."""
    _, target, dcfg, fc_dir, prompts, _, seqs = distilled
    plens = [len(p) for p in prompts]
    halves = []
    for k, part in enumerate((slice(0, 20), slice(20, None))):
        d = str(tmp_path / f"half{k}")
        build_feature_cache(target, seqs[part], plens[part], dcfg["target_layer_ids"], d)
        halves.append(d)
    whole, both = FeatureCache.open(fc_dir), FeatureCache.open_all(halves)
    assert len(both) == len(whole) == len(seqs)
    for i in (0, 19, 20, len(seqs) - 1):
        for a, b in zip(both.sequence(i), whole.sequence(i)):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert torch.equal(both.response_token_counts(V), whole.response_token_counts(V))
    other = str(tmp_path / "other_taps")
    build_feature_cache(target, seqs[:2], plens[:2], [0], other)
    with pytest.raises(ValueError, match="different target layers"):
        FeatureCache.open_all([fc_dir, other])


def test_tap_subset_reads_as_its_own_capture(distilled, tmp_path):
    """One capture with many taps serves drafts tapping fewer layers: the subset (in the draft's
    order) reads exactly as a capture of just those layers; a layer not captured is refused."""
    _, target, _, _, prompts, _, seqs = distilled
    plens = [len(p) for p in prompts[:6]]
    caches = {}
    for taps in ([-1, 0, 1], [-1, 1], [0]):
        d = str(tmp_path / "_".join(map(str, taps)))
        build_feature_cache(target, seqs[:6], plens, taps, d)
        caches[tuple(taps)] = FeatureCache.open(d)
    wide = caches[(-1, 0, 1)]
    both = FeatureCache.open_all([str(tmp_path / "-1_0_1")] * 2)        # sequence 6 + i is sequence i
    views = (((-1, 1), wide.with_taps([-1, 1]), 0), ((0,), wide.with_taps([0, 1]).with_taps([0]), 5),
             ((-1, 1), both.with_taps([-1, 1]), 6 + 5))
    for sub, view, i in views:
        assert view.target_layer_ids == list(sub)
        for a, b in zip(view.sequence(i), caches[sub].sequence(i % 6)):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    with pytest.raises(ValueError, match="capture with --target-layer-ids 0,2"):
        wide.with_taps([0, 2])


def test_heldout_split_is_disjoint():
    from sparkserve.training.prompts import humaneval_prompts, split_sharegpt
    train_p, held = split_sharegpt(holdout=2000)
    assert len(held) > 1000 and all(len(p) == 1 for p in held)
    first = [p for p in train_p if len(p) == 1]
    assert len(first) > 10000 and train_p[:len(first)] == first     # first turns keep their offsets
    later = train_p[len(first):]
    assert len(later) > 10000
    assert all(p[-1]["role"] == "user" and sum(m["role"] == "user" for m in p) >= 2
               and sum(len(m["content"]) for m in p) <= 4000 for p in later)
    key = lambda p: p[-1]["content"]
    train_keys = {key(p) for p in train_p}
    assert not train_keys & {key(p) for p in held}
    he = humaneval_prompts()
    assert len(he) == 164
    assert not {key(p) for p in he} & train_keys


def test_sharegpt_prompts_bring_their_answers_for_prefill_labels(tmp_path):
    """--labels prefill|mix on ShareGPT: each training prompt is followed by the dataset's reply
    to it (what the prefill pass labels), the same prompts in the same order otherwise; the
    validation and held-out prompts stay bare (validation follows the target's own answers)."""
    from sparkserve.training.config import PipelineConfig
    from sparkserve.training.label_mix import split_answer
    from sparkserve.training.pipeline import stage_prompts
    from sparkserve.training.prompts import jsonl_prompts, split_sharegpt
    plain, held = split_sharegpt()
    with_answers, held2 = split_sharegpt(answers=True)
    assert held2 == held and [split_answer(p)[0] for p in with_answers] == plain
    answered = [p for p in with_answers if split_answer(p)[1] is not None]
    assert len(answered) > 0.99 * len(plain)
    assert any(len(p) > 2 for p in answered)                 # later turns too, history before them
    for labels, has in (("prefill", True), ("generated", False)):
        out = str(tmp_path / labels)
        stage_prompts(PipelineConfig(out=out, labels=labels, num_prompts=20, prompts_offset=100,
                                     val_prompts=3))
        train = jsonl_prompts(os.path.join(out, "prompts.jsonl"))
        assert [split_answer(p)[0] for p in train] == plain[100:120]
        assert all((split_answer(p)[1] is not None) == has for p in train)
        assert jsonl_prompts(os.path.join(out, "val", "prompts.jsonl")) == held[-3:]


def test_code_math_mix_spreads_each_kind_in_order(tmp_path):
    """--code-math-frac: every prefix of the reordered prompts holds the asked share of code and
    maths prompts (until they run out), each kind in its own order; on ShareGPT too."""
    from sparkserve.training.config import PipelineConfig
    from sparkserve.training.pipeline import stage_prompts
    from sparkserve.training.prompts import is_code_or_math, jsonl_prompts, mix_code_math
    user = lambda t: [{"role": "user", "content": t}]
    code = [user(f"Write a Python function that returns {i}.") for i in range(5)]
    code += [[user(f"Solve the equation x + {i} = 7."), user(f"What is {i} * 13?")][i % 2] for i in range(5)]
    chat = [user(f"Tell me a story about river number {i}.") for i in range(30)]
    assert all(map(is_code_or_math, code)) and not any(map(is_code_or_math, chat))
    mixed = mix_code_math(chat[:15] + code + chat[15:], 0.4)
    assert [p for p in mixed if p in code] == code and [p for p in mixed if p in chat] == chat
    assert [sum(p in code for p in mixed[:n]) for n in (5, 10, 20, 25, 40)] == [2, 4, 8, 10, 10]
    out = str(tmp_path / "mix")
    stage_prompts(PipelineConfig(out=out, code_math_frac=0.4, num_prompts=50, prompts_offset=10,
                                 val_prompts=0))
    train = jsonl_prompts(os.path.join(out, "prompts.jsonl"))
    assert len(train) == 50 and sum(map(is_code_or_math, train)) == 20


# ---- reduced draft vocab and the closed-form Markov start ------------------------------------
def _cache_with_lse(target, fc_dir: str, tmp_path) -> FeatureCache:
    """A copy of the shared cache with the teacher's lse.npy (reduced-vocab training needs it)."""
    import shutil

    from sparkserve.training.feature_cache import write_lse
    fc = str(tmp_path / "fc")
    shutil.copytree(fc_dir, fc)
    write_lse(fc, target.lm_head.weight)
    return FeatureCache.open(fc)


def _reduced_draft(dcfg, target, cache, size: int):
    from sparkserve.training.draft_vocab import select_draft_vocab
    vocab, cov = select_draft_vocab(cache.response_token_counts(V), size)
    return init_dspark_draft(dict(dcfg, draft_vocab_size=len(vocab)), target, vocab=vocab), vocab, cov


def test_reduced_vocab_teacher_equals_full_vocab_loss(distilled, tmp_path):
    """The reduced-vocab loss path (teacher rows of the target head + lse.npy, CE through the
    target->draft map, outside mass added to L1) gives the plain full-vocab losses when the draft
    vocab is every id (an identity d2t); and p_t on a strict subset is the full softmax's rows."""
    from sparkserve.training.train_dspark import Teacher, block_losses, sample_anchors
    _, target, dcfg, fc_dir, *_ = distilled
    cache = _cache_with_lse(target, fc_dir, tmp_path)
    tokens, taps, final, plen = cache.sequence(2)
    lse = cache.sequence_lse(2)
    anchors = sample_anchors(len(tokens), plen, 8, torch.Generator().manual_seed(0))
    cfg = TrainConfig()
    draft = init_dspark_draft(dcfg, target, seed=3)
    with torch.no_grad():
        want = block_losses(draft, tokens, taps, final, anchors, cfg)
        draft.d2t = torch.zeros(V, dtype=torch.long)          # identity map over every id
        draft.config.draft_vocab_size = V
        got = block_losses(draft, tokens, taps, final, anchors, cfg,
                           Teacher.for_draft(draft, target.lm_head.weight), lse)
    for key in ("ce", "l1", "conf", "tau_sum"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4)
    sub = Teacher.for_draft(init_dspark_draft(dict(dcfg, draft_vocab_size=10), target,
                                              vocab=torch.arange(0, V, 6)[:10]), target.lm_head.weight)
    p_sub = torch.exp(final[plen:] @ sub.head_rows.T - lse[plen:, None])
    p_full = torch.softmax(final[plen:] @ target.lm_head.weight.T, -1)[:, torch.arange(0, V, 6)[:10]]
    torch.testing.assert_close(p_sub, p_full, rtol=1e-4, atol=1e-6)
    assert lse[:plen].isnan().all()             # prompt rows: never read by training, not computed
    assert sub.t2d[6].item() == 1 and sub.t2d[1].item() == -1


@pytest.mark.parametrize("teacher", ["full", "reduced"])
def test_a_batch_of_sequences_sums_what_each_alone_gives(distilled, tmp_path, teacher):
    """blocks_losses over sequences of other lengths and anchor counts, one of them prefill-labelled
    (greedy labels, consistent_slots), in one padded forward: every loss sum and every gradient is
    the sum over the sequences run one at a time (float32 rounding apart)."""
    from sparkserve.training.blocks import BlockSeq
    from sparkserve.training.train_dspark import Teacher, blocks_losses
    _, target, dcfg, fc_dir, *_ = distilled
    cache = _cache_with_lse(target, fc_dir, tmp_path)
    cfg = TrainConfig()
    if teacher == "full":
        draft, tch = init_dspark_draft(dcfg, target, seed=3), None
    else:
        draft, *_ = _reduced_draft(dcfg, target, cache, 12)
        tch = Teacher.for_draft(draft, target.lm_head.weight)
    draft.requires_grad_(True)
    seqs = []
    for n, i in enumerate((0, 7, 19)):
        tokens, taps, final, plen = cache.sequence(i)
        anchors = sample_anchors(len(tokens), plen, (3, 8, 5)[n], torch.Generator().manual_seed(i))
        greedy = None
        if n == 1:              # the target's own answer, with one choice changed: slots past it drop
            greedy = cache.sequence_greedy(i).clone()
            greedy[anchors[2] + 1] = (greedy[anchors[2] + 1] + 1) % V
        seqs.append(BlockSeq(tokens, taps, anchors, final, cache.sequence_lse(i), greedy))
    assert len({len(s.tokens) for s in seqs}) > 1 and len({len(s.anchors) for s in seqs}) == 3

    def run(group):
        draft.zero_grad(set_to_none=True)
        out = blocks_losses(draft, group, cfg, tch)
        (out["ce"] + out["l1"] + out["conf"]).backward()
        return {k: v.detach() for k, v in out.items()}, [p.grad.clone() for p in draft.parameters()
                                                          if p.grad is not None]
    together, grads = run(seqs)
    alone = [run([s]) for s in seqs]
    for key in together:
        torch.testing.assert_close(together[key], sum(a[0][key] for a in alone), rtol=1e-5, atol=1e-5)
    for i, g in enumerate(grads):
        torch.testing.assert_close(g, sum(a[1][i] for a in alone), rtol=1e-4, atol=1e-6)
    # the prefill-labelled sequence really took greedy labels and dropped inconsistent slots
    plain = blocks_losses(draft, [BlockSeq(seqs[1].tokens, seqs[1].taps, seqs[1].anchors, seqs[1].final,
                                           seqs[1].lse)], cfg, tch)
    assert plain["wsum"] > alone[1][0]["wsum"]


def test_markov_fit_recovers_bigram(distilled):
    """On a target whose next token is a function of the current one, the fitted Markov bias
    alone (rank = vocab) predicts that function for every id seen as a previous token."""
    from sparkserve.training.markov_init import fit_markov_head, response_bigrams
    _, target, dcfg, fc_dir, *_ = distilled
    cache = FeatureCache.open(fc_dir)
    draft = init_dspark_draft(dcfg, target)
    energy = fit_markov_head(draft, cache)
    assert energy > 0.9
    prev, nxt = response_bigrams(cache)
    want = {}
    for a, b in zip(prev.tolist(), nxt.tolist()):
        want[a] = b
    ids = torch.tensor(sorted(want))
    with torch.no_grad():
        bias = draft.markov_head.bias(draft.markov_head.prev_embedding(ids), None)
    assert bias.argmax(-1).tolist() == [want[i] for i in sorted(want)]


def test_resume_scores_the_checkpoints_draft_vocab(distilled, tmp_path):
    """Resuming on a cache that would pick another draft vocab (more data since) keeps the
    checkpoint's d2t, and the teacher scores that vocab: the resumed step equals the step of a
    run whose draft was built with the checkpoint's vocab in the first place."""
    import shutil
    _, target, dcfg, fc_dir, *_ = distilled
    cache = _cache_with_lse(target, fc_dir, tmp_path)
    size = int((cache.response_token_counts(V) > 0).sum()) - 4
    draft, vocab, _ = _reduced_draft(dcfg, target, cache, size)
    cfg = dict(seqs_per_step=2, anchors_per_seq=8, lr=1e-3, save_every=2)
    head = target.lm_head.weight
    out = str(tmp_path / "a")
    train(draft, cache, out, TrainConfig(steps=2, **cfg), target_head=head)
    shutil.copytree(out, str(tmp_path / "b"))
    same = init_dspark_draft(dict(dcfg, draft_vocab_size=size), target, vocab=vocab)
    ref = train(same, cache, out, TrainConfig(steps=3, **cfg), log_every=1, target_head=head)
    other_vocab = torch.arange(V - size, V)
    assert not torch.equal(other_vocab, vocab)
    other = init_dspark_draft(dict(dcfg, draft_vocab_size=size), target, vocab=other_vocab)
    got = train(other, cache, str(tmp_path / "b"), TrainConfig(steps=3, **cfg), log_every=1,
                target_head=head)
    assert torch.equal(other.to_target_ids(torch.arange(size)), vocab)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), (got, ref)


def test_reduced_vocab_head_is_frozen_unless_asked(distilled, tmp_path):
    """A reduced vocab's LM head (the target's rows) stays frozen by default; a run that trained
    it resumes with the head frozen (fresh optimizer moments, the head as it was saved)."""
    _, target, dcfg, fc_dir, *_ = distilled
    cache = _cache_with_lse(target, fc_dir, tmp_path)
    size = int((cache.response_token_counts(V) > 0).sum()) - 4
    cfg = dict(seqs_per_step=2, anchors_per_seq=8, lr=1e-2, save_every=2)
    head = target.lm_head.weight
    frozen, vocab, _ = _reduced_draft(dcfg, target, cache, size)
    start = frozen.lm_head.weight.clone()
    train(frozen, cache, str(tmp_path / "frozen"), TrainConfig(steps=2, **cfg), target_head=head)
    assert torch.equal(frozen.lm_head.weight, start)
    out = str(tmp_path / "trained")
    trained, _, _ = _reduced_draft(dcfg, target, cache, size)
    train(trained, cache, out, TrainConfig(steps=2, train_lm_head=True, **cfg), target_head=head)
    saved = trained.lm_head.weight.clone()
    assert not torch.equal(saved, start)
    resumed = init_dspark_draft(dict(dcfg, draft_vocab_size=size), target, vocab=vocab)
    fc_before = trained.fc.weight.clone()
    assert train(resumed, cache, out, TrainConfig(steps=4, **cfg), target_head=head)["step"] == 4
    assert torch.equal(resumed.lm_head.weight, saved)
    assert not torch.equal(resumed.fc.weight, fc_before)


def test_reduced_vocab_draft_trains_and_serves_losslessly(bigram_target, distilled, tmp_path):
    """Reduced draft vocab end to end: lse cache, Markov fit, training, checkpoint with d2t, and
    greedy serving token-identical to plain decoding with a higher acceptance than untrained."""
    from sparkserve.models.dspark_draft import load_dspark_draft
    from sparkserve.training.markov_init import fit_markov_head
    path, _ = bigram_target
    eng, target, dcfg, fc_dir, prompts, outs, _ = distilled
    cache = _cache_with_lse(target, fc_dir, tmp_path)
    counts = cache.response_token_counts(V)
    size = int((counts > 0).sum()) - 4            # a few emitted ids stay outside the draft vocab
    draft, vocab, cov = _reduced_draft(dcfg, target, cache, size)
    assert len(vocab) == size and 0.5 < cov < 1.0, cov
    fit_markov_head(draft, cache)
    out = str(tmp_path / "draft")
    train(draft, cache, out, TrainConfig(steps=120, seqs_per_step=4, anchors_per_seq=16, lr=1e-2,
                                         save_every=60), log_every=20, target_head=target.lm_head.weight)
    loaded = load_dspark_draft(out, target)
    assert torch.equal(loaded.to_target_ids(torch.arange(size)), vocab)
    from sparkserve.models.dspark_draft import save_dspark_draft
    half = str(tmp_path / "half")                      # the shipping form: fp16 on disk
    save_dspark_draft(loaded, half, dtype=torch.float16)
    assert os.path.getsize(os.path.join(half, "model.safetensors")) < 0.6 * os.path.getsize(
        os.path.join(out, "model.safetensors"))
    small = load_dspark_draft(half, target)
    assert torch.equal(small.d2t, loaded.d2t)
    torch.testing.assert_close(small.fc.weight, loaded.fc.weight.half().float(), rtol=0, atol=0)
    spec = Engine(path, max_total_tokens=4096, speculative_algorithm="DSPARK",
                  speculative_draft_model_path=out, speculative_dspark_verify_mode="full")
    got = spec.generate(input_ids=prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                                "ignore_eos": True})
    assert [g["output_ids"] for g in got] == [o["output_ids"] for o in outs[:8]]
    hist = spec.scheduler.accept_hist
    assert _mean_accepted(hist) > 1.0, hist


def test_move_to_vocab_keeps_what_the_draft_knew(distilled):
    """A draft continued with a re-picked vocab keeps its backbone, its LM-head and Markov rows of
    the ids it knew; a new id's head row is the target's row carried along the drift the trained
    rows show, and its Markov row starts empty."""
    from sparkserve.training.draft_vocab import move_to_vocab
    _, target, dcfg, *_ = distilled
    head = target.lm_head.weight.detach().float()
    old_ids, new_ids = torch.arange(0, 40), torch.arange(20, 60)      # 20 known, 20 new ids
    old = init_dspark_draft(dict(dcfg, draft_vocab_size=40), target, vocab=old_ids, seed=1)
    new = init_dspark_draft(dict(dcfg, draft_vocab_size=40), target, vocab=new_ids, seed=2)
    move_to_vocab(old, new, head)         # an untrained (frozen) head: new rows are the target's
    torch.testing.assert_close(new.lm_head.weight, head[new_ids])
    drift = torch.eye(head.shape[1]) + 0.3 * torch.randn(head.shape[1], head.shape[1],
                                                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        old.lm_head.weight.copy_(head[old_ids] @ drift)
    move_to_vocab(old, new, head)
    got, old_state = new.state_dict(), old.state_dict()
    for k, v in old_state.items():
        if k not in ("lm_head.weight", "markov_head.markov_w2.weight", "d2t"):
            assert torch.equal(got[k], v), k
    assert torch.equal(new.to_target_ids(torch.arange(40)), new_ids)
    assert torch.equal(got["lm_head.weight"][:20], old_state["lm_head.weight"][20:])
    assert torch.equal(got["markov_head.markov_w2.weight"][:20],
                       old_state["markov_head.markov_w2.weight"][20:])
    assert not got["markov_head.markov_w2.weight"][20:].any()
    want = head[new_ids[20:]] @ drift
    err_moved = (got["lm_head.weight"][20:] - want).norm()
    err_plain = (head[new_ids[20:]] - want).norm()
    assert err_moved < 0.8 * err_plain, (err_moved, err_plain)
