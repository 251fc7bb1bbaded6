"""DSpark with oracle drafts: acceptance is exactly what the construction dictates, and stop
conditions inside accepted blocks are honoured exactly.

The target is a tiny random llama whose attention o_proj and MLP down_proj are zero, so its
greedy next token is a fixed function f(current token), computed here from the transformers
model. The oracle draft has zero base logits (final norm weight 0) and a Markov head with
markov_w1 = I, markov_w2[f(x), x] = 10: every draft is the target's choice, so every verify
accepts all it verifies. The wrong draft uses (f(x) + 1) % V: every verify accepts nothing."""
from __future__ import annotations

import pytest
from dspark_fixtures import (
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    load_hf,
    make_oracle_draft,
    make_target,
    next_token_map,
    zero_attn_and_mlp_out,
)

from sparkserve.core.forward_batch import ForwardMode

GAMMA = 4
V = 256


class Oracle:
    def __init__(self, root):
        self.target = make_target(str(root / "target"), "llama", edit=zero_attn_and_mlp_out)
        self.f = next_token_map(load_hf(self.target))
        self.oracle = make_oracle_draft(self.target, str(root / "oracle"), self.f, block_size=GAMMA)
        self.wrong = make_oracle_draft(self.target, str(root / "wrong"), self.f, block_size=GAMMA, shift=1)
        self.plain = engine(self.target)
        # The prompt whose chain x -> f(x) -> ... runs longest before repeating a token, so stop
        # tokens can be placed at every offset of the first blocks.
        def distinct_run(x):
            seen, out = set(), []
            while x not in seen:
                seen.add(x)
                x = self.f[x]
                out.append(x)
            return out
        best = max(range(V), key=lambda x: len(set(distinct_run(x))))
        self.prompt = [11, 12, best]
        self.run = [t for i, t in enumerate(distinct_run(best)) if t not in distinct_run(best)[:i]]
        # Same weights (same seed), with an EOS id: for the EOS-inside-a-block case.
        self.eos_token = self.run[7]
        self.target_eos = make_target(str(root / "target_eos"), "llama", edit=zero_attn_and_mlp_out,
                                      eos_token_id=self.eos_token)

    def chain(self, prompt: list[int], n: int) -> list[int]:
        out = [self.f[prompt[-1]]]
        while len(out) < n:
            out.append(self.f[out[-1]])
        return out


@pytest.fixture(scope="module")
def orc(tmp_path_factory):
    o = Oracle(tmp_path_factory.mktemp("dspark_oracle"))
    assert len(o.run) >= 12, "the tiny target's greedy chain repeats too early for the stop tests"
    return o


def recorded(eng):
    """Wrap the planner so each proposal's (cap, verify_len) is logged on eng.plan_log."""
    eng.plan_log = []
    planner = eng.scheduler.spec.planner
    orig = planner.plan

    def plan(confidences, caps, plain_tokens=0):
        lens = orig(confidences, caps, plain_tokens)
        eng.plan_log.extend(zip(caps, lens))
        return lens
    planner.plan = plan
    return eng


def expected_verifies(max_new: int, per_cycle: int) -> int:
    """Verify cycles of one request whose every cycle commits `per_cycle` tokens (capped at the
    tokens left - the last token is never speculated: with one token left it is a plain decode)."""
    n, cycles = 1, 0                      # the first token comes from prefill
    while n + 1 < max_new:
        n += min(per_cycle, max_new - n)
        cycles += 1
    return cycles


PROMPTS = [[5, 6, 7], [1], list(range(30, 52))]
MAX_NEW = [30, 23, 17]


