"""Sliding-window pools (`window_page`): when every layer of a model attends over a window W,
pages whose positions are all p <= kv_len - W leave the request while it runs, so a request
needs about W + 2 pages of KV however long it gets.

Tiny random Mistral checkpoints (window 8 and 16) saved at test time; references are
transformers' `generate` (which applies the same window) and a big-pool sparkserve run. After
every scheduler step `check_pages` proves each KV page is in exactly one place: the free
list, a live prefix-cache node, or one running request's window."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_no_kv_leak, hf_greedy, load_hf_reference

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.mem.kv_pool import KVPool

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
            initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def save_tiny(path: str, arch: str, seed: int = 1234, **over) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **dict(TINY, **over))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("swa")
    return {"w8": save_tiny(str(root / "w8"), "mistral", sliding_window=8),
            "w16": save_tiny(str(root / "w16"), "mistral", seed=99, sliding_window=16),
            "llama": save_tiny(str(root / "llama"), "llama"),
            "qwen3_mixed": save_tiny(str(root / "qwen3"), "qwen3", head_dim=32, use_sliding_window=True,
                                     sliding_window=8, max_window_layers=1)}


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def check_pages(sched) -> None:
    """Every KV page is exactly one of: free, held by a live radix node, owned by one request
    (its positions from max(window_start, cached_len) on); given-up positions point at slot 0,
    live ones at real slots; the cache's size counters match its nodes. Split pools (full and
    windowed layers mixed): the same for the windowed layers' pages, reached through
    full_to_swa; the table keeps full slots throughout, tombstones keep their full slots, and a
    request's own pages before its window start have given their windowed slots up."""
    cache = sched.cache
    page, radix, split = cache.allocator.page_size, cache.radix, cache.split
    f2s = cache.full_to_swa
    owner: dict[int, object] = {}
    swa_owner: dict[int, object] = {}

    def claim(slots: torch.Tensor, who) -> None:
        for pg in torch.unique((slots - 1) // page).tolist():
            assert pg not in owner, f"page {pg} held by {owner[pg]} and {who}"
            owner[pg] = who
        if split:
            swa = f2s[slots]
            for pg in torch.unique((swa[swa > 0] - 1) // page).tolist():
                assert pg not in swa_owner, f"windowed page {pg} held by {swa_owner[pg]} and {who}"
                swa_owner[pg] = who

    for pg in cache.allocator.free_pages:
        assert pg not in owner, f"page {pg} freed twice"
        owner[pg] = "free"
    if split:
        for pg in cache.allocator.swa.free_pages:
            assert pg not in swa_owner, f"windowed page {pg} freed twice"
            swa_owner[pg] = "free"
    sizes = {"evictable": 0, "protected": 0, "swa_evictable": 0, "swa_protected": 0}
    for node in radix._nodes():
        if node.dead and not split:
            assert node.lock_ref == 0 and not node.value.any()
            continue
        assert bool((node.value > 0).all())
        if split:
            assert not f2s[node.value].any() if node.dead else bool((f2s[node.value] > 0).all())
            if not node.dead:
                sizes["swa_protected" if node.swa_lock_ref else "swa_evictable"] += len(node.key)
        claim(node.value, "cache")
        sizes["protected" if node.lock_ref else "evictable"] += len(node.key)
    assert (sizes["evictable"], sizes["protected"]) == (radix.evictable_size, radix.protected_size)
    assert (sizes["swa_evictable"], sizes["swa_protected"]) == (radix.swa_evictable_size,
                                                                radix.swa_protected_size)
    reqs = list(sched.running) + ([sched.chunked] if sched.chunked is not None else [])
    for req in reqs:
        row = cache.req_to_token.table[req.row]
        if split:
            assert bool((row[:req.kv_len] > 0).all())
            assert not f2s[row[req.cached_len:req.window_start]].any()
            assert bool((f2s[row[req.window_start:req.kv_len]] > 0).all())
            claim(row[req.cached_len:req.kv_len], req.rid)
        else:
            assert not row[:req.window_start].any()
            assert bool((row[req.window_start:req.kv_len] > 0).all())
            claim(row[max(req.window_start, req.cached_len):req.kv_len], req.rid)
        # nothing a later query can see was given up, nothing dead kept
        if cache.window is not None or split:
            assert req.window_start == radix.window_start(req.kv_len)
    assert len(owner) == cache.allocator.num_pages, "pages leaked"
    if split:
        assert len(swa_owner) == cache.allocator.swa.num_pages, "windowed pages leaked"


def engine(path: str, checked: bool = True, **kw) -> Engine:
    """An Engine whose scheduler runs check_pages after every step and records the fewest free
    slots seen and the most KV slots one request held (`eng.stats`)."""
    kw.setdefault("max_total_tokens", 2048)
    eng = Engine(path, **kw)
    sched = eng.scheduler
    eng.stats = {"min_free": sched.cache.num_slots, "max_live": 0, "freed_in_prefill": 0}
    if checked:
        step = sched.step

        def checked_step():
            out = step()
            check_pages(sched)
            cache = sched.cache
            eng.stats["min_free"] = min(eng.stats["min_free"], cache.allocator.free_slots)
            for r in sched.running + ([sched.chunked] if sched.chunked else []):
                eng.stats["max_live"] = max(eng.stats["max_live"], cache.live_tokens(r))
            if sched.forward_count[ForwardMode.DECODE] == 0:
                eng.stats["freed_in_prefill"] = cache.window_freed_pages
            return out
        sched.step = checked_step
    return eng


def gen(eng: Engine, prompts, params) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]


def assert_flushes_clean(eng: Engine) -> None:
    cache = eng.scheduler.cache
    assert_no_kv_leak(cache)
    assert eng.flush_cache()
    assert cache.allocator.free_slots == cache.num_slots
    if cache.split:
        assert cache.radix.swa_protected_size == 0 and cache.allocator.swa_free_slots == cache.swa_slots
        assert not cache.full_to_swa.any()


@pytest.mark.parametrize("model,page_size", [("w8", 1), ("w16", 4)])
def test_generation_longer_than_the_pool(dirs, model, page_size):
    """20 prompt + 80 new tokens through a 48-slot pool: the request never holds more than its
    window + 2 pages, is never retracted, and its tokens are transformers' and a big pool's."""
    window = int(model[1:])
    prompt = prompts_of([20], seed=3)[0]
    ref = hf_greedy(load_hf_reference(dirs[model]), prompt, 80)
    big = gen(Engine(dirs[model], max_total_tokens=2048, page_size=page_size), [prompt],
              dict(GREEDY, max_new_tokens=80))[0]
    small = engine(dirs[model], max_total_tokens=48, page_size=page_size)
    out = small.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=80))
    assert out["output_ids"] == ref == big
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 80}
    cache = small.scheduler.cache
    assert cache.window == window and len(prompt) + 80 > cache.num_slots
    assert cache.window_freed_pages > 0
    assert small.stats["max_live"] <= window + 2 * page_size
    assert small.scheduler.num_retractions == 0
    assert_flushes_clean(small)


