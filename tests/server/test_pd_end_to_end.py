"""PD disaggregation end to end: a `--disaggregation-mode prefill` and a `--disaggregation-mode
decode` server (tiny chat model) behind a PD router, the real sglang-router 0.3.2
(`--pd-disaggregation`) or `sparkserve router`. The router discovers the servers' roles from
/server_info; each request runs its prompt on the prefill server and its decode on the decode
server (whose log never shows a prefill batch), and greedy answers equal a colocated run of the
same requests (sent straight to the prefill server, without bootstrap fields)."""
from __future__ import annotations

import json

import httpx
import pytest
from pd_fixtures import start_router
from server_harness import ServerProcess, free_port
from tiny_chat_fixtures import make_tiny_chat_checkpoint

T = 60
GEN = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
BATCH = {"text": ["The sky", "Rain is"], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
# no model: sglang-router then sends model "unknown", which means the served model; its
# /v1/completions needs one ("default" is every server's alias)
CHAT = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
COMPLETION = {"model": "default", "prompt": ["The sky is", "Rain"], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module", params=["tiny-chat", "smollm2-dspark"])
def pd(request, tmp_path_factory):
    """(prefill server, decode server, the prefill server's bootstrap port): a tiny chat model, or
    the embedded SmolLM2 with its shipped DSpark draft on both sides."""
    if request.param == "tiny-chat":
        path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
        model = ("--model-path", path)
    else:       # exact activations: the colocated run may batch the prompts otherwise (kernel-notes)
        model = ("--speculative-algorithm", "DSPARK", "--speculative-dspark-verify-mode", "full",
                 "--activation-quant", "none")
    port = free_port()
    common = (*model, "--max-total-tokens", "2048", "--log-level", "info")
    prefill = ServerProcess(*common, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*common, "--disaggregation-mode", "decode",
                           "--disaggregation-bootstrap-port", str(free_port()))
    for s in (prefill, decode):
        s.wait_ready()
    yield prefill, decode, port
    for s in (prefill, decode):
        s.stop()
        s.remove_log()


@pytest.fixture(scope="module", params=["sglang-router", "sparkserve-router"])
def router(request, pd):
    prefill, decode, bootstrap = pd
    proc, url = start_router(request.param, prefill, bootstrap, decode)
    yield request.param, url
    proc.terminate()
    proc.wait(10)


def _prefill_batches(server: ServerProcess) -> int:
    return server.log_tail(1 << 30).count("Prefill batch")


def test_the_router_sees_the_roles(pd, router):
    kind, url = router
    prefill, decode, bootstrap = pd
    if kind == "sparkserve-router":             # it was told the roles; its info routes are decode's
        assert httpx.get(url + "/server_info", timeout=T).json()["disaggregation_mode"] == "decode"
        return
    workers = {w["url"]: w for w in httpx.get(url + "/workers", timeout=T).json()["workers"]}
    assert workers[prefill.url]["worker_type"] == "prefill"
    assert workers[prefill.url]["bootstrap_port"] == bootstrap
    assert workers[decode.url]["worker_type"] == "decode"
    assert workers[prefill.url]["metadata"]["disaggregation_mode"] == "prefill"
    assert workers[decode.url]["metadata"]["disaggregation_mode"] == "decode"
    assert all(w["is_healthy"] for w in workers.values())


def test_greedy_answers_through_pd_equal_colocated_ones(pd, router):
    kind, url = router
    prefill, decode, _ = pd
    cases = [("/generate", GEN), ("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
    if kind == "sparkserve-router":
        cases.append(("/generate", BATCH))      # sglang-router refuses a batched /generate itself
    for path, body in cases:
        want = httpx.post(prefill.url + path, json=body, timeout=T).json()   # colocated there
        before = _prefill_batches(prefill)
        got = httpx.post(url + path, json=body, timeout=T)
        assert got.status_code == 200, got.text
        got = got.json()
        if path == "/generate":
            pairs = zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got],
                        strict=True)
            assert all((a["text"], a["output_ids"]) == (b["text"], b["output_ids"]) for a, b in pairs)
        else:
            assert got["choices"] == want["choices"]
        assert _prefill_batches(prefill) > before
    want = httpx.post(prefill.url + "/v1/chat/completions", json=CHAT, timeout=T).json()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=T) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(c["delta"].get("content") or ""
                   for line in lines[:-1] for c in json.loads(line[6:])["choices"])
    assert text == want["choices"][0]["message"]["content"]
    assert _prefill_batches(decode) == 0        # every prompt ran on the prefill server


def test_seeded_sampling_and_dspark_through_pd(pd, router):
    """A seeded sampled answer equals the colocated one (the RNG state goes over with the first
    token); with DSpark the decode server drafts and verifies."""
    _, url = router
    prefill, _, _ = pd
    body = {"text": "Tell me a story about", "sampling_params": {"max_new_tokens": 12, "temperature": 0.9,
                                                                 "top_p": 0.95, "sampling_seed": 5}}
    want = httpx.post(prefill.url + "/generate", json=body, timeout=T).json()
    got = httpx.post(url + "/generate", json=body, timeout=T)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want["output_ids"]
    if httpx.get(prefill.url + "/server_info", timeout=T).json().get("speculative_algorithm"):
        greedy = {"text": "The capital of France is",
                  "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        meta = httpx.post(url + "/generate", json=greedy, timeout=T).json()["meta_info"]
        assert meta["spec_verify_ct"] > 0


def test_token_ids_servers_behind_both_routers(tiny_dirs):
    """--skip-tokenizer-init servers (a model directory without a tokenizer): token ids in and out
    through /generate behind either router, equal to a colocated answer."""
    port = free_port()
    common = ("--model-path", tiny_dirs["llama"], "--skip-tokenizer-init", "--max-total-tokens", "1024")
    prefill = ServerProcess(*common, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*common, "--disaggregation-mode", "decode")
    procs = []
    try:
        body = {"input_ids": list(range(5, 30)), "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                     "ignore_eos": True}}
        want = httpx.post(prefill.url + "/generate", json=body, timeout=T).json()["output_ids"]
        for kind in ("sglang-router", "sparkserve-router"):
            proc, url = start_router(kind, prefill, port, decode)
            procs.append(proc)
            got = httpx.post(url + "/generate", json=body, timeout=T)
            assert got.status_code == 200, got.text
            assert got.json()["output_ids"] == want
        assert _prefill_batches(decode) == 0
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        for s in (prefill, decode):
            s.stop()
            s.remove_log()