@pytest.mark.parametrize("mode", ["full", "threshold", "adaptive"])
def test_oracle_draft_accepts_everything_it_verifies(orc, mode, tmp_path):
    kw = {}
    if mode == "adaptive":
        sps = tmp_path / "sps.json"
        sps.write_text('{"tokens": [1, 64], "seconds": [1.0, 16.75]}')
        kw["speculative_dspark_sps_table_path"] = str(sps)
    eng = recorded(engine(orc.target, orc.oracle, mode, **kw))
    params = [dict(temperature=0, max_new_tokens=m) for m in MAX_NEW]
    out = generate_ids(eng, PROMPTS, params)
    assert out == generate_ids(orc.plain, PROMPTS, params)
    assert out == [orc.chain(p, m) for p, m in zip(PROMPTS, MAX_NEW)]       # vs transformers' f
    hist = eng.scheduler.accept_hist
    # Every verify accepts all the drafts it verified: the accepted counts are exactly the lens
    # (a proposal with nothing to verify decodes plainly).
    lens = sorted(n for _, n in eng.plan_log if n > 0)
    assert sorted(k for k, c in hist.items() for _ in range(c)) == lens
    if mode == "full":
        uncapped = [n for c, n in eng.plan_log if c == GAMMA]
        assert uncapped and sum(uncapped) / len(uncapped) == GAMMA          # acceptance == gamma
        assert sum(hist.values()) == sum(expected_verifies(m, GAMMA + 1) for m in MAX_NEW)
        assert set(hist) - {GAMMA} <= {c for c, _ in eng.plan_log if c < GAMMA}
    assert_no_kv_leak(eng)


def test_wrong_draft_accepts_nothing(orc):
    n_new = 20
    eng = recorded(engine(orc.target, orc.wrong, "full"))
    prompt = [5, 6, 7]
    out = eng.generate(input_ids=prompt, sampling_params=dict(temperature=0,
                                                              max_new_tokens=n_new))["output_ids"]
    assert out == orc.chain(prompt, n_new)
    ref = orc.plain.generate(input_ids=prompt, sampling_params=dict(temperature=0, max_new_tokens=n_new))
    assert out == ref["output_ids"]
    sched = eng.scheduler
    assert set(sched.accept_hist) == {0}
    # One token per cycle: after the prefill token, every target forward yields exactly one token -
    # n_new - 2 verifies (each rejects d_1 and commits the bonus) and one plain decode for the last
    # token (with one token left there is nothing to speculate).
    fc = sched.forward_count
    assert fc[ForwardMode.VERIFY] + fc[ForwardMode.DECODE] == n_new - 1
    assert fc[ForwardMode.VERIFY] == sched.accept_hist[0] == n_new - 2
    assert all(n == c for c, n in eng.plan_log)            # full mode verified every draft
    assert_no_kv_leak(eng)


@pytest.mark.parametrize("page_size", [1, 4])
def test_stop_token_inside_accepted_block(orc, page_size):
    """One request per stop position k: the stop token is the k-th output, at every offset inside
    the accepted blocks (drafts after it in the same block were accepted by the target too).
    Output == plain decoding truncated at the stop, finish reason stop, no KV leak."""
    run = orc.run
    ks = list(range(1, 12))
    params = [dict(temperature=0, max_new_tokens=40, stop_token_ids=[run[k]]) for k in ks]
    prompts = [orc.prompt] * len(ks)
    eng = engine(orc.target, orc.oracle, "full", page_size=page_size)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    ref = orc.plain.generate(input_ids=prompts, sampling_params=params)
    for k, o, r in zip(ks, outs, ref):
        assert o["output_ids"] == r["output_ids"] == run[:k + 1]
        assert o["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"]
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
    assert set(eng.scheduler.accept_hist) == {GAMMA}
    assert_no_kv_leak(eng)
    # The cache is sound afterwards: continuing a stopped sequence hits the prefix cache (its KV
    # up to the stop token) and still gives the oracle chain.
    cont = orc.prompt + run[:6]
    again = eng.generate(input_ids=cont, sampling_params=dict(temperature=0, max_new_tokens=15))
    assert again["output_ids"] == orc.chain(cont, 15)
    assert again["meta_info"]["cached_tokens"] >= 8
    assert_no_kv_leak(eng)


