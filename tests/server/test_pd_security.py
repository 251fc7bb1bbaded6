"""A real prefill server's bootstrap port under attack: pickles, garbage, lying headers and an
oversized frame run no code and take nothing down (the paired request after them decodes as a
colocated one does, and both servers end idle); with a shared secret, a peer without it is refused
at the handshake while the servers that hold it serve; a decode server told to reach a bootstrap
host that cannot be one fails that request with a 502 and keeps serving."""
from __future__ import annotations

import json
import os
import pickle
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import zmq
from pd_fixtures import Exploit
from server_harness import ServerProcess, free_port
from test_pd_faults import IDS, SP, _idle, _stop_all


def _pair(path: str, *extra: str) -> tuple[ServerProcess, ServerProcess, int]:
    port = free_port()
    common = ("--model-path", path, "--max-total-tokens", "1024", "--chunked-prefill-size", "16",
              "--disaggregation-bootstrap-timeout", "5", *extra)
    prefill = ServerProcess(*common, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*common, "--disaggregation-mode", "decode")
    prefill.wait_ready()
    decode.wait_ready()
    return prefill, decode, port


def _paired(prefill: ServerProcess, decode: ServerProcess, port: int, host: str = "127.0.0.1"):
    body = {"input_ids": IDS, "sampling_params": SP, "bootstrap_host": host, "bootstrap_port": port,
            "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, prefill.url + "/generate", json=body, timeout=60)
        d = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=60)
        return p.result(), d.result()


def _colocated(server: ServerProcess) -> list[int]:
    r = httpx.post(server.url + "/generate", json={"input_ids": IDS, "sampling_params": SP}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _attack(port: int, marker: str) -> None:
    """Everything at once from one peer, then an oversized frame from another."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        exploit = pickle.dumps(Exploit(marker))
        header = {"msg": {"kind": "reserve", "room": 1, "start": 0, "shapes": [], "backend": "tcp"},
                  "tensors": [{"key": ["slots"], "dtype": "int64", "shape": [1 << 30]}]}
        for frames in ([exploit], [exploit, exploit], [os.urandom(300)], [b""] * 3,
                       [json.dumps(header).encode(), b"\0" * 8],
                       [json.dumps({"msg": {"kind": "rows", "room": 1, "lo": 0}}).encode()],
                       [json.dumps({"msg": {"kind": "cancel", "room": -5, "message": "x"}}).encode()]):
            sock.send_multipart(frames)
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 1000)
        big.connect(f"tcp://127.0.0.1:{port}")
        big.send(b"\0" * (65 << 20))
        sock.close()
        big.close()
    finally:
        ctx.term()


def test_hostile_bytes_at_the_bootstrap_port(llama_dir, tmp_path):
    marker = str(tmp_path / "pwned")
    prefill, decode, port = _pair(llama_dir)
    try:
        want = _colocated(decode)
        _attack(port, marker)
        time.sleep(1)
        rp, rd = _paired(prefill, decode, port)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want
        assert not os.path.exists(marker)
        log = prefill.log_tail(20000)
        assert log.count("PD bootstrap: dropped a message from 127.0.0.1") >= 6, log
        # a bootstrap host no socket can reach: that request fails, the decode server serves on
        _, rd = _paired(prefill, decode, port, host="no such host")
        assert rd.status_code == 502, rd.text
        assert "cannot connect to the prefill server" in rd.json()["error"]["message"]
        _idle(prefill)
        _idle(decode)
    finally:
        _stop_all(prefill, decode)


def test_with_a_secret_only_its_holders_talk(llama_dir, tmp_path):
    key = tmp_path / "pd.key"
    key.write_text(os.urandom(32).hex())
    marker = str(tmp_path / "pwned")
    prefill, decode, port = _pair(llama_dir, "--disaggregation-auth-key-file", str(key))
    try:
        want = _colocated(decode)
        _attack(port, marker)
        rp, rd = _paired(prefill, decode, port)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want
        assert not os.path.exists(marker)
        assert "dropped a message" not in prefill.log_tail(20000)       # nothing got past the handshake
        _idle(prefill)
        _idle(decode)
    finally:
        _stop_all(prefill, decode)
