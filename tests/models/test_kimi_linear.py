"""Kimi-Linear (KDA + MLA + MoE) against transformers, on tiny random checkpoints saved with
save_pretrained (original Kimi tensor names: block_sparse_moe, per-expert w1/w2/w3, q/k/v_conv1d).

Logits and aux taps match a full transformers forward; incremental decode, chunked prefill, mixed
batches and reused request rows match it too (KDA state resets at position 0 and carries over
otherwise); the Engine's batched greedy output equals one-by-one; DSpark greedy output equals plain
decoding with drafts partly rejected (so VERIFY's state rollback matters), under both rollback
strategies; a pool too small for the batch retracts and still gives the same output."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import (
    assert_no_kv_leak,
    dspark_single_thread,  # noqa: F401 (autouse)
    engine,
    generate_ids,
    make_oracle_draft,
    make_random_draft,
)
from kimi_fixtures import CONFIGS, VOCAB, make_kimi

from sparkserve.core.forward_batch import ForwardMode
from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
from sparkserve.layers.kda import KimiDeltaAttention, kda_chunked, kda_recurrent
from sparkserve.mem.cache_manager import KVCacheManager
from sparkserve.models.registry import load_config, load_model

GAMMA = 4


def load_hf(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval().requires_grad_(False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    out = {}
    for name in CONFIGS:
        path = make_kimi(str(root / name), name)
        out[name] = (path, load_hf(path))
    return out


class Driver:
    """Feeds chunks of several sequences through ModelRunner as the scheduler does and keeps the
    logits of every row."""

    def __init__(self, path: str, num_slots: int = 512, rows: int = 8):
        self.model = load_model(path, load_config(path))
        self.cache = KVCacheManager(num_slots, 1, rows, 400, disable_radix_cache=True)
        self.pool = self.model.make_pool(num_slots, rows)
        self.runner = ModelRunner(self.model, self.pool, self.cache.req_to_token.table)
        self.table = self.cache.req_to_token.table

    def new_seq(self) -> dict:
        return {"row": self.cache.req_to_token.alloc(), "tokens": [], "logits": []}

    def free(self, seq: dict) -> None:
        self.cache.allocator.free(self.table[seq["row"], :len(seq["tokens"])].clone())
        self.cache.req_to_token.free(seq["row"])

    def step(self, work: list[tuple[dict, list[int]]], mode: ForwardMode | None = None):
        sched = []
        for seq, toks in work:
            n0 = len(seq["tokens"])
            slots = self.cache.allocator.alloc(n0, len(toks), 0)
            self.table[seq["row"], n0:n0 + len(toks)] = slots
            sched.append(ScheduledReq(seq["row"], n0, list(toks), slots, logit_rows=len(toks)))
        if mode is None:
            mode = ForwardMode.DECODE if all(len(t) == 1 for _, t in work) else ForwardMode.EXTEND
        fb = self.runner.build_batch(mode, sched)
        logits = self.runner.forward(fb)
        off = 0
        for seq, toks in work:
            seq["logits"].append(logits[off:off + len(toks)])
            seq["tokens"] += toks
            off += len(toks)
        return fb

    @staticmethod
    def logits(seq: dict) -> torch.Tensor:
        return torch.cat(seq["logits"])


@torch.inference_mode()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max |diff| {err:.3g} vs logit scale {ref.abs().max():.3g}"


def prompts(lengths, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# ---- numerics -----------------------------------------------------------------------------------
def test_chunked_equals_recurrent():
    """The WY chunked form over several chunks (with a padded tail) is the token recurrence."""
    torch.manual_seed(0)
    B, H, L, D = 2, 3, 21, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, L, D), dim=-1) for _ in range(2))
    v = torch.randn(B, H, L, D)
    g = -torch.rand(B, H, L, D) * 2
    beta = torch.rand(B, H, L)
    S0 = torch.randn(B, H, D, D)
    o_ref, s_ref, _ = kda_recurrent(q, k, v, g, beta, S0)
    o, s = kda_chunked(q, k, v, g, beta, S0, chunk=8)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_and_taps_match_transformers(ckpts, name):
    """One EXTEND batch of two prompts (70 tokens: two KDA chunks; 23 tokens) vs transformers,
    and aux taps after every layer kind equal transformers' hidden_states[l + 1]."""
    path, hf = ckpts[name]
    d = Driver(path)
    n_layers = CONFIGS[name]["num_hidden_layers"]
    taps = list(range(-1, n_layers - 1))
    d.model.set_aux_layers(taps)
    a, b = d.new_seq(), d.new_seq()
    pa, pb = prompts([70, 23])
    fb = d.step([(a, pa), (b, pb)])
    for seq, p, rows in ((a, pa, slice(0, 70)), (b, pb, slice(70, 93))):
        assert_close(d.logits(seq), hf_logits(hf, p))
        with torch.inference_mode():
            hs = hf(torch.tensor([p]), output_hidden_states=True).hidden_states
        for tap, l in zip(fb.aux_hidden, taps):
            assert torch.allclose(tap[rows], hs[l + 1][0], atol=1e-4, rtol=1e-4), f"tap {l}"


