"""The control channel every transfer backend shares: ZMQ over TCP. The prefill server binds a
ROUTER at its bootstrap port; each decode server connects one DEALER per prefill server it pairs
with. Over it go the reservations and cancels (decode -> prefill), and the heartbeats, results,
failures and `rows` notices (prefill -> decode); a backend adds its own messages (the tcp backend
puts the rows themselves in the `rows` notice, nixl and mooncake a memory description). One
DEALER keeps its messages in order, so whatever a backend sends before a reservation arrives
before it. ROUTER_MANDATORY makes a send to a decode server that went away fail at once
(PeerGone) instead of dropping the message silently."""
from __future__ import annotations

import errno
import logging
from typing import Any

import zmq

from sparkserve.disaggregation.backend import (
    Arrived,
    Cancelled,
    DecodeTransfer,
    Failed,
    Heard,
    PeerGone,
    PrefillTransfer,
    Reservation,
)
from sparkserve.disaggregation.wire import pack, unpack
from sparkserve.mem.transfer import RequestRows, Rows
from sparkserve.messages import Bootstrap

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000        # ZMQ-level pings: a peer behind a dead link is dropped within seconds
HEARTBEAT_TIMEOUT_MS = 5000
BYE_LINGER_MS = 100        # how long a closing decode side tries to get its goodbye out

DecodeEvent = Heard | Arrived | Failed


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)      # never drop a message: a room's messages must all arrive
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    return sock


