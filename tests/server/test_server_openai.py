"""The real `openai` client (sync, async, streaming) against `sparkserve serve` on the embedded
SmolLM2: greedy answers equal the offline Engine's for the same messages/prompts, and the OpenAI
shapes (content parts, token-id prompts, n, stop, logprobs, usage) hold. Also SGLang's /generate.

Every test runs against four servers, one at a time (the `server` fixture's params): one process,
`--pp-size 2`, `--tp-size 3` (SmolLM2 has 9 attention heads and 3 KV heads, so 3 is the tensor
split it allows; 2 is refused at start-up, test_tp2_is_refused) and DP attention over two groups
(`--tp-size 2 --dp-size 2 --enable-dp-attention`: whole heads per group, the MLP split over both).
Each is compared with the same single-process offline Engine: a parallel server must answer
exactly as one process does."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re

import httpx
import openai
import pytest
import torch
from conftest import EXACT, EXACT_FLAGS
from server_harness import SERVER_THREADS, ServerProcess

MAX_TOKENS = 10
POOL = 8192
CHATS = [
    [{"role": "user", "content": "Hi, who are you?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "What is the capital of France?"}],
]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


# (tp_size, pp_size, DP attention groups) per layout; every rank runs SERVER_THREADS torch threads.
# Every layout runs exact (fp32 activations and KV pool), as the reference does: int8 or float16
# rounding would turn the layouts' fp32 summation-order differences into logit changes that flip
# greedy near-ties.
LAYOUTS = {"single": (1, 1, 1), "pp2": (1, 2, 1), "tp3": (3, 1, 1), "dp2": (2, 1, 2)}


def _layout_flags(tp: int, pp: int, dp: int) -> list[str]:
    return ((["--tp-size", str(tp)] if tp > 1 else []) + (["--pp-size", str(pp)] if pp > 1 else []) +
            (["--dp-size", str(dp), "--enable-dp-attention"] if dp > 1 else []))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request):
    """One server per layout, started once for all the module's tests (pytest groups the tests
    by this module-scoped param, so only one server runs at a time)."""
    tp, pp, dp = LAYOUTS[request.param]
    s = ServerProcess("--max-total-tokens", str(POOL), *EXACT_FLAGS, *_layout_flags(tp, pp, dp))
    s.tp_size, s.pp_size, s.dp_size = tp, pp, dp
    yield s
    s.stop()
    s.remove_log()


@contextlib.contextmanager
def _threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def engine():
    """The single-process reference, built once for every layout (it does not depend on `server`)."""
    from sparkserve import Engine
    with _threads(SERVER_THREADS):
        eng = Engine(max_total_tokens=POOL, num_threads=SERVER_THREADS, **EXACT)

    def run(**kw):
        with _threads(SERVER_THREADS):
            return eng.generate(**kw)
    eng.run = run
    return eng


@pytest.fixture(scope="module")
def client(server, engine):
    """Asks for `engine` first so the reference loads while the server does (`server.url` waits)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def greedy(max_tokens=MAX_TOKENS, **kw):
    return {"max_new_tokens": max_tokens, "temperature": 0.0, **kw}


def test_tp2_is_refused():
    """SmolLM2's 9 heads do not split over 2 ranks: the server exits 1 at start-up with one line
    naming the flag and the sizes that work, instead of serving a wrong split."""
    s = ServerProcess("--max-total-tokens", str(POOL), "--tp-size", "2")
    try:
        assert s.proc.wait(s.startup_timeout) == 1
        log = s.log_tail(100_000)
        # the error line the server prints for the user: the flag, the count, the sizes that work
        assert re.search(r"^sparkserve: error: the scheduler failed to start: ValueError: --tp-size 2: "
                         r"the model's 9 attention heads do not split over 2 ranks; use one of 1, 3, 9$",
                         log, re.M), log
        assert "Traceback" not in log        # a flag error is one line, from every rank
    finally:
        s.stop()
        s.remove_log()


