"""The control channel every transfer backend shares: ZMQ over TCP. The prefill server binds a
ROUTER at its bootstrap host and port; each decode server connects one DEALER per prefill server it
pairs with. Over it go the reservations and cancels (decode -> prefill), and the heartbeats, results,
failures and `rows` notices (prefill -> decode); a backend adds its own messages (the tcp backend
puts the rows themselves in the `rows` notice, nixl and mooncake a memory description). One
DEALER keeps its messages in order, so whatever a backend sends before a reservation arrives
before it. ROUTER_MANDATORY makes a send to a decode server that went away fail at once
(PeerGone) instead of dropping the message silently.

Nothing a peer sends is trusted: each message is parsed against protocol.py's schemas (wire.py),
a message that fails is logged with the peer's address and dropped, and the sizes a peer can make
this side hold are bounded (MAXMSGSIZE). With a shared secret (auth.py) the channel is CurveZMQ:
peers without it never complete the handshake, and a decode server whose handshake fails hears
so at once (its monitor) instead of waiting out the timeout."""
from __future__ import annotations

import errno
import logging
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from sparkserve.disaggregation import protocol as p
from sparkserve.disaggregation.auth import PeerAuth, connect_securely, serve_securely
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
from sparkserve.disaggregation.wire import Tensors, WireError, pack, unpack
from sparkserve.mem.transfer import RequestRows, Shapes
from sparkserve.messages import Bootstrap

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000        # ZMQ-level pings: a peer behind a dead link is dropped within seconds
HEARTBEAT_TIMEOUT_MS = 5000
BYE_LINGER_MS = 100        # how long a closing decode side tries to get its goodbye out
HANDSHAKE_FAILURES = 3     # in a row: the two sides' keys do not match
MAX_CONTROL_BYTES = 64 << 20   # the largest message a prefill server takes (reservations, hellos)
MAX_RESULT_MARGIN = 256 << 20  # a decode server takes its pools' bytes plus this (rows, hidden rows)

DecodeEvent = Heard | Arrived | Failed
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _socket(ctx: zmq.Context, kind: int, max_bytes: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)      # never drop a message: a room's messages must all arrive
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)     # a larger frame drops the peer, unread
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    return sock


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _peer_address(frame: Any) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return "?"


def shapes_of(msg: p.Reserve) -> Shapes:
    return {(b.pool, b.component, b.layer): (b.kind, tuple(b.shape)) for b in msg.shapes}


def shape_list(shapes: Shapes) -> list[p.BufferShape]:
    return [p.BufferShape(pool=k[0], component=k[1], layer=k[2], kind=kind, shape=tuple(shape))
            for k, (kind, shape) in shapes.items()]


