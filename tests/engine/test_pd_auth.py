"""PD peers prove a shared secret (disaggregation/auth.py): the start-up rules that keep an open
bootstrap port from running without one, and the handshake between real sockets: the same secret
talks, a missing or different one fails every waiting room at once with a message naming the flag,
and a stranger's bytes never reach the message decoder."""
from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import zmq
from pd_fixtures import Exploit
from server_harness import free_port

from sparkserve.args import ServerArgs
from sparkserve.disaggregation.auth import connect_securely, derive
from sparkserve.disaggregation.backend import Failed, decode_transfer, prefill_transfer
from sparkserve.mem.transfer import RequestPages, RequestRows
from sparkserve.messages import Bootstrap

SECRET = b"correct horse battery staple"


def _args(tiny_dirs, **kw) -> ServerArgs:
    return ServerArgs(model_path=tiny_dirs["llama"], disaggregation_mode="prefill", **kw)


def test_an_open_bootstrap_port_needs_a_secret(tiny_dirs, tmp_path):
    _args(tiny_dirs).validate()                                       # loopback: no key needed
    for kw in ({"host": "0.0.0.0"}, {"disaggregation_bootstrap_host": "0.0.0.0"},
               {"disaggregation_bootstrap_host": "::"}):
        with pytest.raises(ValueError, match="bootstrap-host .* --disaggregation-auth-key-file"):
            _args(tiny_dirs, **kw).validate()
    key = tmp_path / "key"
    key.write_bytes(SECRET + b"\n")
    args = _args(tiny_dirs, host="0.0.0.0", disaggregation_auth_key_file=str(key)).validate()
    assert args.disaggregation_secret() == SECRET                     # the newline is not the secret's
    assert args.bootstrap_host == "0.0.0.0"
    assert _args(tiny_dirs, host="0.0.0.0", disaggregation_bootstrap_host="127.0.0.1").validate()
    ServerArgs(model_path=tiny_dirs["llama"], disaggregation_mode="decode", host="0.0.0.0").validate()
    with pytest.raises(ValueError, match="--disaggregation-auth-key: give a secret of at least 16"):
        _args(tiny_dirs, disaggregation_auth_key="short").validate()
    with pytest.raises(ValueError, match="--disaggregation-auth-key-file .*missing: cannot read it"):
        _args(tiny_dirs, disaggregation_auth_key_file=str(tmp_path / "missing")).validate()
    with pytest.raises(ValueError, match="give one of the two"):
        _args(tiny_dirs, disaggregation_auth_key_file=str(key),
              disaggregation_auth_key=SECRET.decode()).validate()


def test_keys_are_derived_alike_and_apart():
    a, b = derive(SECRET), derive(SECRET + b"!")
    assert a == derive(SECRET)
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4


def _rows() -> RequestRows:
    pages = RequestPages(torch.arange(4), None, 0)
    return RequestRows([], pages, lambda lo, state: {}, lambda rows, lo, start: None, {})


def _handshake(prefill_secret: bytes | None, decode_secret: bytes | None) -> list:
    """What a decode side hears in 10 s after reserving a room on a prefill side."""
    port = free_port()
    prefill = prefill_transfer("tcp", port, "127.0.0.1", prefill_secret and derive(prefill_secret))
    decode = decode_transfer("tcp", decode_secret and derive(decode_secret))
    try:
        decode.reserve(Bootstrap("127.0.0.1", port, 7), _rows(), 0)
        heard, reserved, end = [], [], time.monotonic() + 10
        while not heard and not reserved and time.monotonic() < end:
            heard += decode.poll(50)
            reserved += prefill.poll(50)
        return heard + reserved
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("prefill_secret,decode_secret,has", [
    (SECRET, SECRET, None),
    (SECRET, None, "has no --disaggregation-auth-key"),
    (SECRET, SECRET + b"!", "has a --disaggregation-auth-key"),
    (None, SECRET, "has a --disaggregation-auth-key"),
])
def test_the_handshake_needs_the_same_secret_on_both_sides(prefill_secret, decode_secret, has):
    [event] = _handshake(prefill_secret, decode_secret)
    if has is None:
        assert event.room == 7 and not isinstance(event, Failed)      # the reservation got through
    else:
        assert isinstance(event, Failed) and event.room == 7
        assert "handshake with the prefill server 127.0.0.1:" in event.message and has in event.message


@pytest.mark.parametrize("secret", [None, SECRET + b"!"])
def test_a_stranger_never_reaches_the_decoder(secret, tmp_path, caplog):
    """A peer without the secret (none, or another) sends a pickle: the handshake stops it, so the
    prefill side never even logs a dropped message, and no code runs."""
    marker = str(tmp_path / "pwned")
    port = free_port()
    prefill = prefill_transfer("tcp", port, "127.0.0.1", derive(SECRET))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        connect_securely(sock, derive(secret))
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(pickle.dumps(Exploit(marker)))
        end = time.monotonic() + 3
        while time.monotonic() < end:
            assert prefill.poll(50) == []
        assert "dropped a message" not in caplog.text
        assert not os.path.exists(marker)
    finally:
        sock.close()
        ctx.term()
        prefill.close()
