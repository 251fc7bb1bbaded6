"""Helpers for the DSpark tests (imported by tests/test_dspark_*.py; not a conftest).

Tiny random HF targets saved with save_pretrained, random DSpark drafts in DeepSpec format, and
"oracle" drafts whose Markov head predicts the target's greedy token exactly (or never)."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

TARGET_SEED = 4321


@pytest.fixture(scope="module", autouse=True)
def dspark_single_thread():
    """One torch thread while a DSpark test module runs (tiny models on a shared, loaded CPU run
    far faster single-threaded); the previous setting is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_target_config(arch: str = "llama", **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
        initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False)
    if arch == "qwen3":
        cfg.update(head_dim=32, tie_word_embeddings=True)
    cfg.update(over)
    return cfg


def make_target(path: str, arch: str = "llama", seed: int = TARGET_SEED, edit=None, **over: Any) -> str:
    """A random tiny HF checkpoint; `edit(model)` may change weights before saving."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **tiny_target_config(arch, **over))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(path)
    return path


def load_hf(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval().requires_grad_(False)


def make_random_draft(target_dir: str, draft_dir: str, *, num_layers: int = 1, block_size: int = 4,
                      mask_token_id: int = 3, markov_rank: int = 16, std: float = 0.2, seed: int = 0,
                      include_shared: bool = True, **kw: Any) -> str:
    from sparkserve.config import ModelConfig
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft, save_dspark_draft
    cfg = dspark_config_dict(ModelConfig.from_hf_dir(target_dir), num_layers=num_layers,
                             block_size=block_size, mask_token_id=mask_token_id,
                             markov_rank=markov_rank, **kw)
    save_dspark_draft(init_dspark_draft(cfg, seed=seed, std=std), draft_dir, include_shared=include_shared)
    return draft_dir


def zero_attn_and_mlp_out(model) -> None:
    """With every o_proj and down_proj zero the residual stream is the token embedding, so the
    greedy next token is a fixed function f(current token)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


@torch.inference_mode()
def next_token_map(hf_model) -> list[int]:
    """f(x): the target's greedy next token after the single token x (position 0). With the
    attention/MLP outputs zeroed this does not depend on position or context."""
    V = hf_model.config.vocab_size
    logits = hf_model(torch.arange(V)[:, None]).logits[:, -1]
    return logits.argmax(-1).tolist()


def make_oracle_draft(target_dir: str, draft_dir: str, f: list[int], *, block_size: int = 4,
                      shift: int = 0, mask_token_id: int = 3, dtype: torch.dtype | None = None) -> str:
    """A draft whose slot logits are 10 * onehot((f(prev) + shift) % V): base logits are zero
    (final norm weight 0), markov_w1 = I, markov_w2[(f(x) + shift) % V, x] = 10.
    shift 0: always right; shift 1: always wrong (as long as f has no fixed point issues)."""
    from sparkserve.config import ModelConfig
    from sparkserve.models.dspark_draft import dspark_config_dict, init_dspark_draft, save_dspark_draft
    V = len(f)
    cfg = dspark_config_dict(ModelConfig.from_hf_dir(target_dir), num_layers=1, block_size=block_size,
                             mask_token_id=mask_token_id, markov_rank=V)
    d = init_dspark_draft(cfg, std=0.2)
    with torch.no_grad():
        d.norm.weight.zero_()
        d.markov_head.markov_w1.weight.copy_(torch.eye(V))
        w2 = torch.zeros(V, V)
        for x in range(V):
            w2[(f[x] + shift) % V, x] = 10.0
        d.markov_head.markov_w2.weight.copy_(w2)
    save_dspark_draft(d, draft_dir, include_shared=True, dtype=dtype)
    return draft_dir


