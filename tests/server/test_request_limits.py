"""Untrusted sizes: no request makes the server (or `sparkserve router`) hold or scan without
bound. Every size a body can carry has a limit (sparkserve/sampling_params.py, with its reason);
one over it is a 400 in OpenAI's shape naming the field, one at it is served. Also: a prompt over
the context length says the context length; a body over 32 MiB is a 413 before it is read whole;
a million wrong items in a list cost one error; a number too large for a float is a 400.

In-process: the real HTTP app and tokenizer, with a scheduler link that finishes every sequence
at once with one token (no model), so the limits themselves (thousands of sequences) run in
seconds."""
from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from sparkserve.args import ServerArgs
from sparkserve.core.finish_reason import FINISH_LENGTH
from sparkserve.entrypoints import openai_protocol
from sparkserve.entrypoints.http_io import MAX_BODY_BYTES
from sparkserve.entrypoints.http_server import create_app
from sparkserve.entrypoints.metrics import Metrics
from sparkserve.entrypoints.tokenizer_manager import TokenizerManager
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.messages import BatchOut, GenerateReq, LoadReq, ReqOutput, SchedulerLoad, SchedulerReady
from sparkserve.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_RID_CHARS,
    MAX_SEQUENCES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

VOCAB = 49152                   # the embedded SmolLM2's
CONTEXT = 512


class App:
    """The HTTP app over a scheduler link that answers each GenerateReq with one token and a
    length finish (and LoadReqs with an empty load)."""

    def __init__(self, **args):
        self.sent: list[GenerateReq] = []
        self.args = ServerArgs(**args).validate()
        ready = SchedulerReady(pid=0, vocab_size=VOCAB, context_length=CONTEXT,
                               max_total_num_tokens=4 * CONTEXT, max_running_requests=8, eos_token_ids=[2],
                               architecture="LlamaForCausalLM")
        self.tm = TokenizerManager(self.args, load_tokenizer_for(self.args), ready, self, None, Metrics("m"),
                                   lambda: None)
        self.client = TestClient(create_app(self.args, self.tm), raise_server_exceptions=False)

    def send_pyobj(self, msg, *a) -> None:
        if isinstance(msg, GenerateReq):
            self.sent.append(msg)
            out = ReqOutput(msg.rid, [7], FINISH_LENGTH(1), len(msg.input_ids), 1, 0)
            self.tm._on_batch(BatchOut([out], SchedulerLoad()))
        elif isinstance(msg, LoadReq):
            self.tm._calls[msg.cid].set_result(SchedulerLoad(cid=msg.cid))

    def post(self, path: str, body, **kw):
        self.sent.clear()
        return self.client.post(path, json=body, **kw) if not isinstance(body, bytes) else \
            self.client.post(path, content=body, **kw)


@pytest.fixture(scope="module")
def app() -> App:
    return App()


def ok(r, sequences: int | None = None, app: App | None = None) -> None:
    assert r.status_code == 200, r.text[:500]
    if sequences is not None:
        assert len(app.sent) == sequences


def refused(r, param: str, *words: str, status: int = 400) -> str:
    """The OpenAI error shape, naming `param` (in the message too), with `words` in the message."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    err = body["error"]
    assert body["object"] == "error" and err["code"] == status and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"].startswith(param), err
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err["message"]


def chat(content="hi", **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, **kw}


def completion(prompt="hi", **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 1, **kw}


def generate(sp: dict | None = None, **kw) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 1, **(sp or {})}, **kw}


# ---- n, best_of, prompts x n ------------------------------------------------------------------
def test_n(app):
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        ok(app.post(path, body(n=MAX_N)), MAX_N, app)
        refused(app.post(path, body(n=MAX_N + 1)), "n", str(MAX_N))
    ok(app.post("/generate", generate({"n": MAX_N})), MAX_N, app)
    refused(app.post("/generate", generate({"n": MAX_N + 1})), "n", str(MAX_N))
    ok(app.post("/v1/completions", completion(n=3, best_of=3)), 3, app)
    refused(app.post("/v1/completions", completion(n=1, best_of=MAX_N)), "best_of")


def test_sequences_of_a_request(app):
    """prompts x n: at most MAX_SEQUENCES, even though each prompt's n is allowed."""
    per = MAX_SEQUENCES // MAX_N
    ids = [[5, 6]] * per
    ok(app.post("/v1/completions", completion(ids, n=MAX_N)), MAX_SEQUENCES, app)
    refused(app.post("/v1/completions", completion(ids + [[5]], n=MAX_N)), "n", str(MAX_SEQUENCES),
            f"{per + 1} prompts")
    refused(app.post("/generate", {"input_ids": ids + [[5]], "sampling_params": {"max_new_tokens": 1,
                                                                                   "n": MAX_N}}),
            "n", str(MAX_SEQUENCES))
    assert app.sent == []