def test_eos_inside_accepted_block(orc):
    """EOS from the model config ends the request inside a block; ignore_eos runs through it."""
    prompt = orc.prompt
    k = orc.run.index(orc.eos_token)
    eng = engine(orc.target_eos, orc.oracle, "full")
    plain = engine(orc.target_eos)
    for ignore in (False, True):
        p = dict(temperature=0, max_new_tokens=20, ignore_eos=ignore)
        o = eng.generate(input_ids=prompt, sampling_params=p)
        assert o["output_ids"] == plain.generate(input_ids=prompt, sampling_params=p)["output_ids"]
        assert o["output_ids"] == (orc.chain(prompt, 20) if ignore else orc.run[:k + 1])
    assert_no_kv_leak(eng)


@pytest.mark.parametrize("page_size", [1, 4])
def test_max_new_tokens_not_multiple_of_block(orc, page_size):
    max_new = [2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 19]
    prompts = [[9, 10 + i] for i in range(len(max_new))]
    params = [dict(temperature=0, max_new_tokens=m) for m in max_new]
    eng = engine(orc.target, orc.oracle, "full", page_size=page_size)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    for p, m, o in zip(prompts, max_new, outs):
        assert o["output_ids"] == orc.chain(p, m)
        assert o["meta_info"]["finish_reason"]["type"] == "length"
    assert sum(eng.scheduler.accept_hist.values()) == sum(expected_verifies(m, GAMMA + 1) for m in max_new)
    assert_no_kv_leak(eng)


def test_min_new_tokens_bans_stop_inside_block(orc):
    """min_new_tokens bans the stop token for the first tokens: plain decoding picks the runner-up
    there, so a verify that accepted the (banned) stop token would diverge from plain decoding."""
    prompt = orc.prompt
    stop = orc.run[2]
    params = dict(temperature=0, max_new_tokens=24, min_new_tokens=9, stop_token_ids=[stop])
    eng = engine(orc.target, orc.oracle, "full")
    out = eng.generate(input_ids=prompt, sampling_params=params)
    ref = orc.plain.generate(input_ids=prompt, sampling_params=params)
    assert out["output_ids"] == ref["output_ids"]
    assert len(out["output_ids"]) >= 9 and out["output_ids"][2] != stop
    assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert max(eng.scheduler.accept_hist) == GAMMA          # speculation resumed after the ban
    assert_no_kv_leak(eng)


def test_generation_up_to_the_context_end(orc, tmp_path):
    """prompt + max_new_tokens == the context length: the draft block's mask slots then run past
    the last position (they are never verified) and must not break the draft's RoPE table.
    Also overrides the block size (--speculative-dspark-block-size 6)."""
    target = make_target(str(tmp_path / "t48"), "llama", edit=zero_attn_and_mlp_out,
                         max_position_embeddings=48)
    draft = make_oracle_draft(target, str(tmp_path / "d48"), orc.f, block_size=GAMMA)
    prompt = list(range(40, 70))
    for gamma in (GAMMA, 6):
        eng = engine(target, draft, "full", speculative_dspark_block_size=gamma)
        out = eng.generate(input_ids=prompt, sampling_params=dict(temperature=0, max_new_tokens=18))
        assert out["output_ids"] == orc.chain(prompt, 18)
        assert max(eng.scheduler.accept_hist) == gamma
        assert_no_kv_leak(eng)


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_speculators_layout_slot_shift(orc, tmp_path, sample_from_anchor):
    """The oracle draft re-exported in the speculators layout: with sample_from_anchor slot 0
    predicts the anchor itself and is dropped, so a block of 4 yields 3 drafts (all accepted)."""
    import json
    import shutil
    path = tmp_path / "spec"
    shutil.copytree(orc.oracle, path)
    cfg = json.loads((path / "config.json").read_text())
    dims = {k: cfg.pop(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                    "rope_theta", "max_position_embeddings")}
    spec_cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
                "transformer_layer_config": dict(dims, model_type="qwen3"),
                "aux_hidden_state_layer_ids": cfg["target_layer_ids"],
                "sample_from_anchor": sample_from_anchor,
                "block_size": cfg["block_size"], "mask_token_id": cfg["mask_token_id"],
                "markov_rank": cfg["markov_rank"], "markov_head_type": "vanilla",
                "enable_confidence_head": True}
    (path / "config.json").write_text(json.dumps(spec_cfg))
    eng = recorded(engine(orc.target, str(path), "full"))
    drafts = GAMMA - int(sample_from_anchor)
    assert eng.scheduler.spec.num_drafts == drafts
    out = generate_ids(eng, PROMPTS, [dict(temperature=0, max_new_tokens=m) for m in MAX_NEW])
    assert out == [orc.chain(p, m) for p, m in zip(PROMPTS, MAX_NEW)]
    uncapped = [n for c, n in eng.plan_log if c == drafts]
    assert uncapped and set(uncapped) == {drafts}
    assert set(eng.scheduler.accept_hist) - {drafts} <= {c for c, _ in eng.plan_log if c < drafts}
    assert_no_kv_leak(eng)


