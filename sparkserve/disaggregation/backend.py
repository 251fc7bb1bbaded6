"""What a transfer backend does for each side, and which one a server gets.

The decode side reserves a request's rows in its pools and tells the prefill server where the
request stands (the first position it lacks); the prefill side sends rows as its chunks run, then
the request-row state and the first-token result. Every backend keeps that conversation on one
ZMQ control channel (control.py); they differ in how rows move. tcp carries them in its messages
and the decode side writes them itself (tcp.py); nixl and mooncake register both sides' pool
memory with their engine once, the decode side sends its rows' places with each reservation, and
the prefill side writes straight into them (registered.py, nixl.py, mooncake.py)."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from sparkserve.disaggregation.auth import PeerAuth
from sparkserve.mem.transfer import RequestRows, Shapes
from sparkserve.messages import Bootstrap


class PeerGone(RuntimeError):
    """The other side of a room cannot be reached (its process died, or it dropped the room)."""


@dataclass
class Reservation:
    """Prefill side: a decode server holds room for `room` and lacks positions start..; `shapes`
    is its whole layout (checked against this side's before anything is sent); `dst`: where its
    rows go there (a registered-memory backend's destination RequestPages, else None)."""
    room: int
    start: int
    peer: Any
    shapes: Shapes
    dst: Any = None


@dataclass
class Cancelled:
    """Prefill side: the decode server gave up `room` (its client left, it timed out)."""
    room: int
    message: str


@dataclass
class Heard:
    """Decode side: the prefill server of `room` is alive and working on it (rows came, or a
    heartbeat)."""
    room: int


@dataclass
class Arrived:
    """Decode side: every row of `room` is written; `result` is the prefill side's first token,
    its logprobs, the RNG state and the prompt's hidden rows."""
    room: int
    result: dict[str, Any]


@dataclass
class Failed:
    """Decode side: the prefill side could not serve `room`."""
    room: int
    message: str


class PrefillTransfer(ABC):
    @abstractmethod
    def poll(self, timeout_ms: int) -> list[Reservation | Cancelled]: ...

    @abstractmethod
    def send_rows(self, res: Reservation, src: RequestRows, lo: int, last: bool) -> None:
        """Rows for positions max(lo, res.start)..len(src.pages.slots); with `last`, the
        request-row state too. Raises PeerGone."""

    @abstractmethod
    def send_result(self, res: Reservation, result: dict[str, Any]) -> None:
        """The request's first-token result, after its last rows. Raises PeerGone."""

    @abstractmethod
    def send_failure(self, res: Reservation, message: str) -> None: ...

    @abstractmethod
    def heartbeat(self, rooms: list[Reservation]) -> list[Reservation]:
        """Tell decode servers these rooms are still being worked on; returns the rooms whose
        decode server is gone."""

    @abstractmethod
    def close(self) -> None: ...


class DecodeTransfer(ABC):
    @abstractmethod
    def reserve(self, boot: Bootstrap, dst: RequestRows, start: int) -> None:
        """Ask the prefill server of `boot` for positions start.. of the request, into `dst`."""

    @abstractmethod
    def cancel(self, boot: Bootstrap, message: str) -> None: ...

    @abstractmethod
    def poll(self, timeout_ms: int) -> list[Heard | Arrived | Failed]: ...

    @abstractmethod
    def close(self) -> None: ...


# backend -> (the module it needs, the package that brings it)
NEEDS = {"nixl": ("nixl", "nixl"), "mooncake": ("mooncake.engine", "mooncake-transfer-engine-non-cuda")}


def _check_backend(name: str) -> None:
    """A start-up error naming what to install when the backend's engine does not load."""
    if name == "tcp":
        return
    if name not in NEEDS:
        raise ValueError(f"--disaggregation-transfer-backend {name}: use one of tcp, {', '.join(NEEDS)}")
    module, package = NEEDS[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == module.split(".")[0]:
            raise ValueError(f"--disaggregation-transfer-backend {name} needs the {package} package: "
                             f"pip install 'sparkserve[{name}]'") from None
        # installed, but something it loads is missing (a system library, a part of the package)
        hint = " (Debian: apt-get install libibverbs1)" if "libibverbs" in str(e) else ""
        raise ValueError(f"--disaggregation-transfer-backend {name}: the {package} package is installed "
                         f"but does not load: {e}{hint}") from None


def prefill_transfer(backend: str, port: int, host: str = "127.0.0.1",
                     auth: PeerAuth | None = None) -> PrefillTransfer:
    """The prefill side's backend, listening on host:port (peers must hold `auth`'s secret)."""
    _check_backend(backend)
    if backend == "nixl":
        from sparkserve.disaggregation.nixl import NixlPrefillTransfer
        return NixlPrefillTransfer(port, host, auth)
    if backend == "mooncake":
        from sparkserve.disaggregation.mooncake import MooncakePrefillTransfer
        return MooncakePrefillTransfer(port, host, auth)
    from sparkserve.disaggregation.tcp import TcpPrefillTransfer
    return TcpPrefillTransfer(port, host, auth)


def decode_transfer(backend: str, auth: PeerAuth | None = None) -> DecodeTransfer:
    _check_backend(backend)
    if backend == "nixl":
        from sparkserve.disaggregation.nixl import NixlDecodeTransfer
        return NixlDecodeTransfer(auth)
    if backend == "mooncake":
        from sparkserve.disaggregation.mooncake import MooncakeDecodeTransfer
        return MooncakeDecodeTransfer(auth)
    from sparkserve.disaggregation.tcp import TcpDecodeTransfer
    return TcpDecodeTransfer(auth)