def test_incremental_and_chunked_match_full(ckpts):
    """Prefill then token-by-token decode; a chunked prefill sharing EXTEND batches with a
    request's single decode tokens; a 1-token prompt starting inside a DECODE batch; and a
    request reusing a freed row (stale state must be reset) — all equal one full forward."""
    path, hf = ckpts["kda_mla"]
    d = Driver(path)
    pa, pb, pc, pd = prompts([30, 26, 1, 12], seed=3)
    full_a, full_b = pa + prompts([9], seed=4)[0], pb
    a, b = d.new_seq(), d.new_seq()
    d.step([(a, pa)])
    for i, t in enumerate(full_a[30:]):               # a decodes while b prefills in chunks of 7
        chunk = pb[7 * i:7 * i + 7]
        d.step([(a, [t])] + ([(b, chunk)] if chunk else []))
    c = d.new_seq()
    d.step([(a, [0]), (c, pc)])                       # DECODE batch with a new request at position 0
    full_a = full_a + [0]
    assert_close(d.logits(a), hf_logits(hf, full_a))
    assert_close(d.logits(b), hf_logits(hf, full_b))
    assert_close(d.logits(c), hf_logits(hf, pc))
    d.free(a)
    e = d.new_seq()
    assert e["row"] == a["row"], "the freed row is reused"
    d.step([(e, pd[:5]), (b, [1])])
    d.step([(e, pd[5:])])
    assert_close(d.logits(e), hf_logits(hf, pd))
    assert_close(d.logits(b), hf_logits(hf, full_b + [1]))


def test_verify_commit_keeps_prefix_state(ckpts):
    """VERIFY over anchor + drafts, commit k of them: the state equals feeding just those k."""
    path, hf = ckpts["kda_mla"]
    d = Driver(path)
    p = prompts([11], seed=5)[0]
    extra = prompts([5], seed=6)[0]
    a, b = d.new_seq(), d.new_seq()
    d.step([(a, p), (b, p[:4])])
    fb = d.step([(a, extra), (b, extra[:3])], mode=ForwardMode.VERIFY)
    assert_close(d.logits(a), hf_logits(hf, p + extra))
    d.runner.commit_verify(fb, [2, 3])
    for seq, n in ((a, 2), (b, 3)):        # drop the rejected tokens' bookkeeping (KV is positional)
        seq["tokens"] = seq["tokens"][:-5 if seq is a else -3] + extra[:n]
        seq["logits"][-1] = seq["logits"][-1][:n]
    d.step([(a, [9]), (b, [9])])
    assert_close(d.logits(a), hf_logits(hf, p + extra[:2] + [9]))
    assert_close(d.logits(b), hf_logits(hf, p[:4] + extra[:3] + [9]))