@pytest.mark.parametrize("page_size,chunk,radix", [(1, 8, True), (4, 4, True), (4, 16, False)])
def test_mixed_batch_in_a_small_pool(dirs, page_size, chunk, radix):
    """Seven requests of mixed prompt and output lengths in a 64-slot pool (their sequences add
    up to ~400 tokens) give the big pool's tokens; no page is ever lost or double-owned."""
    prompts = prompts_of([3, 30, 12, 21, 7, 40, 16], seed=5)
    params = [dict(GREEDY, max_new_tokens=m) for m in (40, 25, 60, 10, 33, 20, 50)]
    ref = gen(Engine(dirs["w8"], disable_radix_cache=True, chunked_prefill_size=-1), prompts, params)
    eng = engine(dirs["w8"], max_total_tokens=64, page_size=page_size, chunked_prefill_size=chunk,
                 disable_radix_cache=not radix)
    assert gen(eng, prompts, params) == ref
    assert eng.scheduler.cache.window_freed_pages > 0
    assert_flushes_clean(eng)


@pytest.mark.parametrize("page_size,pool", [(1, 40), (4, 64)])
def test_admission_reserves_the_window_and_retraction_resumes(dirs, page_size, pool):
    """Eight short prompts, 40 new tokens each: admission keeps room for every running request
    to fill its window (W + 2 pages), so none is retracted. Reserving one page each (as for
    full attention) overcommits: requests are retracted and resume from their cached windows,
    with the same tokens."""
    prompts = prompts_of([3, 4, 2, 5, 3, 6, 2, 4], seed=9)
    sp = dict(GREEDY, max_new_tokens=40)
    ref = gen(Engine(dirs["w8"], disable_radix_cache=True), prompts, sp)
    eng = engine(dirs["w8"], max_total_tokens=pool, page_size=page_size)
    assert gen(eng, prompts, sp) == ref
    assert eng.scheduler.num_retractions == 0
    assert eng.scheduler.forward_count[ForwardMode.EXTEND] > 1       # admitted in waves
    assert_flushes_clean(eng)
    greedy = engine(dirs["w8"], max_total_tokens=pool, page_size=page_size)
    greedy.scheduler.cache.decode_reserve = lambda req, remaining: page_size
    assert gen(greedy, prompts, sp) == ref
    assert greedy.scheduler.num_retractions > 0
    assert_flushes_clean(greedy)


