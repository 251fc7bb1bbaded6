"""The tcp transfer backend: ZMQ over TCP, no extra install. The prefill server binds a ROUTER at
its bootstrap port; each decode server connects one DEALER per prefill server it pairs with,
reserves rooms on it and gets back each room's rows (wire.py frames), which it writes into the
slots it reserved. ROUTER_MANDATORY makes a send to a decode server that went away fail at once
(PeerGone) instead of dropping the rows silently."""
from __future__ import annotations

import errno
import logging
from typing import Any

import zmq

from sparkserve.core.pool import Pool
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
from sparkserve.mem.transfer import RequestPages, read_request, write_request
from sparkserve.messages import Bootstrap

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000        # ZMQ-level pings: a peer behind a dead link is dropped within seconds
HEARTBEAT_TIMEOUT_MS = 5000


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)      # never drop rows: a room's messages must all arrive
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    return sock


class TcpPrefillTransfer(PrefillTransfer):
    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = _socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as e:
            self.close()
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
            msg, _ = unpack(frames)
            if msg["kind"] == "reserve":
                events.append(Reservation(msg["room"], msg["start"], peer))
            elif msg["kind"] == "cancel":
                events.append(Cancelled(msg["room"], msg["message"]))
            else:
                log.error("unknown PD message %r", msg["kind"])

    def _send(self, res: Reservation, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart([res.peer] + frames, copy=False)
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                raise PeerGone(f"the decode server of room {res.room} is gone") from None
            raise

    def send_rows(self, res: Reservation, pools: list[Pool], pages: RequestPages, lo: int,
                  last: bool) -> None:
        first = max(lo, res.start)
        if first >= len(pages.slots) and not last:
            return
        rows = read_request(pools, pages, min(first, len(pages.slots)), state=last)
        self._send(res, pack({"kind": "rows", "room": res.room, "lo": first}, rows))

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


class TcpDecodeTransfer(DecodeTransfer):
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.dealers: dict[tuple[str, int], zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.rooms: dict[int, tuple[Bootstrap, list[Pool], RequestPages, int]] = {}

    def _dealer(self, boot: Bootstrap) -> zmq.Socket:
        key = (boot.host, boot.port)
        if key not in self.dealers:
            sock = _socket(self.ctx, zmq.DEALER)
            sock.connect(f"tcp://{boot.host}:{boot.port}")
            self.dealers[key] = sock
            self.poller.register(sock, zmq.POLLIN)
        return self.dealers[key]

    def reserve(self, boot: Bootstrap, pools: list[Pool], pages: RequestPages, start: int) -> None:
        self.rooms[boot.room] = (boot, pools, pages, start)
        self._dealer(boot).send_multipart(pack({"kind": "reserve", "room": boot.room, "start": start}))

    def cancel(self, boot: Bootstrap, message: str) -> None:
        if self.rooms.pop(boot.room, None) is not None:
            self._dealer(boot).send_multipart(pack({"kind": "cancel", "room": boot.room, "message": message}))

    def poll(self, timeout_ms: int) -> list[Heard | Arrived | Failed]:
        events: list[Heard | Arrived | Failed] = []
        for sock, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                events += self._receive(frames)
        return events

    def _receive(self, frames: list[Any]) -> list[Heard | Arrived | Failed]:
        msg, rows = unpack(frames)
        kind = msg["kind"]
        if kind == "alive":
            return [Heard(room) for room in msg["rooms"] if room in self.rooms]
        room = msg["room"]
        if room not in self.rooms:          # given up here already
            return []
        if kind == "rows":
            boot, pools, pages, start = self.rooms[room]
            try:
                write_request(pools, pages, rows, msg["lo"], start)
            except ValueError as e:
                self.cancel(boot, f"the decode server could not take the rows: {e}")
                return [Failed(room, f"transfer error: {e}")]
            return [Heard(room)]
        del self.rooms[room]
        if kind == "result":
            return [Arrived(room, msg["result"])]
        return [Failed(room, msg["message"])]

    def close(self) -> None:
        for sock in self.dealers.values():
            sock.close(linger=0)
        self.ctx.term()
