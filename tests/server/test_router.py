"""The real sglang-router (regular mode) in front of `sparkserve serve`: it discovers the worker
through /health, /server_info and /model_info and forwards OpenAI and SGLang requests; answers
equal the server's own."""
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import ServerProcess, free_port


@pytest.fixture(scope="module")
def stack():
    server = ServerProcess()
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server.url,
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
         "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert router.poll() is None, "router exited"
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        pytest.fail("router did not come up")
    yield server, base
    router.terminate()
    router.wait(timeout=10)
    server.stop()

def _model(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]

def test_chat_through_router_equals_direct(stack):
    server, router = stack
    body = {"model": _model(server.url), "messages": [{"role": "user", "content": "Name a color."}],
            "max_tokens": 12, "temperature": 0}
    direct = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    routed = httpx.post(router + "/v1/chat/completions", json=body, timeout=120).json()
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]

def test_generate_through_router_equals_direct(stack):
    server, router = stack
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    direct = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    routed = httpx.post(router + "/generate", json=body, timeout=120).json()
    assert routed["text"] == direct["text"] and routed["output_ids"] == direct["output_ids"]

def test_streaming_through_router(stack):
    server, router = stack
    body = {"model": _model(server.url), "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 16, "temperature": 0}
    direct = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    text = ""
    with httpx.stream("POST", router + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json
    for line in lines[:-1]:
        for c in json.loads(line[6:]).get("choices", []):
            text += c.get("delta", {}).get("content") or ""
    assert text == direct["choices"][0]["message"]["content"]