def test_chunked_prefill_frees_between_chunks(dirs):
    """A 41-token prompt prefilled 4 tokens at a time through a 24-slot pool: pages leave the
    request between chunks (the prompt never fits at once)."""
    prompt = prompts_of([41], seed=6)[0]
    sp = dict(GREEDY, max_new_tokens=30)
    ref = gen(Engine(dirs["w8"]), [prompt], sp)
    eng = engine(dirs["w8"], max_total_tokens=24, page_size=4, chunked_prefill_size=4,
                 disable_radix_cache=True)
    assert gen(eng, [prompt], sp) == ref
    assert eng.stats["freed_in_prefill"] > 0
    assert eng.scheduler.forward_count[ForwardMode.EXTEND] >= 11
    assert_flushes_clean(eng)


def test_prefix_cache_rule(dirs):
    """The cached prompt is never freed by a request's window: once the window passes it, the
    request unlocks it (evictable, still served to the next request). Finished requests cache
    their sequence with the pages they gave up as tombstones; a continuation is served from
    the cache as long as its last W - 1 positions are alive, even when the sequence is longer
    than the pool. Chunked prefill throughout."""
    path = dirs["w8"]
    shared = prompts_of([40], seed=7)[0]
    a, b = shared + [1, 2, 3], shared + [7, 8]
    sp = dict(GREEDY, max_new_tokens=30)
    plain = Engine(path, disable_radix_cache=True)
    ref_a, ref_b = gen(plain, [a, b], sp)

    # Big pool: A's window passes its cached prompt -> unlocked, kept; B hits all 40 tokens.
    eng = engine(path, page_size=4, chunked_prefill_size=4)
    sched, cache = eng.scheduler, eng.scheduler.cache
    seen_unlocked = []
    step = sched.step

    def watch():
        out = step()
        for r in sched.running:
            if r.kv_len > 40 + 8 + 4:
                seen_unlocked.append((cache.radix.protected_size, cache.radix.evictable_size))
        return out
    sched.step = watch
    assert gen(eng, [a], sp) == [ref_a]
    assert seen_unlocked and all(p == 0 and e >= 40 for p, e in seen_unlocked), seen_unlocked
    out = eng.generate(input_ids=b, sampling_params=sp)
    assert out["output_ids"] == ref_b and out["meta_info"]["cached_tokens"] == 40
    # A finished: its positions 40..63, which had left the window, are a tombstone in the cache
    # and 64..71 are live. A prompt ending inside the tombstone is served only up to the live
    # prompt (40 tokens); its prefill recomputes 40..51 and revives that part of the tombstone.
    # Then a prompt ending just after the tombstone (its last W - 1 positions not all live) is
    # served up to the revived part (52 tokens).
    for k, cached in ((10, 40), (25, 52)):
        d = a + ref_a[:k] + [5]
        out = eng.generate(input_ids=d, sampling_params=sp)
        assert out["output_ids"] == gen(plain, [d], sp)[0] and out["meta_info"]["cached_tokens"] == cached
    assert_no_kv_leak(cache)

    # Pool of 32 slots: the prompt's early pages are evicted (tombstoned) under pressure, yet a
    # continuation of A (74 tokens, longer than the pool) resumes from the cache.
    small = engine(path, max_total_tokens=32, page_size=4, chunked_prefill_size=4)
    assert gen(small, [a], sp) == [ref_a]
    follow = a + ref_a + [9]
    r = small.generate(input_ids=follow, sampling_params=dict(GREEDY, max_new_tokens=12))
    assert r["output_ids"] == gen(plain, [follow], dict(GREEDY, max_new_tokens=12))[0]
    assert r["meta_info"]["cached_tokens"] >= len(follow) - 8 - 2 * 4 > small.scheduler.cache.num_slots
    out = small.generate(input_ids=b, sampling_params=sp)
    assert out["output_ids"] == ref_b
    assert_flushes_clean(small)


