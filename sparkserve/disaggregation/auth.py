"""Authenticated, encrypted PD control channels: CurveZMQ keys derived from one shared secret.

Every prefill and decode server of a deployment is given the same secret
(--disaggregation-auth-key-file, or --disaggregation-auth-key). From it each derives the same two
Curve25519 key pairs: the prefill server's (its ROUTER is the CURVE server) and the decode
servers' (their DEALERs are CURVE clients). A client must know the server's public key to finish
the handshake, and the server's ZAP handler admits only the clients' public key, so a peer
without the secret never gets a message through; what passes is encrypted and cannot be
replayed. scrypt makes each guess at a weak secret expensive for someone who recorded a
handshake."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_DOMAIN = "sparkserve-pd"
_SALT = b"sparkserve PD control channel v1"


@dataclass(frozen=True)
class PeerAuth:
    """The two key pairs every server of a deployment derives from the shared secret (z85)."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def derive(secret: bytes) -> PeerAuth:
    """The key pairs of the deployment whose secret is `secret`."""
    if not zmq.has("curve"):
        raise ValueError("--disaggregation-auth-key: this pyzmq's libzmq has no CURVE support; install a "
                         "pyzmq wheel from PyPI (they bundle libsodium)")
    material = hashlib.scrypt(secret, salt=_SALT, n=1 << 14, r=8, p=1, dklen=64)
    server_secret, client_secret = z85.encode(material[:32]), z85.encode(material[32:])
    return PeerAuth(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret),
                    client_secret)


class _Gate(ThreadAuthenticator):
    """The ZAP handler of a prefill server: admits the decode servers' key only, and logs every
    other peer by address."""

    def __init__(self, context: zmq.Context, client_public: bytes):
        super().__init__(context)
        self.client_public = client_public
        self._peer = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        log.warning("PD bootstrap: refused a peer at %s: it does not hold this deployment's "
                    "--disaggregation-auth-key", self._peer)
        return False


def serve_securely(sock: zmq.Socket, auth: PeerAuth) -> ThreadAuthenticator:
    """Make `sock` (before it binds) a CURVE server that admits only holders of the secret; returns
    the ZAP handler, to stop when the socket closes."""
    gate = _Gate(sock.context, auth.client_public)
    gate.start()
    gate.configure_curve_callback(ZAP_DOMAIN, credentials_provider=gate)
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_server = True
    sock.curve_secretkey = auth.server_secret
    return gate


def connect_securely(sock: zmq.Socket, auth: PeerAuth) -> None:
    """Make `sock` (before it connects) a CURVE client of this deployment's prefill servers."""
    sock.curve_serverkey = auth.server_public
    sock.curve_publickey = auth.client_public
    sock.curve_secretkey = auth.client_secret
