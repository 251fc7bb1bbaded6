"""PD disaggregation faults between real servers: each request gets a clear 5xx, both sides free
every slot, and the servers keep serving. The prefill server's scheduler process is paused
(SIGSTOP) to hold a request between the decode side's reservation and the transfer, so each fault
lands where it is meant to."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import ServerProcess, free_port

SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
IDS = list(range(5, 45))
TIMEOUT = "3"          # --disaggregation-bootstrap-timeout: faults are noticed within seconds


def _pair(path: str, decode_path: str | None = None) -> tuple[ServerProcess, ServerProcess, int]:
    port = free_port()
    common = ("--max-total-tokens", "1024", "--chunked-prefill-size", "16",
              "--disaggregation-bootstrap-timeout", TIMEOUT)
    prefill = ServerProcess("--model-path", path, *common, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess("--model-path", decode_path or path, *common, "--disaggregation-mode", "decode")
    prefill.wait_ready()
    decode.wait_ready()
    return prefill, decode, port


def _body(port: int) -> dict:
    return {"input_ids": IDS, "sampling_params": SP, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": random.getrandbits(63)}


def _scheduler_pid(server: ServerProcess) -> int:
    return httpx.get(server.url + "/server_info", timeout=10).json()["scheduler_pid"]


def _idle(server: ServerProcess) -> None:
    """No request held, no KV slot used (the prefix cache aside), and a plain request works."""
    end = time.monotonic() + 20
    while True:
        state = httpx.get(server.url + "/server_info", timeout=10).json()["internal_states"][0]
        if state["num_used_tokens"] == 0 and state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
            break
        assert time.monotonic() < end, state
        time.sleep(0.2)
    r = httpx.post(server.url + "/generate", json={"input_ids": IDS, "sampling_params": SP}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 6, r.text


def _stop_all(*servers: ServerProcess) -> None:
    """Stop the servers; their logs go to the test's captured output when the test has failed."""
    failing = sys.exc_info()[0] is not None
    for s in servers:
        s.stop()
        if failing:
            print(f"---- log of the server on port {s.port} ----\n{s.log_tail(6000)}")
        s.remove_log()


def test_decode_server_dies_before_the_transfer(llama_dir):
    prefill, decode, port = _pair(llama_dir)
    pid = _scheduler_pid(prefill)
    try:
        body = _body(port)
        with ThreadPoolExecutor(2) as pool:
            os.kill(pid, signal.SIGSTOP)
            p = pool.submit(httpx.post, prefill.url + "/generate", json=body, timeout=60)
            d = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=60)
            time.sleep(1.5)                     # the reservation is sent
            decode.proc.kill()
            decode.proc.wait(10)
            with pytest.raises(httpx.HTTPError):
                d.result()
            os.kill(pid, signal.SIGCONT)
            r = p.result()
        # The prefill side frees the request either way: with a 502 when it noticed the decode
        # server's end before its last send, else with its first token sent into the void (ZMQ
        # learns of a closed peer asynchronously); the client's error comes from the decode half.
        assert r.status_code == 200 or "decode server went away" in r.json()["error"]["message"], r.text
        _idle(prefill)
    finally:
        os.kill(pid, signal.SIGCONT)
        _stop_all(prefill, decode)


def test_prefill_server_dies_after_the_reservation(llama_dir):
    prefill, decode, port = _pair(llama_dir)
    pid = _scheduler_pid(prefill)
    try:
        os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            d = pool.submit(httpx.post, decode.url + "/generate", json=_body(port), timeout=60)
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            prefill.proc.kill()
            r = d.result()
        assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"], r.text
        _idle(decode)
    finally:
        _stop_all(prefill, decode)


def test_no_decode_server_reserves(llama_dir):
    """The router's decode half never comes (bootstrap timeout on the prefill side)."""
    prefill, decode, port = _pair(llama_dir)
    try:
        r = httpx.post(prefill.url + "/generate", json=_body(port), timeout=60)
        assert r.status_code == 504 and "no decode server reserved" in r.json()["error"]["message"], r.text
        _idle(prefill)
        _idle(decode)
    finally:
        _stop_all(prefill, decode)


def test_client_leaves_during_the_transfer(llama_dir):
    """Through `sparkserve router`: the client gives up while the prefill server holds the
    request; the router cancels both halves and both servers free everything."""
    prefill, decode, port = _pair(llama_dir)
    pid = _scheduler_pid(prefill)
    router_port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "sparkserve.cli", "router", "--prefill", prefill.url,
                               str(port), "--decode", decode.url, "--port", str(router_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{router_port}"
    try:
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end
            time.sleep(0.25)
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/generate", json={"input_ids": IDS, "sampling_params": SP}, timeout=2)
        time.sleep(1.0)
        os.kill(pid, signal.SIGCONT)
        _idle(decode)
        _idle(prefill)
    finally:
        os.kill(pid, signal.SIGCONT)
        router.terminate()
        router.wait(10)
        _stop_all(prefill, decode)


def test_different_models_fail_with_a_transfer_error(tiny_dirs):
    prefill, decode, port = _pair(tiny_dirs["llama"], tiny_dirs["mistral"])
    try:
        body = _body(port)
        with ThreadPoolExecutor(2) as pool:
            p = pool.submit(httpx.post, prefill.url + "/generate", json=body, timeout=60)
            d = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=60)
            rp, rd = p.result(), d.result()
        assert rd.status_code == 502 and "transfer error" in rd.json()["error"]["message"], rd.text
        assert rp.status_code == 502, rp.text
        _idle(prefill)
        _idle(decode)
    finally:
        _stop_all(prefill, decode)
