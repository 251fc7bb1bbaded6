"""Engine.generate end to end: greedy tokens equal transformers' generate, and every scheduler
feature (continuous batching, chunked prefill, prefix cache, paging, retraction) leaves the
tokens unchanged and the KV pool leak-free."""
from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, assert_no_kv_leak, hf_greedy

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 320) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def tiny_engine(path: str, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 16)
    return Engine(path, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(arch, tiny_dirs, hf_tiny):
    prompts = prompts_of([3, 26, 9, 17, 1], seed=1)
    engine = tiny_engine(tiny_dirs[arch])
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert len(out) == len(prompts)
    for p, r in zip(prompts, out):
        assert r["output_ids"] == hf_greedy(hf_tiny[arch], p, 16)
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
        assert r["meta_info"]["prompt_tokens"] == len(p)
        assert r["meta_info"]["completion_tokens"] == 16
    assert_no_kv_leak(engine.scheduler.cache)


def test_smollm2_chat_greedy_matches_transformers(smollm2_engine, smollm2_hf):
    """A batch of two chat prompts on SmolLM2 (GGUF) vs transformers generate, EOS honoured."""
    engine = smollm2_engine
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are a poet."},
              {"role": "user", "content": "Write two lines about the sea."}]]
    sp = {"temperature": 0, "max_new_tokens": 16}
    out = engine.generate(messages=convs, sampling_params=sp)
    tok = engine.tokenizer
    for conv, r in zip(convs, out):
        prompt = tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True),
                            add_special_tokens=True)
        ref = hf_greedy(smollm2_hf, prompt, 16, stop_at_eos=True)
        assert r["output_ids"] == ref
        assert r["meta_info"]["prompt_tokens"] == len(prompt)
        if ref[-1] in engine.scheduler.eos_ids:
            assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[-1]}
        else:
            assert r["meta_info"]["finish_reason"]["type"] == "length"
        assert r["text"] == tok.decode(r["output_ids"], skip_special_tokens=True)
    assert_no_kv_leak(engine.scheduler.cache)