class ControlPrefill(PrefillTransfer):
    """The prefill side of the control channel; a backend adds send_rows (and may take messages
    of its own kinds in `_on_message`)."""

    backend = ""            # its --disaggregation-transfer-backend name: both sides must use one

    def __init__(self, port: int, host: str = "127.0.0.1", auth: PeerAuth | None = None):
        self.ctx = zmq.Context()
        self.sock = _socket(self.ctx, zmq.ROUTER, MAX_CONTROL_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.IPV6, int(":" in host))
        self.gate = serve_securely(self.sock, auth) if auth is not None else None
        try:
            self.sock.bind(endpoint(host, port))
        except zmq.ZMQError as e:
            self._close_socket()
            raise ValueError(f"--disaggregation-bootstrap-host {host} --disaggregation-bootstrap-port "
                             f"{port}: cannot listen there ({e}); give a free port and an address of "
                             "this machine") from None
        log.info("PD bootstrap service listening on %s:%d (%s)", host, port,
                 "peers authenticated and encrypted" if auth else "no authentication: loopback only")

    def poll(self, timeout_ms: int) -> list[Reservation | Cancelled]:
        events: list[Reservation | Cancelled] = []
        if not self.sock.poll(timeout_ms):
            return events
        while True:
            try:
                peer, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return events
            try:
                msg, tensors = unpack(frames)
            except WireError as e:
                log.warning("PD bootstrap: dropped a message from %s: %s", _peer_address(peer), e)
                continue
            events += self._take(peer.bytes, msg, tensors)

    def _take(self, peer: bytes, msg: Any, tensors: Tensors) -> list[Reservation | Cancelled]:
        if isinstance(msg, p.Reserve):
            res = Reservation(msg.room, msg.start, peer, shapes_of(msg))
            problem = None
            if msg.backend != self.backend:
                problem = (f"transfer error: the decode server uses --disaggregation-transfer-backend "
                           f"{msg.backend}, this prefill server {self.backend}: use one on both")
            else:
                try:
                    res.dst = self._destination(msg, tensors)
                except ValueError as e:
                    problem = f"transfer error: {e}"
            if problem is not None:
                self.send_failure(res, problem)
                return [Cancelled(res.room, problem)]
            return [res] if self._on_reserve(res) else []
        if isinstance(msg, p.Cancel):
            return [Cancelled(msg.room, msg.message)]
        if isinstance(msg, p.Bye):
            self._on_bye(peer)
        else:
            self._on_message(peer, msg, tensors)
        return []

    def _destination(self, msg: p.Reserve, tensors: Tensors) -> Any:
        """A backend's reading of where a reservation's rows go on the decode side (None: this
        side sends them); raises ValueError when it cannot be used."""
        if msg.dst is not None or tensors:
            raise ValueError(f"a {self.backend} reservation carries no destination rows")
        return None

    def _on_reserve(self, res: Reservation) -> bool:
        """A backend's look at a reservation as it comes; False: it is not handed out (yet)."""
        return True

    def _on_bye(self, peer: bytes) -> None:
        """The decode server `peer` is closing (its rooms go on until a send to it fails)."""

    def _on_message(self, peer: bytes, msg: Any, tensors: Tensors) -> None:
        log.warning("PD bootstrap: dropped a %r message, which decode servers do not send", msg.kind)

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
        tensors: Tensors = {} if result["rng"] is None else {("rng",): result["rng"]}
        hidden = result["hidden"]
        for i, (positions, final, taps) in enumerate(hidden or []):
            tensors[("hidden", i, "positions")] = positions
            tensors[("hidden", i, "final")] = final
            if taps is not None:
                tensors[("hidden", i, "taps")] = taps
        msg = p.Result(room=res.room, output_ids=result["output_ids"],
                       output_logprobs=result["output_logprobs"],
                       output_top_logprobs=[[tuple(x) for x in top] for top in result["output_top_logprobs"]],
                       hidden_parts=None if hidden is None else len(hidden))
        self._send(res, pack(msg, tensors))

    def send_failure(self, res: Reservation, message: str) -> None:
        try:
            self._send(res, pack(p.Failed(room=res.room, message=message[:p.MAX_TEXT])))
        except PeerGone:
            pass

    def heartbeat(self, rooms: list[Reservation]) -> list[Reservation]:
        by_peer: dict[bytes, list[Reservation]] = {}
        for res in rooms:
            by_peer.setdefault(res.peer, []).append(res)
        gone = []
        for group in by_peer.values():
            try:
                self._send(group[0], pack(p.Alive(rooms=[r.room for r in group])))
            except PeerGone:
                gone += group
        return gone

    def _close_socket(self) -> None:
        self.sock.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()

    def close(self) -> None:
        self._close_socket()