def test_chat_greedy_equals_engine(client, engine, model_name):
    for msgs in CHATS:
        ref = engine.run(messages=msgs, sampling_params=greedy())
        r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=MAX_TOKENS,
                                           temperature=0)
        assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref["text"]
        assert r.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]
        assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_async_with_usage(server, engine, model_name):
    msgs = CHATS[1]
    ref = engine.run(messages=msgs, sampling_params=greedy())

    async def go():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                     timeout=120)
        stream = await aclient.chat.completions.create(
            model=model_name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await aclient.close()
        return chunks

    chunks = asyncio.run(go())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref["meta_info"]["finish_reason"]["type"]]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert last.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_content_as_parts(client, engine, model_name):
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Answer in one word."}]
    ref = engine.run(messages=[{"role": "user", "content": "Name a colour.\nAnswer in one word."}],
                     sampling_params=greedy())
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": parts}],
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]


def test_completions_text_token_ids_and_batches(client, engine, model_name):
    refs = engine.run(prompt=PROMPTS, sampling_params=greedy())
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.id.startswith("cmpl-") and r.choices[0].text == refs[0]["text"]
    # token ids, one prompt and a batch of them: same answers as the text prompts
    ids = [engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    r = client.completions.create(model=model_name, prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == refs[1]["text"]
    for prompt in (PROMPTS, ids):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert [c.index for c in r.choices] == [0, 1]
        assert [c.text for c in r.choices] == [x["text"] for x in refs]
        assert r.usage.prompt_tokens == sum(x["meta_info"]["prompt_tokens"] for x in refs)
        assert r.usage.completion_tokens == sum(x["meta_info"]["completion_tokens"] for x in refs)


def test_completions_stream_sync(client, engine, model_name):
    ref = engine.run(prompt=PROMPTS[1], sampling_params=greedy())
    stream = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_greedy_and_seeded(client, engine, model_name):
    ref = engine.run(prompt=PROMPTS[0], sampling_params=greedy())
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [ref["text"]] * 2
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    # sampled with a seed: choice i uses seed + i, exactly as the Engine fans n out
    refs = engine.run(prompt=PROMPTS[0], sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 1.0,
                                                          "seed": 1234, "n": 2})
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0,
                                  n=2, seed=1234)
    assert [c.text for c in r.choices] == [x["text"] for x in refs]
    r = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=4, temperature=0, n=2)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content


def test_stop_strings(client, engine, model_name):
    ref = engine.run(prompt=PROMPTS[1], sampling_params=greedy(16))["text"]
    stop = ref.strip().split()[1]                      # a word from the middle of the answer
    cut = ref[:ref.index(stop)]
    r = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                  stop=stop)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                       stop=[stop, "never-matches"], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_shapes(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
        assert c.top_logprobs[0].token == c.token                     # greedy: the chosen one is the best
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs),
                                                             reverse=True)
    r = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(t) == 2 for t in lp.top_logprobs)
    # streamed chat logprobs arrive with their tokens
    stream = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=5, temperature=0,
                                            logprobs=True, stream=True)
    got = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in got] == [c.token for c in content]


def test_max_completion_tokens_ignore_eos_and_extra_params(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=CHATS[0], max_completion_tokens=7,
                                       temperature=0.7, seed=3,
                                       extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05,
                                                   "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    again = client.chat.completions.create(model=model_name, messages=CHATS[0], max_completion_tokens=7,
                                           temperature=0.7, seed=3,
                                           extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05,
                                                       "repetition_penalty": 1.1})
    assert again.choices[0].message.content == r.choices[0].message.content   # seeded: reproducible


def test_logit_bias_equals_engine(client, engine, model_name):
    """OpenAI's logit_bias: -100 bans the greedy answer's first token, +100 makes a token certain
    even when sampling; the server answers as the engine does with the same bias."""
    first = engine.run(messages=CHATS[0], sampling_params=greedy(1))["output_ids"][0]
    refs = []
    for bias, temperature in (({str(first): -100}, 0.0), ({"284": 100}, 0.7)):
        sp = {"max_new_tokens": 5, "temperature": temperature, "seed": 3, "ignore_eos": True,
              "logit_bias": bias}
        refs.append(engine.run(messages=CHATS[0], sampling_params=sp))
        r = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=5,
                                           temperature=temperature, seed=3, logit_bias=bias,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == refs[-1]["text"]
    assert refs[0]["output_ids"][0] != first and refs[1]["output_ids"] == [284] * 5


