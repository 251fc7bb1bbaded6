"""A bounded property-based fuzz of every HTTP endpoint: `sparkserve serve` (OpenAI, SGLang and
operations routes) and `sparkserve router` in front of it. Bodies are drawn per endpoint from its
fields, each one a good value, a well-typed extreme one (huge, negative, empty, long, unicode) or
garbage (wrong types, nested JSON, numbers past a float, lone surrogates), or the body is not JSON
at all. Every answer comes within a timeout and is no 5xx but 503 (overload, no server); errors
are OpenAI-shaped; afterwards a plain request is answered through both, and no KV slot stays used.

The router sends each request to a prefill and a decode server; here one null-mode server is both
(it ignores the pairing and runs each half whole), so the router's own work (parsing, pairing,
passing on or cancelling) is fuzzed without a second model. The server's context is short, so an
accepted request (n <= 8 sequences, as --max-queued-requests admits) generates for a second at
most. Fixed examples, derandomized: the same bodies on every run.

test_server_robustness.py fuzzes the generation endpoints with mutations of valid bodies behind
an API key; this file covers every route and the router."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_harness import ServerProcess, free_port

CONTEXT = 160
RUNNING, QUEUED = 4, 4
TIMEOUT = 30.0                  # seconds any one answer may take: more is a hang
VOCAB = 49152


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--context-length", str(CONTEXT), "--max-total-tokens", "2048",
                      "--max-running-requests", str(RUNNING), "--max-queued-requests", str(QUEUED))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
    s.remove_log()


@pytest.fixture(scope="module")
def router(server):
    """`sparkserve router` with the one server as its prefill and its decode server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "sparkserve.cli", "router", "--prefill", server.url,
                             "none", "--decode", server.url, "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the router exited"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the router did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


# ---- values ------------------------------------------------------------------------------------
HUGE_INTS = st.sampled_from([-1, 0, 2**31, 2**63, -(2**63), 2**64, 10**30, -(10**30), 10**400, CONTEXT,
                             CONTEXT + 1, VOCAB, 2**70])
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -0.0, 5e-324]))
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(
    ["", "\x00", "\ud800", "a\udc00b", "\U0001F600" * 8, "<|im_end|>", "<|im_start|>", "a" * 400, "\u202e",
     "Hello!", " " * 50]))
WORDS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=20)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), HUGE_INTS, FLOATS, TEXT)
GARBAGE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(TEXT, inner, max_size=3)),
                       max_leaves=8)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
BAD_IDS = st.one_of(st.lists(st.sampled_from([-1, VOCAB, 2**63, 10**400]), min_size=1, max_size=2),
                    st.just([]), st.just([[]]), st.just([1] * (CONTEXT + 1)), st.just([[1]] * 2049))


class F:
    """A field: its good values (None: only ever drawn bad) and its extreme well-typed ones
    (garbage is drawn for any field)."""

    def __init__(self, good: st.SearchStrategy | None, extreme: st.SearchStrategy | None = None):
        self.good = good
        self.bad = st.one_of(extreme, GARBAGE) if extreme is not None else GARBAGE


def body_of(required: dict[str, F], optional: dict[str, F]) -> st.SearchStrategy:
    """A good body (the required fields and some optional ones), then 0-3 fields made extreme,
    garbage, or removed: most bodies are wrong in one place, as a client's mistake is."""
    names = sorted({**required, **optional})
    fields = {**required, **optional}
    drawn = sorted(k for k, f in optional.items() if f.good is not None)

    @st.composite
    def build(draw):
        body = {k: draw(f.good) for k, f in required.items()}
        for k in draw(st.lists(st.sampled_from(drawn), max_size=4, unique=True)):
            body[k] = draw(optional[k].good)
        for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
            k = draw(st.sampled_from(names))
            if draw(st.integers(0, 4)) == 0:
                body.pop(k, None)
            else:
                body[k] = draw(fields[k].bad)
        return body
    return build()