class _Link:
    """One prefill server as a decode server reaches it: the DEALER and its monitor."""

    def __init__(self, ctx: zmq.Context, boot: Bootstrap, auth: PeerAuth | None, max_bytes: int):
        self.name = f"{boot.host}:{boot.port}"
        self.sock = _socket(ctx, zmq.DEALER, max_bytes)
        self.sock.setsockopt(zmq.IPV6, int(":" in boot.host))
        if auth is not None:
            connect_securely(self.sock, auth)
        self.monitor = self.sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.failures = 0                   # handshakes failed in a row
        try:
            self.sock.connect(endpoint(boot.host, boot.port))
        except zmq.ZMQError as e:
            self.close(0)
            raise ValueError(f"cannot connect to the prefill server {self.name}: {e}") from None
        self.secure = auth is not None

    def handshake_failed(self) -> bool:
        """Whether the handshake has failed HANDSHAKE_FAILURES times in a row: keys that do not
        match fail every retry, while a peer that dies mid-handshake fails it once (then its port
        refuses, and the room times out as for any dead peer)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:     # one side has a key, the other none
                self.failures = HANDSHAKE_FAILURES
            else:
                self.failures = self.failures + 1 if event & _HANDSHAKE_FAILED else 0
        return self.failures >= HANDSHAKE_FAILURES

    def close(self, linger: int) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger)


class ControlDecode(DecodeTransfer):
    """The decode side of the control channel; a backend adds `_on_rows` (what a `rows` notice
    means) and may add to a reservation (`_reserve_extra`) or say something to a prefill server
    before its first reservation (`_before_reserve`)."""

    backend = ""

    def __init__(self, auth: PeerAuth | None = None) -> None:
        self.ctx = zmq.Context()
        self.auth = auth
        self.links: dict[tuple[str, int], _Link] = {}
        self.poller = zmq.Poller()
        self.rooms: dict[int, tuple[Bootstrap, RequestRows, int]] = {}
        self.failed: list[DecodeEvent] = []         # rooms failed outside poll: handed out by it

    def _link(self, boot: Bootstrap, dst: RequestRows) -> _Link:
        key = (boot.host, boot.port)
        if key not in self.links:
            pools = sum(t.untyped_storage().nbytes() for pool in dst.pools for c in pool.components()
                        for t in c.tensors)
            link = _Link(self.ctx, boot, self.auth, pools + MAX_RESULT_MARGIN)
            self.links[key] = link
            self.poller.register(link.sock, zmq.POLLIN)
            self.poller.register(link.monitor, zmq.POLLIN)
        return self.links[key]

    def reserve(self, boot: Bootstrap, dst: RequestRows, start: int) -> None:
        self.rooms[boot.room] = (boot, dst, start)
        try:
            self._send_reserve(boot.room)
        except ValueError as e:
            del self.rooms[boot.room]
            self.failed.append(Failed(boot.room, f"transfer error: {e}"))

    def _send_reserve(self, room: int) -> None:
        boot, dst, start = self.rooms[room]
        link = self._link(boot, dst)
        self._before_reserve(link.sock, boot, dst)
        msg = p.Reserve(room=room, start=start, shapes=shape_list(dst.shapes), backend=self.backend,
                        dst=self._reserve_extra(dst))
        link.sock.send_multipart(pack(msg, self._reserve_tensors(dst)))

    def _before_reserve(self, sock: zmq.Socket, boot: Bootstrap, dst: RequestRows) -> None:
        pass

    def _reserve_extra(self, dst: RequestRows) -> p.Destination | None:
        return None

    def _reserve_tensors(self, dst: RequestRows) -> Tensors | None:
        return None

    def cancel(self, boot: Bootstrap, message: str) -> None:
        if self.rooms.pop(boot.room, None) is not None and (boot.host, boot.port) in self.links:
            msg = p.Cancel(room=boot.room, message=message[:p.MAX_TEXT])
            self.links[(boot.host, boot.port)].sock.send_multipart(pack(msg))

    def poll(self, timeout_ms: int) -> list[DecodeEvent]:
        events, self.failed = self.failed, []
        for sock, _ in self.poller.poll(0 if events else timeout_ms):
            link = next(x for x in self.links.values() if sock in (x.sock, x.monitor))
            if sock is link.monitor:
                if link.handshake_failed():
                    events += self._handshake_failed(link)
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    msg, tensors = unpack(frames)
                except WireError as e:
                    log.warning("PD: dropped a message from the prefill server %s: %s", link.name, e)
                    continue
                events += self._receive(sock, msg, tensors)
        return events

    def _handshake_failed(self, link: _Link) -> list[DecodeEvent]:
        """Every room waiting on `link`'s prefill server fails now: the keys do not match, which
        waiting will not change."""
        have = "has a --disaggregation-auth-key" if link.secure else "has no --disaggregation-auth-key"
        problem = (f"transfer error: the handshake with the prefill server {link.name} failed: this decode "
                   f"server {have}; every prefill and decode server needs the same one")
        log.error("%s", problem)
        out: list[DecodeEvent] = []
        for room, (boot, _, _) in list(self.rooms.items()):
            if f"{boot.host}:{boot.port}" == link.name:
                del self.rooms[room]
                out.append(Failed(room, problem))
        return out

    def _refuse(self, room: int, problem: str) -> list[DecodeEvent]:
        """The rows of `room` cannot be taken here: give the room up on both sides."""
        boot = self.rooms[room][0]
        self.cancel(boot, f"the decode server could not take the rows: {problem}")
        return [Failed(room, f"transfer error: {problem}")]

    def _receive(self, sock: zmq.Socket, msg: Any, tensors: Tensors) -> list[DecodeEvent]:
        if isinstance(msg, p.Alive):
            return [Heard(room) for room in msg.rooms if room in self.rooms]
        if not isinstance(msg, (p.RowsSent, p.Refused, p.Failed, p.Result)):
            return self._on_message(sock, msg)
        room = msg.room
        if room not in self.rooms:          # given up here already (or never ours)
            return []
        if isinstance(msg, p.RowsSent):
            return self._on_rows(room, msg, tensors)
        if isinstance(msg, p.Refused):      # the prefill side found it cannot write, and gave up
            del self.rooms[room]
            return [Failed(room, f"transfer error: {msg.message}")]
        if isinstance(msg, p.Failed):
            del self.rooms[room]
            return [Failed(room, msg.message)]
        try:                                # a Result
            result = _result(msg, tensors)
        except ValueError as e:
            return self._refuse(room, f"its result: {e}")
        del self.rooms[room]
        return [Arrived(room, result)]

    def _on_rows(self, room: int, msg: p.RowsSent, tensors: Tensors) -> list[DecodeEvent]:
        raise NotImplementedError

    def _on_message(self, sock: zmq.Socket, msg: Any) -> list[DecodeEvent]:
        log.warning("PD: dropped a %r message, which prefill servers do not send", msg.kind)
        return []

    def close(self) -> None:
        """Tells every prefill server this side is closing (a backend writing into this side's
        memory stops before it goes), then closes."""
        for link in self.links.values():
            try:
                link.sock.send_multipart(pack(p.Bye()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            link.close(BYE_LINGER_MS)
        self.ctx.term()


_RNG_BYTES = torch.Generator().get_state().numel()


def _result(msg: p.Result, tensors: Tensors) -> dict[str, Any]:
    """A Result message and its tensors as the decode scheduler takes them, each tensor checked."""
    rng = tensors.pop(("rng",), None)
    if rng is not None and (rng.dtype != torch.uint8 or tuple(rng.shape) != (_RNG_BYTES,)):
        raise ValueError(f"an RNG state of {rng.dtype}{list(rng.shape)}, not uint8[{_RNG_BYTES}]")
    hidden = None
    if msg.hidden_parts is not None:
        hidden = []
        for i in range(msg.hidden_parts):
            positions, final, taps = (tensors.pop(("hidden", i, part), None)
                                      for part in ("positions", "final", "taps"))
            if positions is None or final is None or positions.dim() != 1 or final.dim() != 2 \
                    or final.shape[0] != positions.shape[0] or (taps is not None and (
                        taps.dim() != 2 or taps.shape[0] != positions.shape[0])):
                raise ValueError(f"hidden part {i} is missing or misshapen")
            hidden.append((positions.clone(), final.clone(), None if taps is None else taps.clone()))
    if tensors:
        raise ValueError(f"tensors {sorted(tensors)} that a result does not carry")
    return {"output_ids": list(msg.output_ids), "output_logprobs": list(msg.output_logprobs),
            "output_top_logprobs": [list(top) for top in msg.output_top_logprobs],
            "rng": None if rng is None else rng.clone(), "hidden": hidden}