def test_capacity_bounds_n_below_the_fixed_cap():
    """With --max-queued-requests, what the server admits at once bounds a request too."""
    small = App(max_queued_requests=2)            # 8 running + 2 queued
    ok(small.post("/v1/chat/completions", chat(n=10)), 10, small)
    refused(small.post("/v1/chat/completions", chat(n=11)), "n", "10")


# ---- prompts ----------------------------------------------------------------------------------
def test_prompts_in_a_batch(app):
    ok(app.post("/generate", {"input_ids": [[5]] * MAX_PROMPTS, "sampling_params": {"max_new_tokens": 1}}),
       MAX_PROMPTS, app)
    for path, field, many in (("/v1/completions", "prompt", ["a"] * (MAX_PROMPTS + 1)),
                              ("/v1/completions", "prompt", [[5]] * (MAX_PROMPTS + 1)),
                              ("/generate", "text", ["a"] * (MAX_PROMPTS + 1)),
                              ("/generate", "input_ids", [[5]] * (MAX_PROMPTS + 1))):
        body = {field: many, "max_tokens": 1} if path == "/v1/completions" else \
            {field: many, "sampling_params": {"max_new_tokens": 1}}
        refused(app.post(path, body), field, str(MAX_PROMPTS), str(MAX_PROMPTS + 1))
    assert app.sent == []


def test_prompt_over_the_context_says_the_context_length(app):
    """Refused as a prompt (named by its field), not as a max_tokens problem; a prompt of exactly
    the context length still runs its prompt (max_new_tokens 0)."""
    long_ids, long_text = [5] * (CONTEXT + 1), "hello " * (2 * CONTEXT)
    cases = [("/v1/completions", completion(long_ids), "prompt"),
             ("/v1/completions", completion(["hi", long_text]), "prompt"),
             ("/v1/chat/completions", chat(long_text), "messages"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}, "messages"),
             ("/generate", {"input_ids": long_ids}, "input_ids"),
             ("/generate", {"text": long_text, "sampling_params": {"max_new_tokens": 0}}, "text")]
    for path, body, field in cases:
        msg = refused(app.post(path, body), field, f"context length of {CONTEXT}")
        assert "max_tokens" not in msg and "max_new_tokens" not in msg
    assert "prompt[1]" in refused(app.post("/v1/completions", completion(["hi", long_text])), "prompt")
    ok(app.post("/generate", {"input_ids": [5] * CONTEXT, "sampling_params": {"max_new_tokens": 0}}), 1, app)
    refused(app.post("/generate", {"input_ids": [5] * CONTEXT, "sampling_params": {"max_new_tokens": 1}}),
            "max_new_tokens", str(CONTEXT))


def test_token_ids_outside_the_vocabulary(app):
    for bad in (VOCAB, -1, 2**62):
        refused(app.post("/generate", {"input_ids": [5, bad]}), "input_ids", str(VOCAB))
        refused(app.post("/v1/completions", completion([[5], [5, bad]])), "prompt", str(VOCAB))
    ok(app.post("/generate", {"input_ids": [0, VOCAB - 1], "sampling_params": {"max_new_tokens": 1}}), 1, app)


def test_messages(app):
    """MAX_MESSAGES messages are checked (and refused only for their length: over CONTEXT tokens);
    one more is refused for its count, before the template renders them."""
    msgs = [{"role": "user", "content": "x"}] * MAX_MESSAGES
    r = app.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    refused(r, "messages", "context length")
    r = app.post("/v1/chat/completions", {"messages": msgs + msgs[:1], "max_tokens": 1})
    refused(r, "messages", str(MAX_MESSAGES), str(MAX_MESSAGES + 1))
    assert app.sent == []


# ---- sampling parameters -------------------------------------------------------------------------
def sampling_cases(field: str, good, bad) -> list[tuple[str, dict, dict, str]]:
    """(path, accepted body, refused body, param) of `field` on the three endpoints."""
    return [("/v1/chat/completions", chat(**{field: good}), chat(**{field: bad}), field),
            ("/v1/completions", completion(**{field: good}), completion(**{field: bad}), field),
            ("/generate", generate({field: good}), generate({field: bad}), field)]


def test_stop_strings(app):
    strings, chars = MAX_STOP_STRINGS, MAX_STOP_CHARS
    for good, bad, limit in ((["x"] * strings, ["x"] * (strings + 1), strings),
                             ("x" * chars, "x" * (chars + 1), chars),
                             (["a", "y" * chars], ["a", "y" * (chars + 1)], chars)):
        for path, good_body, bad_body, field in sampling_cases("stop", good, bad):
            ok(app.post(path, good_body))
            refused(app.post(path, bad_body), field, str(limit))