def test_models_and_unknown_model(client, model_name, server):
    assert model_name in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHATS[0], max_tokens=2)
    assert "no-such-model" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", max_tokens=POOL * 10)
    assert "max_tokens" in str(e.value) and str(POOL * 10) in str(e.value)


def test_sglang_generate_equals_engine(server, engine):
    ref = engine.run(prompt=PROMPTS[0], sampling_params=greedy(return_logprob=True, top_logprobs_num=2))
    r = httpx.post(server.url + "/generate", json={"text": PROMPTS[0], "sampling_params": greedy()},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == ref["text"] and body["output_ids"] == ref["output_ids"]
    meta = body["meta_info"]
    assert meta["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens"} <= set(meta)
    # input_ids + logprobs, streamed: SGLang's chunks carry the cumulative text
    ids = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    with httpx.stream("POST", server.url + "/generate", timeout=120,
                      json={"input_ids": ids, "sampling_params": greedy(), "stream": True,
                            "return_logprob": True, "top_logprobs_num": 2}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == ref["text"] and chunks[-1]["output_ids"] == ref["output_ids"]
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(len(chunks) - 1))
    lps = chunks[-1]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == ref["output_ids"]
    # the values too: a TP/PP driver computes the one-process logits, up to fp summation order
    # (the Engine's entries are (logprob, id), SGLang's /generate ones [logprob, id, text])
    want_lps, want_tops = ref["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_top_logprobs"]
    assert [lp for lp, _, _ in lps] == pytest.approx([lp for lp, _ in want_lps], abs=1e-4)
    tops = chunks[-1]["meta_info"]["output_top_logprobs"]
    assert [[t for _, t, _ in top] for top in tops] == [[t for _, t in top] for top in want_tops]
    assert all(len(top) == 2 for top in tops)
    # hidden states need --enable-return-hidden-states (test_return_hidden_states has a server with it)
    r = httpx.post(server.url + "/generate", timeout=30,
                   json={"text": PROMPTS[0], "sampling_params": greedy(), "return_hidden_states": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states", r.text
    assert "--enable-return-hidden-states" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": CHATS[0], "max_tokens": 4, "return_hidden_states": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states", r.text


def test_server_and_model_info(server):
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    assert info == httpx.get(server.url + "/get_server_info", timeout=10).json() | {
        "internal_states": info["internal_states"]}
    assert info["model_path"].endswith(".gguf")
    assert info["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")    # --device auto, resolved
    # the embedded model answers to a short name and to "default", not to its file path only
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server.url + "/v1/models/default", timeout=10).status_code == 200
    # tokenizer_path: an HF tokenizer directory (exported from the GGUF) that transformers loads as
    # the server's own tokenizer, so load generators can count tokens with it
    from transformers import AutoTokenizer

    from sparkserve.frontend.tokenizer import Tokenizer
    hf, ours = AutoTokenizer.from_pretrained(info["tokenizer_path"]), Tokenizer.from_gguf(info["model_path"])
    for text in PROMPTS + ["<|im_start|>user\nHi 🙂 ünïcode<|im_end|>"]:
        assert hf(text)["input_ids"] == ours.encode(text, add_special_tokens=True), text
    assert hf.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(CHATS[0], add_generation_prompt=True)
    assert (info["tp_size"], info["pp_size"]) == (server.tp_size, server.pp_size)
    # and it runs that many ranks: the scheduler (rank 0) and one process per other rank
    assert len(server.rank_pids(info["scheduler_pid"])) == server.tp_size * server.pp_size - 1
    assert info["dp_size"] == server.dp_size and info["disaggregation_mode"] == "null"
    assert info["max_total_tokens"] == POOL
    model = httpx.get(server.url + "/model_info", timeout=10).json()
    assert model["model_path"] == info["model_path"] and model["is_generation"] is True
    assert httpx.get(server.url + "/get_model_info",
                     timeout=10).json()["tokenizer_path"] == info["tokenizer_path"]