SMALL = st.integers(0, 3)
SAMPLING = {
    "temperature": F(st.floats(0, 2), FLOATS), "top_p": F(st.floats(0.01, 1), FLOATS),
    "top_k": F(st.integers(-1, 50), HUGE_INTS), "min_p": F(st.floats(0, 1), FLOATS),
    "repetition_penalty": F(st.floats(0.5, 2), FLOATS), "frequency_penalty": F(st.floats(-2, 2), FLOATS),
    "presence_penalty": F(st.floats(-2, 2), FLOATS), "seed": F(st.integers(0, 2**40), HUGE_INTS),
    "n": F(st.integers(1, 2), st.one_of(HUGE_INTS, st.integers(3, 9))),
    "stop": F(st.one_of(WORDS, st.lists(WORDS, max_size=3)),
              st.one_of(TEXT, st.just(["x"] * 17), st.just("y" * 1025), st.just([]), st.just([""]))),
    "stop_token_ids": F(st.lists(st.integers(0, VOCAB - 1), max_size=3),
                        st.one_of(st.just([2] * 1025), st.lists(HUGE_INTS, max_size=2))),
    "logit_bias": F(st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
                    st.one_of(st.dictionaries(st.sampled_from(["-1", "49152", "1" * 40, "\u0663", "x", ""]),
                                              FLOATS, max_size=2),
                              st.just({str(i): 1 for i in range(1025)}))),
    "ignore_eos": F(st.booleans()), "skip_special_tokens": F(st.booleans()), "no_stop_trim": F(st.booleans()),
}
OPENAI = {**SAMPLING, "min_tokens": F(SMALL, HUGE_INTS),
          "model": F(st.sampled_from(["default", "SmolLM2-135M-Instruct"]), TEXT),
          "stream": F(st.booleans()),
          "stream_options": F(st.fixed_dictionaries({"include_usage": st.booleans()})),
          "user": F(TEXT), "rid": F(None, st.one_of(TEXT, st.just("r" * 257))),
          "routed_dp_rank": F(st.just(0), HUGE_INTS), "return_hidden_states": F(st.just(False)),
          "bootstrap_host": F(st.just("127.0.0.1"), st.just("h" * 254)),
          "bootstrap_room": F(st.integers(0, 9), HUGE_INTS)}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.one_of(WORDS, WORDS, TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": WORDS}), min_size=1, max_size=2))})
BAD_MESSAGES = st.one_of(st.just([]),
                         st.lists(st.fixed_dictionaries({}, optional={"role": TEXT, "content": GARBAGE}),
                                  min_size=1, max_size=2),
                         st.just([{"role": "user", "content": "x"}] * 16385))
CHAT = body_of(
    {"messages": F(st.lists(MESSAGE, min_size=1, max_size=3), BAD_MESSAGES),
     "max_tokens": F(SMALL, HUGE_INTS)},
    {**OPENAI, "max_completion_tokens": F(SMALL, HUGE_INTS), "logprobs": F(st.booleans()),
     "top_logprobs": F(st.integers(0, 5), HUGE_INTS), "tools": F(st.just([])),
     "response_format": F(st.just({"type": "text"})),
     "chat_template_kwargs": F(st.just({}), st.dictionaries(TEXT, GARBAGE, max_size=2))})
PROMPT = st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=3), TOKEN_IDS, st.lists(TOKEN_IDS, min_size=1,
                                                                                         max_size=3))
COMPLETION = body_of(
    {"prompt": F(PROMPT, st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2), st.just(["a"] * 2049),
                                   BAD_IDS)),
     "max_tokens": F(SMALL, HUGE_INTS)},
    {**OPENAI, "logprobs": F(st.integers(0, 5), HUGE_INTS), "echo": F(st.booleans()),
     "best_of": F(st.integers(1, 3), HUGE_INTS), "suffix": F(st.just(""), TEXT)})