def test_spec_stats_in_meta_info_and_metrics(orc):
    """meta_info carries SGLang's spec_* fields, and /metrics' gauges agree with
    the scheduler's accept histogram."""
    from sparkserve.entrypoints.metrics import Metrics
    eng = engine(orc.target, orc.oracle)
    n = 2 + 2 * (GAMMA + 1)              # prefill token + 2 full cycles + 1 capped cycle
    out = eng.generate(input_ids=[orc.prompt], sampling_params={"temperature": 0, "max_new_tokens": n,
                                                                 "ignore_eos": True})
    meta = out[0]["meta_info"]
    assert meta["spec_verify_ct"] == sum(eng.scheduler.accept_hist.values())
    # every token after the prefill's comes from a verify cycle, but the very last may be decoded
    # plainly (nothing is left to draft for it)
    committed = meta["spec_accept_token_num"] + meta["spec_verify_ct"]     # accepted drafts + bonus tokens
    assert n - 2 <= committed <= n - 1
    # SGLang's definitions: accept length = completion tokens per cycle, accept rate = accepted / drafted
    assert meta["spec_accept_length"] == pytest.approx(n / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] > 2
    assert meta["spec_accept_rate"] == 1.0 and meta["spec_draft_token_num"] == meta["spec_accept_token_num"]
    plain = eng.generate(input_ids=[orc.prompt], sampling_params={"temperature": 0, "max_new_tokens": 1})
    assert "spec_verify_ct" not in plain[0]["meta_info"]
    m = Metrics("m")
    m.set_load(eng.scheduler.load())
    text = m.render().decode()
    hist = eng.scheduler.accept_hist
    cycles = sum(hist.values())
    assert f'sglang:spec_verify_count{{model_name="m"}} {float(cycles)}' in text
    mean = sum((k + 1) * v for k, v in hist.items()) / cycles
    line = next(l for l in text.splitlines() if l.startswith("sglang:spec_accept_length{"))
    assert float(line.split()[-1]) == pytest.approx(mean)


def test_tight_pool_drops_drafts_before_retracting(orc):
    """When the pool holds every request's tokens but not their draft blocks, requests verify
    fewer drafts (down to plain decoding) instead of retracting each other; output unchanged."""
    n = 20
    prompts = [orc.prompt, [5, orc.prompt[-1]], [7, 8, orc.prompt[-1]], [9, orc.prompt[-1]]]
    pool = sum(len(p) + n for p in prompts)
    eng = engine(orc.target, orc.oracle, max_total_tokens=pool, disable_radix_cache=True)
    got = generate_ids(eng, prompts, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    assert got == [orc.chain(p, n) for p in prompts]
    assert eng.scheduler.num_retractions == 0
    assert eng.scheduler.accept_hist                   # it did speculate while there was room
    assert_no_kv_leak(eng)