@pytest.mark.parametrize("draft,page_size,arch", [("random", 1, "mistral"), ("fitted", 4, "mistral"),
                                                   ("fitted", 2, "qwen3")])
def test_dspark_greedy_with_window_freeing(tmp_path, draft, page_size, arch):
    """DSpark on a windowed target in a small pool: verify appends anchor + drafts, rejected
    ones are truncated, then the window slides on the committed length; tokens equal plain
    decoding. The fitted draft makes verifies accept several drafts. Qwen3 with full layers
    0-1 and windowed layers 2-3: a split pool, where the windowed slots slide."""
    from dspark_fixtures import make_oracle_draft, make_random_draft, make_target
    over = (dict(sliding_window=8) if arch == "mistral"
            else dict(use_sliding_window=True, sliding_window=8, max_window_layers=2))
    target = make_target(str(tmp_path / "t"), arch, **over)
    prompts = prompts_of([1, 5, 17, 40, 9], seed=8)
    params = [dict(temperature=0, max_new_tokens=m) for m in (60, 2, 45, 36, 28)]
    ref = gen(Engine(target, disable_radix_cache=True), prompts, params)
    if draft == "random":
        draft_dir = make_random_draft(target, str(tmp_path / "d"), block_size=4)
    else:
        bigram = [0] * 256
        for p, o in zip(prompts, ref):
            for x, y in zip(p[-1:] + o, o):
                bigram[x] = y
        draft_dir = make_oracle_draft(target, str(tmp_path / "d"), bigram, block_size=4)
    eng = engine(target, max_total_tokens=44 if arch == "mistral" else 256, page_size=page_size,
                 chunked_prefill_size=4, speculative_algorithm="DSPARK",
                 speculative_draft_model_path=draft_dir,
                 speculative_dspark_verify_mode="full", max_running_requests=2)
    assert eng.scheduler.cache.split == (arch == "qwen3")
    assert gen(eng, prompts, params) == ref
    sched = eng.scheduler
    assert sched.forward_count[ForwardMode.VERIFY] > 0 and sched.cache.window_freed_pages > 0
    if draft == "fitted":
        assert max(sched.accept_hist) >= 2, sched.accept_hist
    assert_flushes_clean(eng)


def test_pipeline_stage_pool_lists_its_own_layers():
    """A stage's pool keeps a 1-row dummy for the other stages' layers; its components (what PD
    transfer walks) are its own layers only, split or not."""
    stage = KVPool(16, 3, 2, 8, layers=range(1, 3))
    assert [(c.name, c.layer_ids, [t.shape[0] for t in c.tensors]) for c in stage.components()] == \
        [("k", [1, 2], [17, 17]), ("v", [1, 2], [17, 17])]
    split = KVPool(16, 3, 2, 8, swa_layers=[0, 2], swa_slots=8, swa_window=4, layers=range(1, 3))
    assert [(c.name, c.layer_ids, [t.shape[0] for t in c.tensors]) for c in split.components()] == \
        [("k", [1], [17]), ("v", [1], [17]), ("swa_k", [2], [9]), ("swa_v", [2], [9])]


