"""PD disaggregation through the HTTP layer: the bootstrap fields a PD router adds
(bootstrap_host, bootstrap_port, bootstrap_room) become each sequence's `GenerateReq.bootstrap` on
a `--disaggregation-mode prefill|decode` server, on /generate (one value or one per prompt),
/v1/completions and /v1/chat/completions; what a paired request may not be (no host or room, n > 1,
lists that do not match the prompts, repeated or out-of-range rooms) is a 400 naming the field, and
nothing reaches the scheduler. A request without the fields runs colocated; a null-mode server
ignores them. Most of it runs in-process against an app whose scheduler link records what it is
sent; one real decode-mode server (tiny model) checks the same through a running server."""
from __future__ import annotations

import httpx
import pytest
from server_harness import ServerProcess, free_port
from tiny_chat_fixtures import make_tiny_chat_checkpoint

from sparkserve.messages import Bootstrap

DEFAULT_PORT = 9100          # the servers' --disaggregation-bootstrap-port in these tests
ROOM = 7748241041190344642   # a 63-bit room as a router draws it


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    return make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))


def _app(chat_dir: str, mode: str):
    """(TestClient, the GenerateReqs the scheduler was sent) of an in-process server in `mode`;
    its scheduler finishes each sequence with one token at once."""
    from starlette.testclient import TestClient

    from sparkserve.args import ServerArgs
    from sparkserve.core.finish_reason import FINISH_LENGTH
    from sparkserve.entrypoints.http_server import create_app
    from sparkserve.entrypoints.metrics import Metrics
    from sparkserve.entrypoints.tokenizer_manager import TokenizerManager
    from sparkserve.frontend.tokenizer import Tokenizer
    from sparkserve.messages import BatchOut, GenerateReq, LoadReq, ReqOutput, SchedulerLoad, SchedulerReady

    sent: list[GenerateReq] = []

    class SchedulerSocket:
        def send_pyobj(self, msg, *a):
            if isinstance(msg, GenerateReq):
                sent.append(msg)
                out = ReqOutput(msg.rid, [65], FINISH_LENGTH(1), len(msg.input_ids), 1, 0)
                tm._on_batch(BatchOut([out], SchedulerLoad()))
            elif isinstance(msg, LoadReq):
                tm._calls[msg.cid].set_result(SchedulerLoad(cid=msg.cid))

    args = ServerArgs(model_path=chat_dir, disaggregation_mode=mode,
                      disaggregation_bootstrap_port=DEFAULT_PORT).validate()
    ready = SchedulerReady(pid=0, vocab_size=320, context_length=256, max_total_num_tokens=1024,
                           max_running_requests=8, eos_token_ids=[257], architecture="LlamaForCausalLM")
    tm = TokenizerManager(args, Tokenizer.from_pretrained(chat_dir), ready, SchedulerSocket(), None,
                          Metrics("m"), lambda: None)
    return TestClient(create_app(args, tm)), sent, tm


@pytest.fixture(scope="module")
def decode_app(chat_dir):
    return _app(chat_dir, "decode")


GEN = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 1}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "hi", "max_tokens": 1}
PAIR = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": ROOM}


def _sent(app, path: str, body: dict) -> list[Bootstrap | None]:
    client, sent, _ = app
    sent.clear()
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return [s.bootstrap for s in sent]