def test_stop_token_ids(app):
    good, bad = list(range(MAX_STOP_TOKEN_IDS)), [3] * (MAX_STOP_TOKEN_IDS + 1)
    for path, good_body, bad_body, field in sampling_cases("stop_token_ids", good, bad):
        ok(app.post(path, good_body))
        refused(app.post(path, bad_body), field, str(MAX_STOP_TOKEN_IDS), str(MAX_STOP_TOKEN_IDS + 1))


def test_logit_bias_entries(app):
    good = {str(t): -1 for t in range(MAX_LOGIT_BIAS_ENTRIES)}
    bad = {str(t): -1 for t in range(MAX_LOGIT_BIAS_ENTRIES + 1)}
    for path, good_body, bad_body, field in sampling_cases("logit_bias", good, bad):
        ok(app.post(path, good_body))
        assert len(app.sent[0].params.logit_bias) == MAX_LOGIT_BIAS_ENTRIES
        refused(app.post(path, bad_body), field, str(MAX_LOGIT_BIAS_ENTRIES), str(MAX_LOGIT_BIAS_ENTRIES + 1))
    # a key of many digits is no token id (and int() of a very long one only costs time)
    refused(app.post("/generate", generate({"logit_bias": {"1" * 5000: 1}})), "logit_bias", "token ids")


def test_top_logprobs(app):
    top = MAX_TOP_LOGPROBS
    cases = [("/v1/chat/completions", chat(logprobs=True, top_logprobs=top),
              chat(logprobs=True, top_logprobs=top + 1), "top_logprobs"),
             ("/v1/completions", completion(logprobs=top), completion(logprobs=top + 1), "logprobs"),
             ("/generate", generate(return_logprob=True, top_logprobs_num=top),
              generate(return_logprob=True, top_logprobs_num=top + 1), "top_logprobs_num"),
             ("/generate", generate({"return_logprob": True, "top_logprobs_num": top}),
              generate({"return_logprob": True, "top_logprobs_num": top + 1}), "top_logprobs_num")]
    for path, good, bad, field in cases:
        ok(app.post(path, good))
        assert app.sent[0].params.top_logprobs_num == top
        refused(app.post(path, bad), field, str(top))


def test_huge_numbers_are_400s_not_500s(app):
    """An int too large for a float (JSON allows 4300 digits) where a number belongs."""
    huge = 10**400
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty"):
        refused(app.post("/generate", generate({name: huge})), name, "finite")
        refused(app.post("/v1/chat/completions", chat(**{name: huge})), name, "finite")
    refused(app.post("/generate", generate({"logit_bias": {"5": huge}})), "logit_bias")
    for name in ("max_new_tokens", "n", "top_k", "seed", "min_new_tokens"):
        r = app.post("/generate", generate({name: -huge}))
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text[:300]


def test_top_k_of_the_whole_vocabulary_is_off(app):
    """A top_k past the vocabulary keeps every token: it reaches the scheduler as -1 (off), never
    as an int its sampler kernel cannot take (2**70 crashed the scheduler, and the server)."""
    for top_k, sent in ((2**70, -1), (VOCAB, -1), (VOCAB - 1, VOCAB - 1), (0, -1)):
        ok(app.post("/generate", generate({"top_k": top_k})), 1, app)
        assert app.sent[0].params.top_k == sent
        ok(app.post("/v1/chat/completions", chat(top_k=top_k)), 1, app)
        assert app.sent[0].params.top_k == sent


# ---- identifiers ------------------------------------------------------------------------------
def test_rid_length(app):
    good, bad = "r" * MAX_RID_CHARS, "r" * (MAX_RID_CHARS + 1)
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion),
                       ("/generate", lambda **kw: generate({"n": 2}, **kw))):
        ok(app.post(path, body(rid=good)))
        refused(app.post(path, body(rid=bad)), "rid", str(MAX_RID_CHARS), str(MAX_RID_CHARS + 1))
    ok(app.post("/generate", {"text": ["a", "b"], "rid": ["x", good],
                              "sampling_params": {"max_new_tokens": 1}}))
    refused(app.post("/generate", {"text": ["a", "b"], "rid": ["x", bad]}), "rid", str(MAX_RID_CHARS))
    assert app.client.post("/abort_request", json={"rid": good}).json() == {"aborted": 0}
    refused(app.client.post("/abort_request", json={"rid": bad}), "rid", str(MAX_RID_CHARS))


def test_bootstrap_host_length():
    """A PD request's bootstrap_host goes with every sequence: a DNS name's 253 characters at most."""
    pd = App(disaggregation_mode="decode")
    pair = {"bootstrap_room": 7}
    ok(pd.post("/generate", generate(**pair, bootstrap_host="h" * 253)), 1, pd)
    refused(pd.post("/generate", generate(**pair, bootstrap_host="h" * 254)), "bootstrap_host", "253")
    refused(pd.post("/v1/completions", completion(["a", "b"], **pair, bootstrap_host=["h", "h" * 254])),
            "bootstrap_host", "253")