def test_pool_components_and_mixed_models(dirs):
    """All-windowed Mistral: window_page components and a sliding cache manager. Full attention:
    token_page, no freeing. Qwen3 mixing full and windowed layers: a split pool, the full layer's
    K/V token_page, the windowed layer's window_page in a slot space of its own."""
    kinds = {}
    for name in ("w8", "llama", "qwen3_mixed"):
        eng = Engine(dirs[name], max_total_tokens=64)
        comps = eng.scheduler.runner.kv_pool.components()
        cache = eng.scheduler.cache
        kinds[name] = ({(c.name, c.kind, tuple(c.layer_ids or ())) for c in comps}, cache.window,
                       cache.swa_window, cache.swa_slots)
    assert kinds == {"w8": ({("k", "window_page", (0, 1)), ("v", "window_page", (0, 1))}, 8, None, 0),
                     "llama": ({("k", "token_page", (0, 1)), ("v", "token_page", (0, 1))}, None, None, 0),
                     "qwen3_mixed": ({("k", "token_page", (0,)), ("v", "token_page", (0,)),
                                      ("swa_k", "window_page", (1,)), ("swa_v", "window_page", (1,))},
                                     None, 8, 64)}
    # Default pool size: per running request a full context, or for all-windowed models the
    # window + one prefill chunk + 2 pages (chunking off: the whole prompt may need to fit).
    # Split pools buy the windowed layers' slots first, as many as the window-bound gives.
    from sparkserve.args import ServerArgs
    from sparkserve.models.registry import load_config
    from sparkserve.scheduler.runtime import pool_sizes
    for name, chunk, want in (("w8", 16, 4 * (8 + 16 + 2 * 4)), ("w8", -1, 4 * 512),
                              ("llama", 16, 4 * 512), ("qwen3_mixed", 16, 4 * 512)):
        args = ServerArgs(model_path=dirs[name], max_running_requests=4, chunked_prefill_size=chunk,
                          page_size=4)
        assert pool_sizes(args, load_config(dirs[name]), per_token=1)[0] == want, name
    cfg = load_config(dirs["qwen3_mixed"])
    for chunk, total, want in ((16, None, (4 * 512, 4 * (8 + 16 + 2 * 4))), (-1, None, (4 * 512, 4 * 512)),
                               (16, 64, (64, 64)), (4, 256, (256, 4 * (8 + 4 + 2 * 4)))):
        args = ServerArgs(model_path=dirs["qwen3_mixed"], max_running_requests=4, chunked_prefill_size=chunk,
                          page_size=4, max_total_tokens=total)
        assert pool_sizes(args, cfg, per_token=3, per_swa_token=5) == want, (chunk, total)


def test_dspark_draft_masks_positions_the_window_gave_up(tmp_path):
    """DSpark on a windowed target with freeing active: the positions whose pages the window gave
    up point at the pad slot 0, and the draft masks them. Each request's block hidden states equal
    a pass over only its live context rows (not slot 0's zero rows, which would dilute attention)."""
    from dspark_fixtures import make_random_draft, make_target
    target = make_target(str(tmp_path / "t"), "mistral", sliding_window=8)
    draft_dir = make_random_draft(target, str(tmp_path / "d"), block_size=4)
    eng = engine(target, max_total_tokens=64, page_size=2, chunked_prefill_size=4,
                 speculative_algorithm="DSPARK", speculative_draft_model_path=draft_dir,
                 speculative_dspark_verify_mode="full",
                 activation_quant="none")    # the native pass vs the Python one, to fp32 rounding
    draft = eng.scheduler.spec.draft
    block_hidden = draft.block_hidden
    seen = {"calls": 0, "freed": 0}

    def checked(anchors, anchor_pos, kv_indices, ctx_lens, pool, block_slots=None):
        out = block_hidden(anchors, anchor_pos, kv_indices, ctx_lens, pool, block_slots)
        seen["calls"] += 1
        for b, n in enumerate(ctx_lens):
            ctx = kv_indices[b, :n]
            live = ctx[ctx != 0]
            seen["freed"] += int(live.numel() < n)
            ref = block_hidden(anchors[b:b + 1], anchor_pos[b:b + 1], live[None], [live.numel()], pool)
            torch.testing.assert_close(out[b], ref[0], atol=1e-5, rtol=1e-5)
        return out
    draft.block_hidden = checked
    prompts = prompts_of([5, 23], seed=12)
    gen(eng, prompts, [dict(temperature=0, max_new_tokens=m) for m in (30, 24)])
    assert seen["calls"] > 0 and seen["freed"] > 0, seen
    assert_flushes_clean(eng)