def engine(model_dir: str | None, draft_dir: str | None = None, mode: str = "full", **kw: Any):
    from sparkserve import Engine
    kw.setdefault("max_total_tokens", 4096)
    # Exact activations: check_draft_context recomputes the draft context from transformers' taps,
    # which int8 rounding of the draft's inputs would move (the int8 draft: test_dspark_checkpoint).
    kw.setdefault("activation_quant", "none")
    if draft_dir is not None:
        kw.update(speculative_algorithm="DSPARK", speculative_draft_model_path=draft_dir,
                  speculative_dspark_verify_mode=mode)
        if mode == "threshold":
            kw.setdefault("speculative_dspark_confidence_threshold", 0.5)
    return Engine(model_dir, **kw)


def embedded_engine_pair():
    """The embedded SmolLM2 served plainly and with its shipped DSpark draft (verify mode full: every
    cycle drafts), at its default activations: the grammar tests' pair."""
    from sparkserve import Engine
    plain = Engine(max_total_tokens=4096, max_running_requests=4)
    spec = Engine(max_total_tokens=4096, max_running_requests=4, speculative_algorithm="DSPARK",
                  speculative_dspark_verify_mode="full")
    return plain, spec


def generate_ids(eng, prompts: list[list[int]], params: list[dict] | dict) -> list[list[int]]:
    out = eng.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in out]


def assert_no_kv_leak(eng) -> None:
    cache = eng.scheduler.cache
    assert cache.radix.protected_size == 0, f"locked radix nodes remain: {cache.radix.protected_size}"
    assert cache.allocator.free_slots + cache.radix.evictable_size == cache.num_slots, (
        f"KV leak: free {cache.allocator.free_slots} + cached {cache.radix.evictable_size} "
        f"!= pool {cache.num_slots}")
    assert not eng.scheduler.has_work()


