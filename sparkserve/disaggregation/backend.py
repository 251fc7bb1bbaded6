"""What a transfer backend does for each side, and which one a server gets.

The decode side reserves a request's rows in its pools and tells the prefill server where the
request stands (the first position it lacks); the prefill side sends rows as its chunks run, then
the request-row state and the first-token result. A backend that writes into registered memory
(nixl, mooncake) gets the decode side's pages at reservation; the tcp backend carries the rows and
the decode side writes them itself."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from sparkserve.core.pool import Pool
from sparkserve.mem.transfer import RequestPages
from sparkserve.messages import Bootstrap


class PeerGone(RuntimeError):
    """The other side of a room cannot be reached (its process died, or it dropped the room)."""


@dataclass
class Reservation:
    """Prefill side: a decode server holds room for `room` and lacks positions start.."""
    room: int
    start: int
    peer: Any


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
    def send_rows(self, res: Reservation, pools: list[Pool], pages: RequestPages, lo: int,
                  last: bool) -> None:
        """Rows for positions max(lo, res.start)..len(pages); with `last`, the request-row state too.
        Raises PeerGone."""

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
    def reserve(self, boot: Bootstrap, pools: list[Pool], pages: RequestPages, start: int) -> None: ...

    @abstractmethod
    def cancel(self, boot: Bootstrap, message: str) -> None: ...

    @abstractmethod
    def poll(self, timeout_ms: int) -> list[Heard | Arrived | Failed]: ...

    @abstractmethod
    def close(self) -> None: ...


def _check_backend(name: str) -> None:
    if name == "tcp":
        return
    raise ValueError(f"--disaggregation-transfer-backend {name}: not built yet; use tcp (the default)")


def prefill_transfer(backend: str, port: int) -> PrefillTransfer:
    _check_backend(backend)
    from sparkserve.disaggregation.tcp import TcpPrefillTransfer
    return TcpPrefillTransfer(port)


def decode_transfer(backend: str) -> DecodeTransfer:
    _check_backend(backend)
    from sparkserve.disaggregation.tcp import TcpDecodeTransfer
    return TcpDecodeTransfer()