def test_attention_gathers_from_the_window_start(dirs):
    """All-windowed models gather keys from the batch's earliest window start, not position 0: a
    batch-1 decode reads W keys however long the sequence. Batched, chunked and mixed-length
    forwards stay exact (transformers' tokens; masks on absolute positions)."""
    prompts = prompts_of([20, 3, 13], seed=21)
    hf = load_hf_reference(dirs["w8"])
    refs = [hf_greedy(hf, p, 30) for p in prompts]
    eng = engine(dirs["w8"], max_total_tokens=256, chunked_prefill_size=8)
    runner = eng.scheduler.runner
    build, seen = runner.build_batch, []

    def spy(mode, reqs):
        fb = build(mode, reqs)
        seen.append((mode, [r.start for r in reqs], [len(r.tokens) for r in reqs], fb.kv_start,
                     fb.kv_indices.shape[1]))
        return fb
    runner.build_batch = spy
    sp = dict(GREEDY, max_new_tokens=30)
    assert gen(eng, prompts[:1], sp) == refs[:1]
    solo = [width for mode, starts, _, _, width in seen if mode is ForwardMode.DECODE]
    assert len(solo) == 29 and all(w == 8 for w in solo), solo      # positions 20..48: W keys each
    assert gen(eng, prompts, sp) == refs
    for mode, starts, lens, kv_start, width in seen:
        assert kv_start == min(max(0, s - 8 + 1) for s in starts)
        assert width == max(s + n for s, n in zip(starts, lens)) - kv_start
    assert any(len(starts) > 1 and kv_start > 0 for _, starts, _, kv_start, _ in seen)


def test_pool_sizing_pays_for_request_state(dirs, tmp_path, monkeypatch):
    """Pool contract: models say what one request row costs besides one token. Kimi-Linear keeps
    KDA recurrent + conv state per row (~45 MiB each at real sizes): the default KV size is what
    the memory budget holds after every row's state, and a budget that cannot even hold the rows
    is a start-up error naming the flags. Llama-family models keep no per-request state."""
    from kimi_fixtures import make_kimi

    from sparkserve.models.registry import load_model
    from sparkserve.scheduler import runtime
    for name in ("w8", "llama"):
        assert load_model(dirs[name]).pool_bytes_per_request() == 0
    path = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    model = load_model(path)
    per_row, per_token = model.pool_bytes_per_request(), model.pool_bytes_per_token()
    assert per_row == 2 * (4 * 16 * 16 + 3 * 3 * 64) * 4     # 2 KDA layers: [H, D, D] state, K-1 conv rows
    rows = 2 + 1                                             # max running + the spare row
    monkeypatch.setattr(runtime, "pool_memory_budget",
                        lambda args, device: rows * per_row + 100 * per_token + 5)
    eng = Engine(path, max_running_requests=2, disable_radix_cache=True)
    assert eng.scheduler.cache.num_slots == 100
    assert len(gen(eng, prompts_of([7], seed=1), dict(GREEDY, max_new_tokens=3))[0]) == 3
    monkeypatch.setattr(runtime, "pool_memory_budget", lambda args, device: rows * per_row)
    with pytest.raises(ValueError, match="request rows") as e:
        Engine(path, max_running_requests=2)
    assert "--mem-fraction-static" in str(e.value) and "--max-running-requests" in str(e.value)
    assert Engine(path, max_running_requests=2, max_total_tokens=64).scheduler.cache.num_slots == 64


# ---- full and windowed layers mixed: split pools ------------------------------------------------
@pytest.mark.parametrize("page_size,chunk,radix", [(1, 8, True), (4, 4, True), (4, 16, False)])
def test_split_pool_frees_windowed_pages(dirs, page_size, chunk, radix):
    """Qwen3 with full layer 0 and windowed layer 1 (W=8): the windowed layers' slot space is
    smaller than one request's sequence, yet mixed prompts and lengths give transformers'
    tokens; windowed pages leave the window while the full ones stay, and no page of either
    space is lost or double-owned (check_pages after every step)."""
    prompts = prompts_of([3, 30, 12, 21, 7], seed=5)
    new = (40, 40, 30, 10, 33)
    hf = load_hf_reference(dirs["qwen3_mixed"])
    refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, new)]
    eng = engine(dirs["qwen3_mixed"], max_total_tokens=512, page_size=page_size, chunked_prefill_size=chunk,
                 max_running_requests=2, disable_radix_cache=not radix)
    cache = eng.scheduler.cache
    assert cache.split and cache.swa_slots == 2 * (8 + chunk + 2 * page_size)
    assert cache.swa_slots < max(len(p) + m for p, m in zip(prompts, new)) <= cache.num_slots
    runner = eng.scheduler.runner
    build, seen = runner.build_batch, []

    def spy(mode, reqs):       # full layers gather from 0, windowed ones from the window start
        fb = build(mode, reqs)
        end = max(r.start + len(r.tokens) for r in reqs)
        swa_start = min(max(0, r.start - 8 + 1) for r in reqs)
        assert fb.kv_start == 0 and fb.kv_indices.shape[1] == end
        assert fb.swa_kv_start == swa_start and fb.swa_kv_indices.shape[1] == end - swa_start
        seen.append(swa_start)
        return fb
    runner.build_batch = spy
    assert gen(eng, prompts, [dict(GREEDY, max_new_tokens=m) for m in new]) == refs
    assert max(seen) > 0
    assert cache.window_freed_pages > 0
    assert eng.stats["max_live"] <= 8 + 2 * page_size      # windowed slots one request holds
    assert_flushes_clean(eng)