# ---- chi-square goodness of fit, by hand (no scipy) --------------------------------------------
def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) (series / continued fraction, as in Numerical
    Recipes' gammq)."""
    import math
    if x <= 0:
        return 1.0
    gln = math.lgamma(a)
    if x < a + 1:                       # series for P(a, x)
        ap, s = a, 1.0 / a
        term = s
        for _ in range(10000):
            ap += 1
            term *= x / ap
            s += term
            if abs(term) < abs(s) * 1e-15:
                break
        return 1.0 - s * math.exp(-x + a * math.log(x) - gln)
    tiny = 1e-300                       # Lentz continued fraction for Q(a, x)
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - gln) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df)."""
    return _gamma_q(df / 2.0, x / 2.0)


def chi2_critical(df: int, alpha: float) -> float:
    """The x with chi2_sf(x, df) = alpha (bisection)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def chi_square_gof(counts, probs, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of observed `counts` against cell probabilities `probs` (same length,
    sums to 1), after pooling the cells whose expected count is below `min_expected`. Returns
    (statistic, degrees of freedom). Raises AssertionError if a zero-probability cell was hit."""
    counts = [float(c) for c in counts]
    probs = [float(p) for p in probs]
    n = sum(counts)
    impossible = [i for i, (c, p) in enumerate(zip(counts, probs)) if p <= 0 and c > 0]
    assert not impossible, f"outcomes with probability 0 were drawn: cells {impossible[:10]}"
    cells = sorted(((p * n, c) for c, p in zip(counts, probs) if p > 0), key=lambda t: t[0])
    big = [t for t in cells if t[0] >= min_expected]
    small = [t for t in cells if t[0] < min_expected]
    pooled_e, pooled_o = sum(e for e, _ in small), sum(o for _, o in small)
    while small and pooled_e < min_expected and big:          # pool with the smallest big cell
        e, o = big.pop(0)
        pooled_e, pooled_o = pooled_e + e, pooled_o + o
    if small:
        big.append((pooled_e, pooled_o))
    stat = sum((o - e) ** 2 / e for e, o in big)
    return stat, len(big) - 1


# ---- greedy: one mixed batch against plain decoding ---------------------------------------------
class GreedyBatch:
    """One tiny target (`arch`): its plain engine and one mixed batch (prompt lengths `lengths`,
    max_new_tokens `max_new`, request `stop_req` stopping on a token well inside its output, request
    `penalty_req` with a repetition penalty, which decodes without speculation inside the VERIFY
    forwards), and plain decoding's outputs: `base` without the stop token, `ref` with it."""

    def __init__(self, root, arch: str, lengths: tuple[int, ...], max_new: tuple[int, ...], stop_req: int,
                 penalty_req: int):
        self.arch = arch
        self.target = make_target(str(root / arch), arch)
        self.plain = engine(self.target)
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        params = [dict(temperature=0, max_new_tokens=m) for m in max_new]
        params[penalty_req]["repetition_penalty"] = 1.3
        self.base = generate_ids(self.plain, self.prompts, params)
        # Stop on a token that first appears well inside request stop_req's output.
        out = self.base[stop_req]
        k = next(k for k in range(6, len(out)) if out[k] not in out[:k])
        params[stop_req]["stop_token_ids"] = [out[k]]
        self.params = params
        self.ref = generate_ids(self.plain, self.prompts, params)
        assert self.ref[stop_req] == out[:k + 1], "plain decoding must honour the stop token"
        assert [len(r) for i, r in enumerate(self.ref) if i != stop_req] == \
            [m for i, m in enumerate(max_new) if i != stop_req]


# ---- sampling: seeded continuations against the target's exact distribution ---------------------
SAMPLING_ALPHA = 1e-3        # false-alarm rate per chi-square check


def assert_fits(counts, probs, what: str, alpha: float = SAMPLING_ALPHA) -> None:
    """Pearson's chi-square of `counts` against `probs` (cells of expected count < 5 pooled) at
    most the critical value at false-alarm rate `alpha`."""
    stat, df = chi_square_gof(counts, probs)
    crit = chi2_critical(df, alpha)
    assert df >= 1, f"{what}: too few cells to test"
    assert stat <= crit, (f"{what}: chi-square {stat:.1f} > critical {crit:.1f} (df {df}, "
                          f"p = {chi2_sf(stat, df):.2e})")


@torch.inference_mode()
def exact_distributions(hf, prompt: list[int], params, vocab: int, depth: int) -> list[torch.Tensor]:
    """P(t1) [V], P(t2|t1) [V, V], .. (`depth` of them) of the target's processed sampling
    distribution (SamplingParams `params`) after `prompt`, by enumerating every continuation."""
    from sparkserve.executor.sampler import processed_probs
    out = []
    for d in range(depth):
        ids = torch.tensor([prompt + list(p) for p in itertools.product(range(vocab), repeat=d)])
        logits = torch.cat([hf(chunk).logits[:, -1] for chunk in ids.split(4096)])
        out.append(processed_probs(logits.float(), params).double().view(*([vocab] * d), vocab))
    return out


def assert_continuations_fit(tokens: torch.Tensor, dists: list[torch.Tensor], what: str) -> None:
    """Seeded 4-token continuations `tokens` [N, 4] follow the exact distributions (p1, .., p4:
    exact_distributions): the marginals of t1 .. t4 and the joints (t1, t2), (t2, t3) fit."""
    (N, cols), V = tokens.shape, dists[0].shape[-1]
    assert cols == len(dists) == 4, "four tokens per continuation"
    p1, p2, p3, p4 = dists

    def counts(cs):
        flat = torch.zeros(V ** len(cs), dtype=torch.long)
        idx = torch.zeros(N, dtype=torch.long)
        for c in cs:
            idx = idx * V + tokens[:, c]
        return flat.index_add_(0, idx, torch.ones(N, dtype=torch.long)).tolist()

    j12 = p1[:, None] * p2                                  # P(t1, t2)
    j123 = j12[:, :, None] * p3                             # P(t1, t2, t3)
    m4 = (j123[:, :, :, None] * p4).sum((0, 1, 2))          # P(t4)
    assert_fits(counts([0]), p1.tolist(), f"{what}: t1")
    assert_fits(counts([1]), j12.sum(0).tolist(), f"{what}: t2")
    assert_fits(counts([0, 1]), j12.flatten().tolist(), f"{what}: (t1, t2)")
    assert_fits(counts([2]), j123.sum((0, 1)).tolist(), f"{what}: t3")
    assert_fits(counts([1, 2]), j123.sum(0).flatten().tolist(), f"{what}: (t2, t3)")
    assert_fits(counts([3]), m4.tolist(), f"{what}: t4")


# ---- invariant: the draft's context KV is what a fresh prefill would inject --------------------
@torch.inference_mode()
def check_draft_context(eng, hf_model, atol: float = 2e-4) -> int:
    """For every request holding KV, the draft context of its positions < kv_len equals the K/V
    that the draft computes from taps of a from-scratch transformers forward over those tokens
    (tap l = HF hidden_states[l + 1]): the draft pool rows at its slots, or, for rows the request
    keeps back while it does not draft (DSparkWorker.defer), the K/V of the kept taps at the same
    positions and slots. Positions a dark request left out of its draft context (Req.draft_gaps)
    are not compared. Returns the number of rows checked."""
    sched = eng.scheduler
    draft, pool, dev = sched.spec.draft, sched.spec.pool, sched.spec.device
    table = sched.cache.req_to_token.table
    reqs = list(sched.running) + ([sched.chunked] if sched.chunked is not None else [])
    checked = 0
    for req in reqs:
        n = req.kv_len
        if req.row is None or n == 0:
            continue
        ids = torch.tensor([req.fill_ids[:n]])
        hs = hf_model(ids, output_hidden_states=True).hidden_states
        taps = [hs[l + 1][0].float().to(dev) for l in draft.config.target_layer_ids]
        ctx = draft.context_hidden(taps)
        cos_sin = draft.rotary.cos_sin(torch.arange(n, device=dev))
        slots = table[req.row, :n].to(dev)
        kept = {}                                  # position -> (K, V) of the kept-back taps
        for kept_taps, positions, kept_slots in sched.spec.backlog:
            mine = torch.isin(kept_slots, slots)   # (the backlog holds every request's rows)
            if not mine.any():
                continue
            positions, kept_taps = positions[mine], [t[mine] for t in kept_taps]
            assert torch.equal(kept_slots[mine], slots[positions]), "kept-back rows name other slots"
            kc = draft.rotary.cos_sin(positions)
            for i, layer in enumerate(draft.layers):
                k, v = layer.self_attn.kv(draft.context_hidden(kept_taps), kc)
                for j, p in enumerate(positions.tolist()):
                    kept[(i, p)] = (k[j], v[j])
        live = torch.ones(n, dtype=torch.bool, device=dev)
        for start, end in req.draft_gaps:
            live[start:end] = False
        for i, layer in enumerate(draft.layers):
            k, v = layer.self_attn.kv(ctx, cos_sin)
            kb, vb = pool.layer(i)
            got_k, got_v = kb[slots].clone(), vb[slots].clone()
            for (li, p), (kk, vv) in kept.items():
                if li == i:
                    got_k[p], got_v[p] = kk, vv
            assert torch.allclose(got_k[live], k[live], atol=atol, rtol=1e-3), \
                f"draft context K of {req.rid} (layer {i}) differs from a fresh prefill"
            assert torch.allclose(got_v[live], v[live], atol=atol, rtol=1e-3), \
                f"draft context V of {req.rid} (layer {i}) differs from a fresh prefill"
        checked += int(live.sum())
    return checked


def install_context_check(eng, hf_model) -> dict:
    """Run check_draft_context after every scheduler step; returns a counter dict."""
    stats = {"steps": 0, "rows": 0}
    orig = eng.scheduler.step

    def step():
        out = orig()
        stats["steps"] += 1
        stats["rows"] += check_draft_context(eng, hf_model)
        return out
    eng.scheduler.step = step
    return stats