# ---- the body itself --------------------------------------------------------------------------
def test_body_over_the_limit_is_413_before_it_is_read(app):
    refused_413(app.client.post("/generate", content=b" " * (MAX_BODY_BYTES + 1)))
    # chunked (no Content-Length to go by): reading stops at the limit, not at the body's end
    from starlette.requests import Request

    from sparkserve.entrypoints.http_io import ApiError, read_body
    chunk, pulled = b" " * (1 << 20), [0]

    async def receive():                 # a body 4 times the limit
        pulled[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": pulled[0] < 4 * (MAX_BODY_BYTES >> 20)}
    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(request))
    assert e.value.status == 413 and pulled[0] == (MAX_BODY_BYTES >> 20) + 1
    refused_413(app.client.post("/v1/completions", content=iter([chunk] * ((MAX_BODY_BYTES >> 20) + 1))))


def refused_413(r) -> None:
    assert r.status_code == 413, (r.status_code, r.text[:300])
    assert r.json()["error"]["code"] == 413 and "MiB" in r.json()["error"]["message"]


GEN, CMPL, CHAT = (openai_protocol.GenerateRequest, openai_protocol.CompletionRequest,
                   openai_protocol.ChatCompletionRequest)
LIST_FIELDS = [
    (GEN, "input_ids", b'"x"'), (GEN, "text", b"1"), (GEN, "rid", b"1"), (GEN, "sampling_params", b"1"),
    (GEN, "return_logprob", b"1"), (GEN, "top_logprobs_num", b'"x"'), (GEN, "logprob_start_len", b'"x"'),
    (GEN, "return_hidden_states", b"1"), (GEN, "bootstrap_host", b"1"), (GEN, "bootstrap_port", b'"x"'),
    (GEN, "bootstrap_room", b'"x"'), (CMPL, "prompt", b"true"), (CMPL, "stop", b"1"),
    (CMPL, "stop_token_ids", b'"x"'), (CHAT, "messages", b"1"), (CHAT, "tools", b"1"),
]


@pytest.mark.parametrize("schema,field,item", LIST_FIELDS,
                         ids=[f"{s.__name__}.{f}" for s, f, _ in LIST_FIELDS])
def test_a_wrong_item_stops_its_list(schema, field, item):
    """pydantic would report every wrong item of a list (and ApiError would turn each into
    Python): a few MiB of them took minutes and gigabytes. Each list stops at its first."""
    items = b",".join([item] * 100_000)
    nested = b"[" + b",".join([b"[" + item + b"]"] * 100_000) + b"]"
    for value in (b"[" + items + b"]", nested):
        with pytest.raises(ValidationError) as e:
            schema.model_validate_json(b'{"messages": [{}], "prompt": "", "' + field.encode() + b'": '
                                       + value + b"}")
        assert e.value.error_count() <= 4, (field, e.value.error_count())


def test_a_million_wrong_items_answer_at_once(app):
    body = b'{"input_ids": [' + b",".join([b'"x"'] * 1_000_000) + b"]}"
    t0 = time.monotonic()
    refused(app.post("/generate", body), "input_ids", "list[int]")
    assert time.monotonic() - t0 < 30            # minutes before each list stopped at its first item


# ---- sparkserve router ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router():
    """The PD router app in front of servers that do not answer: what it refuses by itself."""
    from sparkserve.entrypoints.router import create_router_app
    from sparkserve.entrypoints.router_pool import ServerPool
    pool = ServerPool([("http://127.0.0.1:9", None)], ["http://127.0.0.1:9"], interval=60)
    with TestClient(create_router_app(pool), raise_server_exceptions=False) as client:
        yield client


def test_router_limits(router):
    refused_413(router.post("/generate", content=b" " * (MAX_BODY_BYTES + 1)))
    deep = b"[" * 100_000 + b"]" * 100_000
    for body in (deep, b'{"text": ' + deep + b"}"):
        r = router.post("/v1/completions", content=body)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text[:300]
    for path, field, many in (("/generate", "text", ["a"] * (MAX_PROMPTS + 1)),
                              ("/generate", "input_ids", [[1]] * (MAX_PROMPTS + 1)),
                              ("/v1/completions", "prompt", ["a"] * (MAX_PROMPTS + 1))):
        refused(router.post(path, json={field: many}), field, str(MAX_PROMPTS))
    r = router.post("/generate", json={"text": ["a"] * MAX_PROMPTS})
    assert r.status_code == 503 and "no healthy" in r.json()["error"]["message"]    # on to the servers