class ControlPrefill(PrefillTransfer):
    """The prefill side of the control channel; a backend adds send_rows (and may take messages
    of its own kinds in `_on_message`)."""

    backend = ""            # its --disaggregation-transfer-backend name: both sides must use one

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = _socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            self.ctx.term()
            raise ValueError(f"--disaggregation-bootstrap-port {port}: cannot listen there ({e}); "
                             "give a free port") from None
        log.info("PD bootstrap service listening on port %d", port)

    def poll(self, timeout_ms: int) -> list[Reservation | Cancelled]:
        events: list[Reservation | Cancelled] = []
        if not self.sock.poll(timeout_ms):
            return events
        while True:
            try:
                peer, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            msg, rows = unpack(frames)
            if msg["kind"] == "reserve":
                res = Reservation(msg["room"], msg["start"], peer, msg["shapes"], msg.get("dst"))
                if msg.get("backend") != self.backend:
                    problem = (f"transfer error: the decode server uses --disaggregation-transfer-backend "
                               f"{msg.get('backend')}, this prefill server {self.backend}: use one on both")
                    self.send_failure(res, problem)
                    events.append(Cancelled(res.room, problem))
                elif self._on_reserve(res):
                    events.append(res)
            elif msg["kind"] == "cancel":
                events.append(Cancelled(msg["room"], msg["message"]))
            elif msg["kind"] == "bye":
                self._on_bye(peer)
            else:
                self._on_message(peer, msg, rows)

    def _on_reserve(self, res: Reservation) -> bool:
        """A backend's look at a reservation as it comes; False: it is not handed out (yet)."""
        return True

    def _on_bye(self, peer: bytes) -> None:
        """The decode server `peer` is closing (its rooms go on until a send to it fails)."""

    def _on_message(self, peer: bytes, msg: dict[str, Any], rows: Rows | None) -> None:
        log.error("unknown PD message %r", msg["kind"])

    def _send_to(self, peer: bytes, room: int | None, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart([peer] + frames, copy=False)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                raise PeerGone(f"the decode server of room {room} is gone") from None
            raise

    def _send(self, res: Reservation, frames: list[Any]) -> None:
        self._send_to(res.peer, res.room, frames)

    def send_result(self, res: Reservation, result: dict[str, Any]) -> None:
        self._send(res, pack({"kind": "result", "room": res.room, "result": result}))

    def send_failure(self, res: Reservation, message: str) -> None:
        try:
            self._send(res, pack({"kind": "failed", "room": res.room, "message": message}))
        except PeerGone:
            pass

    def heartbeat(self, rooms: list[Reservation]) -> list[Reservation]:
        by_peer: dict[bytes, list[Reservation]] = {}
        for res in rooms:
            by_peer.setdefault(res.peer, []).append(res)
        gone = []
        for group in by_peer.values():
            try:
                self._send(group[0], pack({"kind": "alive", "rooms": [r.room for r in group]}))
            except PeerGone:
                gone += group
        return gone

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class ControlDecode(DecodeTransfer):
    """The decode side of the control channel; a backend adds `_on_rows` (what a `rows` notice
    means) and may add to a reservation (`_reserve_extra`) or say something to a prefill server
    before its first reservation (`_before_reserve`)."""

    backend = ""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.dealers: dict[tuple[str, int], zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.rooms: dict[int, tuple[Bootstrap, RequestRows, int]] = {}

    def _dealer(self, boot: Bootstrap) -> zmq.Socket:
        key = (boot.host, boot.port)
        if key not in self.dealers:
            sock = _socket(self.ctx, zmq.DEALER)
            sock.connect(f"tcp://{boot.host}:{boot.port}")
            self.dealers[key] = sock
            self.poller.register(sock, zmq.POLLIN)
        return self.dealers[key]

    def reserve(self, boot: Bootstrap, dst: RequestRows, start: int) -> None:
        self.rooms[boot.room] = (boot, dst, start)
        self._send_reserve(boot.room)

    def _send_reserve(self, room: int) -> None:
        boot, dst, start = self.rooms[room]
        sock = self._dealer(boot)
        self._before_reserve(sock, boot, dst)
        sock.send_multipart(pack({"kind": "reserve", "room": room, "start": start, "shapes": dst.shapes,
                                  "backend": self.backend, "dst": self._reserve_extra(dst)}))

    def _before_reserve(self, sock: zmq.Socket, boot: Bootstrap, dst: RequestRows) -> None:
        pass

    def _reserve_extra(self, dst: RequestRows) -> Any:
        return None

    def cancel(self, boot: Bootstrap, message: str) -> None:
        if self.rooms.pop(boot.room, None) is not None:
            self._dealer(boot).send_multipart(pack({"kind": "cancel", "room": boot.room, "message": message}))

    def poll(self, timeout_ms: int) -> list[DecodeEvent]:
        events: list[DecodeEvent] = []
        for sock, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                events += self._receive(sock, frames)
        return events

    def _refuse(self, room: int, problem: str) -> list[DecodeEvent]:
        """The rows of `room` cannot be taken here: give the room up on both sides."""
        boot = self.rooms[room][0]
        self.cancel(boot, f"the decode server could not take the rows: {problem}")
        return [Failed(room, f"transfer error: {problem}")]

    def _receive(self, sock: zmq.Socket, frames: list[Any]) -> list[DecodeEvent]:
        msg, rows = unpack(frames)
        kind = msg["kind"]
        if kind == "alive":
            return [Heard(room) for room in msg["rooms"] if room in self.rooms]
        if "room" not in msg:
            return self._on_message(sock, msg)
        room = msg["room"]
        if room not in self.rooms:          # given up here already
            return []
        if kind == "rows":
            return self._on_rows(room, msg, rows)
        if kind == "refused":               # the prefill side found it cannot write, and gave up
            del self.rooms[room]
            return [Failed(room, f"transfer error: {msg['message']}")]
        if kind in ("result", "failed"):
            del self.rooms[room]
            if kind == "result":
                return [Arrived(room, msg["result"])]
            return [Failed(room, msg["message"])]
        return self._on_message(sock, msg)

    def _on_rows(self, room: int, msg: dict[str, Any], rows: Rows | None) -> list[DecodeEvent]:
        raise NotImplementedError

    def _on_message(self, sock: zmq.Socket, msg: dict[str, Any]) -> list[DecodeEvent]:
        log.error("unknown PD message %r", msg["kind"])
        return []

    def close(self) -> None:
        """Tells every prefill server this side is closing (a backend writing into this side's
        memory stops before it goes), then closes."""
        for sock in self.dealers.values():
            try:
                sock.send_multipart(pack({"kind": "bye"}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            sock.close(linger=BYE_LINGER_MS)
        self.ctx.term()