def _req(engine: Engine, rid: str, prompt: list[int], sp: dict) -> Req:
    p = SamplingParams.from_dict(sp)
    return Req(rid, list(prompt), p, RequestSamplingState(p, prompt, engine.scheduler.eos_ids))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_batch_independence_with_mid_flight_arrivals(arch, tiny_dirs):
    """Each request's tokens (greedy, and seeded sampling) are the same alone, in a batch, and
    when others join or leave the running batch between steps."""
    prompts = prompts_of([7, 19, 4, 12, 25], seed=2)
    params = [dict(GREEDY, max_new_tokens=10 + 2 * i) for i in range(len(prompts))]
    params[1] = {"temperature": 1.0, "top_p": 0.9, "seed": 11, "max_new_tokens": 14, "ignore_eos": True}
    params[3] = {"temperature": 0.8, "top_k": 20, "seed": 5, "max_new_tokens": 9, "ignore_eos": True}
    engine = tiny_engine(tiny_dirs[arch], chunked_prefill_size=8)
    alone = [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in zip(prompts, params)]
    together = ids(engine.generate(input_ids=prompts, sampling_params=params))
    assert together == alone
    engine.flush_cache()

    sched = engine.scheduler
    reqs = [_req(engine, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    sched.add_request(reqs[0])
    sched.add_request(reqs[1])
    arrivals = {2: [reqs[2]], 5: [reqs[3]], 9: [reqs[4]]}     # step index -> new requests
    step = 0
    saw_decode_with_arrival = False
    while sched.has_work() or any(k >= step for k in arrivals):
        for r in arrivals.get(step, []):
            saw_decode_with_arrival |= bool(sched.running)
            sched.add_request(r)
        sched.step()
        step += 1
        assert step < 500
    assert saw_decode_with_arrival, "arrivals should join while others are decoding"
    assert [r.output_ids for r in reqs] == alone
    assert all(r.finished for r in reqs)
    assert_no_kv_leak(sched.cache)


def test_stream_one_while_batch_runs(tiny_dirs):
    """A streamed request advanced step by step while another request is added mid-way."""
    engine = tiny_engine(tiny_dirs["qwen3"])
    p1, p2 = prompts_of([11, 6], seed=3)
    ref1 = engine.generate(input_ids=p1, sampling_params=GREEDY)["output_ids"]
    ref2 = engine.generate(input_ids=p2, sampling_params=GREEDY)["output_ids"]
    engine.flush_cache()
    stream = engine.generate(input_ids=p1, sampling_params=GREEDY, stream=True)
    got, other = [], None
    for i, chunk in enumerate(stream):
        got += chunk["output_ids"]
        if i == 3:
            other = _req(engine, "other", p2, GREEDY)
            engine.scheduler.add_request(other)
    assert chunk["finished"] and chunk["meta_info"]["finish_reason"]["type"] == "length"
    assert got == ref1
    while not other.finished:
        engine.scheduler.step()
    assert other.output_ids == ref2
    assert_no_kv_leak(engine.scheduler.cache)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_matches_plain(arch, tiny_dirs):
    prompts = prompts_of([20, 18, 23, 5], seed=4)
    plain = tiny_engine(tiny_dirs[arch], chunked_prefill_size=-1, disable_radix_cache=True)
    ref = ids(plain.generate(input_ids=prompts, sampling_params=GREEDY))
    for radix in (False, True):
        chunked = tiny_engine(tiny_dirs[arch], chunked_prefill_size=4, disable_radix_cache=not radix)
        out = ids(chunked.generate(input_ids=prompts, sampling_params=GREEDY))
        assert out == ref
        # 66 prompt tokens in chunks of at most 4 tokens per forward: at least 17 prefill forwards.
        assert chunked.scheduler.forward_count[ForwardMode.EXTEND] >= -(-sum(map(len, prompts)) // 4)
        assert_no_kv_leak(chunked.scheduler.cache)


@pytest.mark.parametrize("page_size,chunk", [(1, -1), (4, -1), (4, 4), (1, 5)])
def test_prefix_cache_hits_give_same_tokens(page_size, chunk, tiny_dirs):
    path = tiny_dirs["llama"]
    prefix = prompts_of([26], seed=5)[0]
    a, b = prefix + [1, 2, 3], prefix + [7, 8]
    plain = tiny_engine(path, disable_radix_cache=True, chunked_prefill_size=-1)
    ref_a, ref_b = ids(plain.generate(input_ids=[a, b], sampling_params=GREEDY))

    engine = tiny_engine(path, page_size=page_size, chunked_prefill_size=chunk)
    first = engine.generate(input_ids=a, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["output_ids"] == ref_a
    # The same prompt again, and one sharing only the prefix, in one batch.
    again, other = engine.generate(input_ids=[a, b], sampling_params=GREEDY)
    assert again["output_ids"] == ref_a and other["output_ids"] == ref_b
    for r, prompt in ((again, a), (other, b)):
        cached = r["meta_info"]["cached_tokens"]
        assert cached >= len(prefix) // page_size * page_size, cached
        assert cached < len(prompt) and cached % page_size == 0
    # Continuing a finished conversation hits its generated tokens too.
    follow = a + ref_a + [9]
    r = engine.generate(input_ids=follow, sampling_params=GREEDY)
    assert r["meta_info"]["cached_tokens"] >= len(a + ref_a) // page_size * page_size - page_size
    assert r["output_ids"] == plain.generate(input_ids=follow, sampling_params=GREEDY)["output_ids"]
    assert_no_kv_leak(engine.scheduler.cache)


def test_prefix_shared_within_one_chunked_batch(tiny_dirs):
    """Two requests with a common prefix submitted together under chunked prefill: the second
    reuses the first's prefix chunks as soon as they are cached."""
    path = tiny_dirs["mistral"]
    prefix = prompts_of([24], seed=6)[0]
    prompts = [prefix + [5, 6, 7], prefix + [8]]
    plain = tiny_engine(path, disable_radix_cache=True, chunked_prefill_size=-1)
    engine = tiny_engine(path, chunked_prefill_size=4)
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert ids(out) == ids(plain.generate(input_ids=prompts, sampling_params=GREEDY))
    assert out[1]["meta_info"]["cached_tokens"] >= 20
    assert_no_kv_leak(engine.scheduler.cache)


def test_in_batch_prefix_sharing(tiny_dirs):
    """Requests arriving together with a long common prompt prefix: the first computes it, the
    others wait one step and read it from the prefix cache (SGLang's in-batch prefix caching);
    an unrelated request is not held back. Tokens equal the plain run."""
    path = tiny_dirs["llama"]
    prefix = prompts_of([40], seed=8)[0]
    prompts = [prefix + [i + 1, i + 2] for i in range(5)] + prompts_of([12], seed=9)
    plain = tiny_engine(path, disable_radix_cache=True, chunked_prefill_size=-1)
    engine = tiny_engine(path, chunked_prefill_size=-1)
    out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert ids(out) == ids(plain.generate(input_ids=prompts, sampling_params=GREEDY))
    cached = [o["meta_info"]["cached_tokens"] for o in out]
    assert cached[0] == 0 and cached[5] == 0 and all(c >= 40 for c in cached[1:5]), cached
    assert engine.scheduler.forward_count[ForwardMode.EXTEND] == 2     # {first, unrelated}, {rest}
    assert_no_kv_leak(engine.scheduler.cache)


_BIG_POOL_REF: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("page_size,radix,chunk", [(1, True, -1), (4, True, -1), (4, False, -1),
                                                   (1, True, 4), (4, False, 3)])
def test_retraction_when_pool_is_too_small(page_size, radix, chunk, tiny_dirs):
    """8 requests that cannot all hold their KV at once all finish, with the tokens of a big
    pool; retraction is proven by the counter; nothing leaks. With chunked prefill a
    half-prefilled request holds KV too and must be retractable."""
    path = tiny_dirs["llama"]
    prompts = prompts_of([10, 14, 9, 17, 12, 16, 11, 15], seed=7)
    sp = dict(GREEDY, max_new_tokens=20)
    if path not in _BIG_POOL_REF:
        big = tiny_engine(path, disable_radix_cache=True)
        _BIG_POOL_REF[path] = ids(big.generate(input_ids=prompts, sampling_params=sp))
    ref = _BIG_POOL_REF[path]
    largest = max(len(p) for p in prompts) + 20
    small_pool = -(-(largest + 6) // page_size) * page_size
    small = tiny_engine(path, max_total_tokens=small_pool, page_size=page_size, disable_radix_cache=not radix,
                        chunked_prefill_size=chunk)
    out = small.generate(input_ids=prompts, sampling_params=sp)
    assert ids(out) == ref
    assert all(r["meta_info"]["finish_reason"] == {"type": "length", "length": 20} for r in out)
    assert small.scheduler.num_retractions > 0
    assert_no_kv_leak(small.scheduler.cache)
    assert small.flush_cache()
    assert small.scheduler.cache.allocator.free_slots == small.scheduler.cache.num_slots


def test_n_returns_n_results(tiny_dirs):
    engine = tiny_engine(tiny_dirs["llama"])
    p = prompts_of([8], seed=8)[0]
    greedy = engine.generate(input_ids=p, sampling_params=dict(GREEDY, n=2))
    assert isinstance(greedy, list) and len(greedy) == 2
    single = engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"] == single
    assert greedy[0]["meta_info"]["id"] != greedy[1]["meta_info"]["id"]
    # Sampled n=2 with a seed: sample i is the request seeded seed+i (SGLang-style per-sample seeds).
    sp = {"temperature": 1.0, "seed": 100, "max_new_tokens": 12, "ignore_eos": True}
    two = engine.generate(input_ids=p, sampling_params=dict(sp, n=2))
    assert len(two) == 2
    for i, r in enumerate(two):
        ref = engine.generate(input_ids=p, sampling_params=dict(sp, seed=100 + i))
        assert r["output_ids"] == ref["output_ids"]
    assert two[0]["output_ids"] != two[1]["output_ids"]
    # A batch of prompts with n=2: prompts x n results, in order.
    batch = engine.generate(input_ids=[p, p[:3]], sampling_params=dict(GREEDY, n=2))
    assert len(batch) == 4
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [8, 8, 3, 3]
    assert_no_kv_leak(engine.scheduler.cache)