def test_bootstrap_reaches_every_generate_req(decode_app):
    pair = Bootstrap("10.0.0.7", 8998, ROOM)
    assert _sent(decode_app, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, **PAIR}) \
        == [pair]
    assert _sent(decode_app, "/v1/chat/completions", {**CHAT, **PAIR}) == [pair]
    assert _sent(decode_app, "/v1/completions", {**COMPLETION, **PAIR}) == [pair]
    # a batch: one value per prompt (what sglang-router sends for a batched completion) ...
    lists = {"bootstrap_host": ["a", "b"], "bootstrap_port": [8998, None], "bootstrap_room": [5, 9]}
    want = [Bootstrap("a", 8998, 5), Bootstrap("b", DEFAULT_PORT, 9)]
    assert _sent(decode_app, "/generate", {**GEN, **lists}) == want
    assert _sent(decode_app, "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 1, **lists}) == want
    # ... or one for all: room + p for prompt p (SGLang's rule); no port: this server's
    one = {"bootstrap_host": "h", "bootstrap_room": 40}
    assert _sent(decode_app, "/generate", {**GEN, **one}) == [Bootstrap("h", DEFAULT_PORT, 40),
                                                              Bootstrap("h", DEFAULT_PORT, 41)]
    assert _sent(decode_app, "/generate", {**GEN, **one, "bootstrap_port": None}) == \
        [Bootstrap("h", DEFAULT_PORT, 40), Bootstrap("h", DEFAULT_PORT, 41)]


def test_without_bootstrap_fields_runs_colocated(decode_app):
    assert _sent(decode_app, "/generate", GEN) == [None, None]
    assert _sent(decode_app, "/v1/chat/completions", {**CHAT, "n": 2}) == [None, None]
    assert decode_app[0].get("/health_generate").status_code == 200


def test_sglang_routers_stand_in_for_no_model_is_the_served_model(decode_app):
    """sglang-router sends model "unknown" for a chat request that named none."""
    assert _sent(decode_app, "/v1/chat/completions", {**CHAT, "model": "unknown"}) == [None]
    r = decode_app[0].post("/v1/chat/completions", json={**CHAT, "model": "another"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {**GEN, "bootstrap_host": "h", "bootstrap_port": 1}, "bootstrap_room"),
    ("/v1/chat/completions", {**CHAT, "bootstrap_room": 3}, "bootstrap_host"),
    ("/v1/completions", {**COMPLETION, "bootstrap_port": 8998}, "bootstrap_host"),
    ("/v1/completions", {**COMPLETION, "bootstrap_host": "h", "bootstrap_room": None}, "bootstrap_room"),
    # n > 1: the choices would share the one room
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "n": 2}, **PAIR}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 2, **PAIR}, "n"),
    ("/v1/completions", {**COMPLETION, "n": 3, **PAIR}, "n"),
    # one value per prompt, or one for all
    ("/generate", {**GEN, **PAIR, "bootstrap_room": [1, 2, 3]}, "bootstrap_room"),
    ("/generate", {**GEN, **PAIR, "bootstrap_host": ["h"]}, "bootstrap_host"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, **PAIR, "bootstrap_port": [1]},
     "bootstrap_port"),
    ("/v1/chat/completions", {**CHAT, **PAIR, "bootstrap_room": [1, 2]}, "bootstrap_room"),
    ("/generate", {**GEN, **PAIR, "bootstrap_room": [4, 4]}, "bootstrap_room"),
    # values
    ("/generate", {**GEN, **PAIR, "bootstrap_room": -1}, "bootstrap_room"),
    ("/generate", {**GEN, **PAIR, "bootstrap_room": [0, 1 << 63]}, "bootstrap_room"),
    ("/generate", {**GEN, **PAIR, "bootstrap_room": (1 << 63) - 1}, "bootstrap_room"),   # room + 1 overflows
    ("/generate", {**GEN, **PAIR, "bootstrap_port": 0}, "bootstrap_port"),
    ("/v1/completions", {**COMPLETION, **PAIR, "bootstrap_host": ""}, "bootstrap_host"),
    ("/v1/completions", {**COMPLETION, **PAIR, "bootstrap_room": "5"}, "bootstrap_room"),
])
def test_bad_pairing_is_a_400_naming_the_field(decode_app, path, body, param):
    client, sent, tm = decode_app
    sent.clear()
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    assert sent == [] and tm.inflight == 0


def test_null_mode_ignores_the_fields(chat_dir):
    app = _app(chat_dir, "null")
    assert _sent(app, "/generate", {**GEN, **PAIR}) == [None, None]
    assert _sent(app, "/v1/chat/completions", {**CHAT, "n": 2, "bootstrap_room": 1}) == [None, None]
    info = app[0].get("/server_info").json()
    assert info["disaggregation_mode"] == "null" and info["disaggregation_bootstrap_port"] == DEFAULT_PORT


def test_server_info_reports_the_mode(decode_app, chat_dir):
    info = decode_app[0].get("/server_info").json()
    assert info["disaggregation_mode"] == "decode" and info["disaggregation_bootstrap_port"] == DEFAULT_PORT
    prefill = _app(chat_dir, "prefill")
    assert prefill[0].get("/get_server_info").json()["disaggregation_mode"] == "prefill"
    assert _sent(prefill, "/v1/completions", {**COMPLETION, **PAIR}) == [Bootstrap("10.0.0.7", 8998, ROOM)]


def test_a_running_decode_server(chat_dir):
    """The same through a real `--disaggregation-mode decode` server: it reports its mode, answers
    requests without the fields itself (they run colocated) and refuses a bad pairing."""
    s = ServerProcess("--model-path", chat_dir, "--max-total-tokens", "1024",
                      "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(free_port()))
    try:
        info = httpx.get(s.url + "/server_info", timeout=10).json()
        assert info["disaggregation_mode"] == "decode"
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(s.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        r = httpx.post(s.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
        r = httpx.post(s.url + "/generate", json={**body, "bootstrap_host": "h"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text
        r = httpx.post(s.url + "/v1/chat/completions", json={**CHAT, **PAIR, "n": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert httpx.get(s.url + "/health_generate", timeout=60).status_code == 200
    finally:
        s.stop()
        s.remove_log()