def test_split_pool_prefix_cache_and_retraction(dirs):
    """Split pool, chunked prefill. A prompt is cached chunk by chunk; once the window passes
    it the request keeps it locked for the full layer only, so a second request with the same
    prompt is served all of it. In a windowed space smaller than one sequence, cached pages
    lose their windowed slots (tombstones keep the full ones), and a continuation longer than
    that space still resumes from the cache. A full space too small for the batch retracts
    requests, which resume from the cache with a big pool's tokens."""
    path = dirs["qwen3_mixed"]
    shared = prompts_of([40], seed=7)[0]
    a, b = shared + [1, 2, 3], shared + [7, 8]
    sp = dict(GREEDY, max_new_tokens=30)
    plain = Engine(path, disable_radix_cache=True, chunked_prefill_size=-1)   # windowed space = full one
    ref_a, ref_b = gen(plain, [a, b], sp)

    eng = engine(path, max_total_tokens=2048, page_size=4, chunked_prefill_size=4)
    sched, cache = eng.scheduler, eng.scheduler.cache
    seen = []
    step = sched.step

    def watch():
        out = step()
        for r in sched.running:
            if r.kv_len > 40 + 8 + 4:     # the window has passed the cached prompt
                seen.append((cache.radix.protected_size, cache.radix.swa_protected_size))
        return out
    sched.step = watch
    assert gen(eng, [a], sp) == [ref_a]
    assert seen and all(p == 40 and s == 0 for p, s in seen), seen
    out = eng.generate(input_ids=b, sampling_params=sp)
    assert out["output_ids"] == ref_b and out["meta_info"]["cached_tokens"] == 40
    # As in window mode: A's positions 40..63 are a tombstone (full slots kept), 64.. are live.
    # A prompt ending inside it is served up to the live prompt and revives part of it with its
    # windowed slots; a longer one is then served up to the revived part.
    for k, cached in ((10, 40), (25, 52)):
        d = a + ref_a[:k] + [5]
        out = eng.generate(input_ids=d, sampling_params=sp)
        assert out["output_ids"] == gen(plain, [d], sp)[0] and out["meta_info"]["cached_tokens"] == cached
    assert_no_kv_leak(cache)

    small = engine(path, max_total_tokens=512, page_size=4, chunked_prefill_size=4, max_running_requests=1)
    assert small.scheduler.cache.swa_slots == 8 + 4 + 8
    assert gen(small, [a], sp) == [ref_a]
    dead = [n for n in small.scheduler.cache.radix._nodes() if n.dead]
    assert dead and all(bool((n.value > 0).all()) for n in dead)
    follow = a + ref_a + [9]
    r = small.generate(input_ids=follow, sampling_params=dict(GREEDY, max_new_tokens=12))
    assert r["output_ids"] == gen(plain, [follow], dict(GREEDY, max_new_tokens=12))[0]
    assert r["meta_info"]["cached_tokens"] >= len(follow) - 8 - 2 * 4 > small.scheduler.cache.swa_slots
    assert_flushes_clean(small)

    prompts = prompts_of([3, 4, 2, 5, 3, 6, 2, 4], seed=9)
    sp = dict(GREEDY, max_new_tokens=40)
    ref = gen(plain, prompts, sp)
    tight = engine(path, max_total_tokens=160, page_size=4, chunked_prefill_size=8)
    assert gen(tight, prompts, sp) == ref
    assert tight.scheduler.num_retractions > 0
    assert_flushes_clean(tight)