def test_loads_transformers_runtime_names(ckpts, tmp_path):
    """A checkpoint in transformers' runtime layout (mlp.experts.gate_up_proj stacked, one
    conv1d, forget_gate.*) loads to the same model as the original layout."""
    import shutil

    from safetensors.torch import save_file
    path, hf = ckpts["mla_kda"]
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    state = hf.state_dict()
    assert any(".mlp.experts.gate_up_proj" in k for k in state) and any(".conv1d." in k for k in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    a, b = Driver(path), Driver(str(tmp_path))
    p = prompts([9])[0]
    sa, sb = a.new_seq(), b.new_seq()
    a.step([(sa, p)])
    b.step([(sb, p)])
    assert torch.equal(a.logits(sa), b.logits(sb))


def test_original_config_fields():
    """The released checkpoints' config.json names (1-indexed linear_attn_config layer lists,
    first_k_dense_replace, num_experts_per_token, ...) parse like transformers' names."""
    from sparkserve.models.kimi_linear import KimiArgs
    raw = {"linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7],
                                  "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
           "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_token": 8,
           "num_shared_experts": 1, "moe_renormalize": True, "num_expert_group": 1, "mla_use_nope": True,
           "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446}
    a = KimiArgs.from_raw(raw, 8)
    assert a.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert a.mlp_types == ["dense"] + ["sparse"] * 7
    assert (a.num_experts, a.top_k, a.num_shared, a.linear_heads, a.conv_kernel) == (256, 8, 1, 32, 4)
    with pytest.raises(ValueError, match="mla_use_nope"):
        KimiArgs.from_raw(dict(raw, mla_use_nope=False), 8)


def test_pool_components(ckpts):
    d = Driver(ckpts["kda_mla"][0])
    comps = {c.name: c for c in d.pool.components()}
    assert {n: c.kind for n, c in comps.items()} == {
        "kv_latent": "token_page", "kda_state": "request_row", "kda_conv": "request_row"}
    assert comps["kv_latent"].layer_ids == [1, 3] and comps["kda_state"].layer_ids == [0, 2]
    assert comps["kv_latent"].bytes_per_item == (16 + 8) * 4
    assert comps["kda_state"].bytes_per_item == 4 * 16 * 16 * 4
    assert comps["kda_conv"].bytes_per_item == 3 * (3 * 64) * 4
    assert d.model.pool_bytes_per_token() == 2 * (16 + 8) * 4
    assert d.model.has_request_state


# ---- serving ------------------------------------------------------------------------------------
LENGTHS = (1, 5, 17, 40, 9)
MAX_NEW = 12


@pytest.fixture(scope="module")
def served(ckpts, tmp_path_factory):
    """Plain greedy outputs of the mixed batch, and drafts for the target."""
    path = ckpts["kda_mla"][0]
    ps = prompts(LENGTHS, seed=11)
    params = dict(temperature=0, max_new_tokens=MAX_NEW)
    plain = engine(path)
    ref = generate_ids(plain, ps, params)
    assert_no_kv_leak(plain)
    root = tmp_path_factory.mktemp("kimi_drafts")
    bigram = [0] * VOCAB
    for p, o in zip(ps, ref):
        seq = p[-1:] + o
        for x, y in zip(seq, seq[1:]):
            bigram[x] = y
    drafts = {"random": make_random_draft(path, str(root / "random"), block_size=GAMMA),
              "fitted": make_oracle_draft(path, str(root / "fitted"), bigram, block_size=GAMMA)}
    return dict(path=path, prompts=ps, params=params, ref=ref, drafts=drafts)


def test_batched_equals_one_by_one(served):
    eng = engine(served["path"])
    one = [generate_ids(eng, [p], served["params"])[0] for p in served["prompts"]]
    assert one == served["ref"]
    assert all(len(o) == MAX_NEW for o in one)


@pytest.mark.parametrize("draft,mode,rollback", [("fitted", "full", "replay"), ("fitted", "threshold",
                                                                                "replay"),
                                                 ("random", "full", "replay"), ("fitted", "full",
                                                                                "snapshot")])
def test_dspark_greedy_matches_plain(served, monkeypatch, draft, mode, rollback):
    monkeypatch.setattr(KimiDeltaAttention, "rollback", rollback)
    eng = engine(served["path"], served["drafts"][draft], mode)
    assert generate_ids(eng, served["prompts"], served["params"]) == served["ref"]
    sched = eng.scheduler
    assert sched.forward_count[ForwardMode.VERIFY] > 0
    hist = sched.accept_hist
    if mode == "full":       # (threshold: a block cut to no drafts decodes plainly, not counted)
        assert hist.get(0, 0) > 0, hist                                  # rejections happened
    if draft == "fitted":                                                # and partial accepts
        assert any(0 < k < GAMMA for k in hist) and max(hist) >= 2, hist
    assert_no_kv_leak(eng)


@pytest.mark.parametrize("spec,extra", [(False, {}), (True, {}),
                                        (True, dict(page_size=4, chunked_prefill_size=4))])
def test_retraction_matches_big_pool(served, spec, extra):
    """A 72-token pool cannot hold the batch: requests are retracted (their rows freed, later
    re-admitted from position 0), with DSpark and with paged + chunked prefill too."""
    draft = served["drafts"]["fitted"] if spec else None
    eng = engine(served["path"], draft, "threshold" if extra else "full", max_total_tokens=72, **extra)
    assert generate_ids(eng, served["prompts"], served["params"]) == served["ref"]
    assert eng.scheduler.num_retractions > 0
    assert_no_kv_leak(eng)