GEN_SAMPLING = body_of({"max_new_tokens": F(SMALL, HUGE_INTS)},
                       {**SAMPLING, "min_new_tokens": F(SMALL, HUGE_INTS), "unknown_knob": F(None)})
GEN_PROMPT = st.one_of(
    st.fixed_dictionaries({"text": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=3))}),
    st.fixed_dictionaries({"input_ids": st.one_of(TOKEN_IDS, st.lists(TOKEN_IDS, min_size=1, max_size=3))}))
GENERATE = st.tuples(GEN_PROMPT, body_of(
    {"sampling_params": F(GEN_SAMPLING, st.lists(GEN_SAMPLING, min_size=1, max_size=2))},
    {"text": F(None, st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2), st.just(["a"] * 2049))),
     "input_ids": F(None, st.one_of(TOKEN_IDS, BAD_IDS)),
     "stream": F(st.booleans()), "return_logprob": F(st.booleans()),
     "top_logprobs_num": F(st.integers(0, 5), HUGE_INTS), "rid": F(None, st.one_of(TEXT, st.just("r" * 257))),
     "return_text_in_logprobs": F(st.booleans()), "logprob_start_len": F(st.integers(-1, 3)),
     "routed_dp_rank": F(st.just(0), HUGE_INTS), "data_parallel_rank": F(st.just(0), HUGE_INTS)})
).map(lambda pair: {**pair[0], **pair[1]})
ABORT = body_of({}, {"rid": F(TEXT, st.just("r" * 257)), "abort_all": F(st.booleans())})
NOT_JSON = st.one_of(st.binary(max_size=40), st.sampled_from(
    [b"", b"{", b"[" * 5000 + b"]" * 5000, b'{"a": ' * 3000 + b"1" + b"}" * 3000, b"\xff\xfe{}", b"NaN",
     b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", b"null", b"[]"]))
BODY = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/generate": GENERATE,
        "/abort_request": ABORT}
GENERATION = ["/v1/chat/completions", "/v1/completions", "/generate"]
GETS = ["/v1/models", "/health", "/health_generate", "/server_info", "/get_server_info", "/model_info",
        "/get_model_info", "/metrics", "/flush_cache"]


def request_to(paths: list[str], gets: list[str]) -> st.SearchStrategy:
    """(method, path, body): a POST of a drawn (or garbage, or non-JSON) body, or a GET (sometimes
    with a body or the wrong method)."""
    posts = st.sampled_from(paths).flatmap(lambda p: st.tuples(
        st.just("POST"), st.just(p),
        st.one_of(BODY.get(p, GARBAGE), BODY.get(p, GARBAGE), GARBAGE, NOT_JSON)))
    others = st.tuples(st.sampled_from(["GET", "GET", "GET", "POST", "PUT", "DELETE"]),
                       st.one_of(st.sampled_from(gets),
                                 TEXT.map(lambda t: "/v1/models/" + quote(t, safe="/",
                                                                          errors="surrogatepass"))),
                       st.one_of(st.none(), GARBAGE, NOT_JSON))
    return st.one_of(posts, posts, others)


def call(client: httpx.Client, method: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    t0 = time.monotonic()
    try:
        r = client.request(method, path, content=content)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {TIMEOUT}s (a hang): {method} {path} {content[:300]!r}")
    assert time.monotonic() - t0 < TIMEOUT
    return r


def check(r: httpx.Response, method: str, path: str, body) -> None:
    what = (method, path, str(body)[:300], r.status_code, r.text[:500])
    assert r.status_code < 500 or r.status_code == 503, what
    kind = r.headers.get("content-type", "")
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"] and "type" in err and "param" in err, what
    elif kind.startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", what
        for e in events[:-1]:
            err = json.loads(e).get("error")
            assert err is None or err["code"] < 500 or err["code"] == 503, what
    elif kind.startswith("application/json"):
        assert isinstance(r.json(), (dict, list)), what


# ---- the fuzz ----------------------------------------------------------------------------------
# What the fuzz found once, always tried: a top_k past int64 (crashed the scheduler's sampler kernel,
# so the server), a number past a float in /generate's sampling_params (a 500), JSON nested
# deeper than Python's parser goes (the router's 500).
FOUND = [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                           "top_k": 2**70}),
         ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": 2**64}}),
         ("POST", "/generate", {"text": "hi",
                                "sampling_params": {"max_new_tokens": 2, "temperature": 10**400}}),
         ("POST", "/v1/completions", b"[" * 5000 + b"]" * 5000)]


def found(test):
    for req in FOUND:
        test = example(req=req)(test)
    return test


@settings(max_examples=240, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(request_to(GENERATION + ["/abort_request", "/flush_cache", "/generate"], GETS))
@found
def test_fuzz_every_server_endpoint(http, req):
    method, path, body = req
    check(call(http, method, path, body), method, path, body)


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(request_to(GENERATION, ["/v1/models", "/health", "/server_info", "/model_info"]))
@found
def test_fuzz_router(router, req):
    method, path, body = req
    with httpx.Client(base_url=router, timeout=TIMEOUT) as client:
        check(call(client, method, path, body), method, path, body)


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict:
    """Until nothing runs or waits and no request holds a KV slot."""
    end = time.monotonic() + timeout
    while True:
        state = http.get("/server_info").json()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0 and state["num_used_tokens"] == 0 \
                and state["inflight_sequences"] == 0:
            return state
        assert time.monotonic() < end, f"not idle after {timeout}s: {state}"
        time.sleep(0.1)


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


RESPONSE_ITEM = st.one_of(
    MESSAGE, st.fixed_dictionaries({"role": st.sampled_from(["user", "developer"]), "content": st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": WORDS}),
        min_size=1, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"), "name": WORDS,
                           "arguments": st.just("{}")}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"),
                           "output": WORDS}))
RESPONSES = body_of(
    {"input": F(st.one_of(WORDS, st.lists(RESPONSE_ITEM, min_size=1, max_size=3)),
                st.one_of(TEXT, st.just([]), st.lists(st.dictionaries(TEXT, GARBAGE, max_size=3), min_size=1,
                                                      max_size=2))),
     "max_output_tokens": F(SMALL, HUGE_INTS)},
    {"model": OPENAI["model"], "instructions": F(WORDS), "temperature": SAMPLING["temperature"],
     "top_p": SAMPLING["top_p"], "stream": F(st.booleans()), "parallel_tool_calls": F(st.booleans()),
     "tools": F(st.just([{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
                st.lists(st.dictionaries(TEXT, GARBAGE, max_size=2), max_size=2)),
     "tool_choice": F(st.one_of(st.sampled_from(["auto", "none", "required"]),
                                st.just({"type": "function", "name": "f"}))),
     "text": F(st.just({"format": {"type": "text"}}), st.fixed_dictionaries({"format": GARBAGE})),
     "store": F(st.just(False)), "previous_response_id": F(None, TEXT), "metadata": F(st.just({"k": "v"}))})


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.one_of(RESPONSES, RESPONSES, GARBAGE, NOT_JSON))
def test_fuzz_responses_endpoint(http, body):
    check(call(http, "POST", "/v1/responses", body), "POST", "/v1/responses", body)


def test_after_the_fuzz_both_answer_and_no_kv_is_held(http, router):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0}
    direct = http.post("/v1/chat/completions", json=body)
    assert direct.status_code == 200, direct.text
    with httpx.Client(base_url=router, timeout=TIMEOUT) as client:
        routed = client.post("/v1/chat/completions", json=body)
        assert routed.status_code == 200, routed.text
        assert client.get("/health").status_code == 200
    assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    assert http.get("/health_generate").status_code == 200
    wait_idle(http)
    assert metric(http, "sglang:num_running_reqs") == 0 and metric(http, "sglang:token_usage") == 0
    assert http.post("/flush_cache").status_code == 200
    assert wait_idle(http)["num_cached_tokens"] == 0
