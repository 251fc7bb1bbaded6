"""What the backends that write into registered memory (nixl, mooncake) share: the control
conversation stays on the ZMQ channel (control.py), the rows move by the engine.

Each side registers its pools' memory with its engine once (again only if the pools' storage
moved). Before its first reservation on a prefill server the decode side sends a `hello`: its
engine's address (nixl agent metadata, a mooncake session) and the layout of its buffers (per
pool, per component buffer as in `components()`: kind, dtype, row shape, address, row stride,
row count). Each reservation carries the decode side's destination rows: its slots, windowed
slots and request row. The prefill side checks the two layouts agree (pool and buffer counts,
each buffer's kind, dtype and row shape: a mismatch is refused as a transfer error before any
byte moves, mem/transfer.py write_request's checks), writes each chunk's rows (one descriptor per
run of rows contiguous on both sides, per buffer), waits for the write, and then sends the
`rows` notice (positions lo..hi are there), which the decode side hears as a Heard event. The
request-row state goes the same way with the last chunk."""
from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import zmq

from sparkserve.core.pool import Pool
from sparkserve.disaggregation import protocol as p
from sparkserve.disaggregation.backend import Cancelled, Heard, PeerGone, Reservation
from sparkserve.disaggregation.control import ControlDecode, ControlPrefill, DecodeEvent
from sparkserve.disaggregation.wire import Tensors, pack
from sparkserve.distributed.interface import local_ip
from sparkserve.mem.transfer import RequestPages, RequestRows, shapes
from sparkserve.messages import Bootstrap

log = logging.getLogger(__name__)


class Buffer(NamedTuple):
    """One component buffer (a layer's) as the other side needs to write into it."""
    kind: str
    dtype: str
    row_shape: tuple[int, ...]
    ptr: int
    row_bytes: int
    stride: int                 # bytes from one row to the next
    rows: int


Layout = list[list[Buffer]]     # per pool, per component buffer, in components() order
Regions = list[tuple[int, int]]  # (address, bytes) of each storage to register


def layout(pools: list[Pool]) -> Layout:
    out = []
    for pool in pools:
        bufs = []
        for c in pool.components():
            for t in c.tensors:
                size = t.element_size()
                row = t[0].numel() * size if t[0].is_contiguous() else -1     # -1: refused below
                bufs.append(Buffer(c.kind, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]),
                                   t.data_ptr(), row, t.stride(0) * size, t.shape[0]))
        out.append(bufs)
    return out


def regions(pools: list[Pool]) -> Regions:
    """The storages under every buffer, each once."""
    seen: dict[int, int] = {}
    for pool in pools:
        for c in pool.components():
            for t in c.tensors:
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sorted(seen.items())


def mismatch(prefill: Layout, decode: Layout) -> str | None:
    """Why rows of `prefill`'s buffers cannot be written into `decode`'s, or None."""
    if len(prefill) < len(decode):      # more on the prefill side: a DSpark draft there only
        return (f"the prefill server has {len(prefill)} pools, the decode server {len(decode)}: a DSpark "
                "draft on the decode side only?")
    for i, (src, dst) in enumerate(zip(prefill, decode)):
        if len(src) != len(dst):
            return (f"pool {i}: the prefill server has {len(src)} layer buffers, the decode server "
                    f"{len(dst)}: the two sides run different models or layouts")
        for j, (s, d) in enumerate(zip(src, dst)):
            if s.row_bytes < 0 or d.row_bytes < 0:
                return (f"pool {i} buffer {j} has rows that are not contiguous on the "
                        f"{'prefill' if s.row_bytes < 0 else 'decode'} server: use tcp")
            if (s.kind, s.dtype, s.row_shape) != (d.kind, d.dtype, d.row_shape):
                return (f"pool {i} buffer {j}: {s.kind} rows of {s.dtype}{list(s.row_shape)} on the prefill "
                        f"server, {d.kind} rows of {d.dtype}{list(d.row_shape)} on the decode server: the "
                        "two sides run different models or layouts")
    return None


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of rows consecutive on both sides: (first source row, first destination row, count)."""
    if len(src) == 0:
        return src, dst, np.zeros(0, dtype=np.int64)
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(src)]))
    return src[starts], dst[starts], ends - starts


def _rows(pages: RequestPages, kind: str, first: int, hi: int) -> np.ndarray:
    if kind == "request_row":
        return np.array([pages.row], dtype=np.int64)
    return pages.index(kind)[first:hi].numpy().astype(np.int64)


@dataclass
class Plan:
    src: np.ndarray        # uint64 addresses on the prefill side
    dst: np.ndarray        # uint64 addresses on the decode side
    length: np.ndarray     # uint64 bytes
    problem: str | None = None

    @property
    def bytes(self) -> int:
        return int(self.length.sum())


def plan(src_layout: Layout, dst_layout: Layout, src_pages: RequestPages, dst_pages: RequestPages,
         first: int, hi: int, state: bool) -> Plan:
    """The writes that put positions first..hi (and with `state` the request row) of every buffer
    where the decode side reserved them; the layouts agree already."""
    hi = min(hi, len(dst_pages.slots))
    pairs: dict[str, tuple] = {}
    src_a, dst_a, lens = [], [], []
    for i, (sbufs, dbufs) in enumerate(zip(src_layout, dst_layout)):
        for j, (s, d) in enumerate(zip(sbufs, dbufs)):
            if s.kind == "request_row" and not state:
                continue
            if s.kind not in pairs:
                rs, rd = _rows(src_pages, s.kind, first, hi), _rows(dst_pages, s.kind, first, hi)
                pairs[s.kind] = (rs, rd, _runs(rs, rd))
            rs, rd, runs = pairs[s.kind]
            if len(rs) == 0:
                continue
            if min(rs.min(), rd.min()) < 0 or rs.max() >= s.rows or rd.max() >= d.rows:
                return Plan(*(np.zeros(0, np.uint64),) * 3,
                            problem=f"pool {i} buffer {j}: rows {rd.min()}..{rd.max()} asked for a buffer of "
                                    f"{d.rows} rows (sending from {rs.min()}..{rs.max()} of {s.rows})")
            if s.stride == s.row_bytes and d.stride == d.row_bytes:
                ss, ds, count = runs
            else:
                ss, ds, count = rs, rd, np.ones(len(rs), dtype=np.int64)
            src_a.append(s.ptr + ss * s.stride)
            dst_a.append(d.ptr + ds * d.stride)
            lens.append(count * s.row_bytes)
    if not lens:
        return Plan(*(np.zeros(0, np.uint64),) * 3)
    return Plan(*(np.concatenate(x).astype(np.uint64) for x in (src_a, dst_a, lens)))


@dataclass
class Peer:
    """A decode server as the prefill side knows it (from its hello)."""
    meta: bytes            # the engine's address of the decode side
    host: str
    layout: Layout
    whole: bool            # its pools hold every layer and whole items (one rank)
    handle: Any = None     # the engine's connection to it, made at the first write


class RegisteredPrefill(ControlPrefill):
    """The prefill side of a registered-memory backend; an engine adds the hooks below."""

    def __init__(self, port: int, host: str = "127.0.0.1", auth=None):
        super().__init__(port, host, auth)
        self.peers: dict[bytes, Peer] = {}
        self.registered: Regions | None = None
        self.refused: set[int] = set()
        self.closed: set[bytes] = set()      # decode servers that said goodbye
        self.given_up: list[Cancelled] = []  # rooms refused here: the scheduler hears at its next poll

    @abstractmethod
    def _register(self, regs: Regions, toward: str) -> None: ...

    @abstractmethod
    def _deregister(self) -> None: ...

    @abstractmethod
    def _connect(self, peer: Peer) -> Any: ...

    @abstractmethod
    def _disconnect(self, handle: Any) -> None: ...

    @abstractmethod
    def _write(self, handle: Any, p: Plan) -> None:
        """Write every descriptor of `p` and wait for it; raises RuntimeError on failure."""

    def _on_message(self, peer: bytes, msg: Any, tensors: Tensors) -> None:
        if not isinstance(msg, p.Hello):
            return super()._on_message(peer, msg, tensors)
        meta = tensors.get(("meta",))
        if meta is None or meta.dtype != torch.uint8 or meta.dim() != 1 or len(tensors) != 1:
            log.warning("PD bootstrap: dropped a hello without its engine metadata")
            return
        self._forget(peer)
        self.peers[peer] = Peer(meta.numpy().tobytes(), msg.host,
                                [[Buffer(**b.model_dump()) for b in pool] for pool in msg.layout],
                                msg.whole)

    def _destination(self, msg: p.Reserve, tensors: Tensors) -> RequestPages:
        """The decode side's slots for the reservation (plan() checks them against its buffers)."""
        slots, swa = tensors.get(("slots",)), tensors.get(("swa_slots",))
        if (msg.dst is None or slots is None or (swa is None) == msg.dst.split
                or len(tensors) != 1 + msg.dst.split):
            raise ValueError("a reservation without its destination slots")
        for t in (slots, swa):
            if t is not None and (t.dtype != torch.int64 or t.dim() != 1 or len(t) != len(slots)):
                raise ValueError(f"destination slots of {t.dtype}{list(t.shape)}, not int64[{len(slots)}]")
        return RequestPages(slots.clone(), None if swa is None else swa.clone(), msg.dst.row)

    def _on_reserve(self, res: Reservation) -> bool:
        if res.peer in self.peers:
            return True
        # this server restarted since the decode server said hello: ask again, the room goes on
        self._send(res, pack(p.Rehello(room=res.room)))
        return False

    def _on_bye(self, peer: bytes) -> None:
        self._forget(peer)
        self.closed.add(peer)

    def _forget(self, peer: bytes) -> None:
        old = self.peers.pop(peer, None)
        if old is not None and old.handle is not None:
            self._disconnect(old.handle)

    def poll(self, timeout_ms: int) -> list[Reservation | Cancelled]:
        events = super().poll(0 if self.given_up else timeout_ms) + self.given_up
        self.given_up = []
        for ev in events:
            if isinstance(ev, Cancelled):
                self.refused.discard(ev.room)
        return events

    def _local(self, pools: list[Pool], toward: str) -> Layout:
        regs = regions(pools)
        if regs != self.registered:
            if self.registered is not None:
                self._deregister()
            self._register(regs, toward)
            self.registered = regs
        return layout(pools)

    def _plan(self, res: Reservation, src: RequestRows, first: int, last: bool) -> str | Plan:
        """Why the rows of `res` cannot be written, or the plan that writes them."""
        peer = self.peers.get(res.peer)
        if peer is None:
            return "the decode server's memory description never came"
        if not peer.whole or shapes(src.pools) != src.shapes:
            return (f"the {self.backend} backend writes one process's pool memory into another's; with "
                    "tensor or pipeline parallel on either side use --disaggregation-transfer-backend tcp")
        mine = self._local(src.pools, peer.host)
        problem = mismatch(mine, peer.layout)
        if problem is not None:
            return problem
        writes = plan(mine, peer.layout, src.pages, res.dst, first, len(src.pages.slots), last)
        return writes if writes.problem is None else writes.problem

    def send_rows(self, res: Reservation, src: RequestRows, lo: int, last: bool) -> None:
        first, hi = max(lo, res.start), len(src.pages.slots)
        if (first >= hi and not last) or res.room in self.refused:
            return
        if res.peer in self.closed:
            raise PeerGone(f"the decode server of room {res.room} closed")
        writes = self._plan(res, src, first, last)
        if isinstance(writes, str):
            return self._refused(res, writes)
        peer = self.peers[res.peer]
        if len(writes.length):
            try:
                if peer.handle is None:
                    peer.handle = self._connect(peer)
                self._write(peer.handle, writes)
            except Exception as e:          # noqa: BLE001  (the engines raise their own kinds)
                self._forget(res.peer)
                self.send_failure(res, f"transfer error: the write into the decode server failed: {e}")
                raise PeerGone(f"the write into the decode server of room {res.room} failed: {e}") from None
        self._send(res, pack(p.RowsSent(room=res.room, lo=first, hi=hi)))

    def _refused(self, res: Reservation, problem: str) -> None:
        """Nothing is written for `room`: the decode side fails it, and so does this side."""
        log.error("room %d: %s", res.room, problem)
        self.refused.add(res.room)
        self.given_up.append(Cancelled(res.room, f"transfer error: {problem}"))
        self._send(res, pack(p.Refused(room=res.room, message=problem[:p.MAX_TEXT])))

    def send_result(self, res: Reservation, result: dict[str, Any]) -> None:
        if res.room in self.refused:
            return
        super().send_result(res, result)

    def send_failure(self, res: Reservation, message: str) -> None:
        self.refused.discard(res.room)
        super().send_failure(res, message)

    def close(self) -> None:
        for peer in list(self.peers):
            self._forget(peer)
        if self.registered is not None:
            self._deregister()
            self.registered = None
        super().close()


class RegisteredDecode(ControlDecode):
    """The decode side of a registered-memory backend; an engine adds the hooks below."""

    def __init__(self, auth=None) -> None:
        super().__init__(auth)
        self.registered: Regions | None = None
        self.meta: bytes = b""
        self.told: dict[tuple[str, int], Layout] = {}     # prefill server -> the layout it has

    @abstractmethod
    def _register(self, regs: Regions, toward: str) -> bytes:
        """Register `regs`; returns what the prefill side needs to reach this memory."""

    @abstractmethod
    def _deregister(self) -> None: ...

    def _before_reserve(self, sock: zmq.Socket, boot: Bootstrap, dst: RequestRows) -> None:
        pools = dst.pools
        regs = regions(pools)
        if regs != self.registered:
            if self.registered is not None:
                self._deregister()
            self.meta = self._register(regs, boot.host)
            self.registered = regs
            self.told.clear()
        key, lay = (boot.host, boot.port), layout(pools)
        if self.told.get(key) != lay:
            hello = p.Hello(host=local_ip(boot.host), whole=shapes(pools) == dst.shapes,
                            layout=[[p.Buffer(**b._asdict()) for b in pool] for pool in lay])
            meta = torch.frombuffer(bytearray(self.meta), dtype=torch.uint8)
            sock.send_multipart(pack(hello, {("meta",): meta}))
            self.told[key] = lay

    def _reserve_extra(self, dst: RequestRows) -> p.Destination:
        return p.Destination(row=int(dst.pages.row), split=dst.pages.swa_slots is not None)

    def _reserve_tensors(self, dst: RequestRows) -> Tensors:
        pages = dst.pages
        out = {("slots",): pages.slots.to(torch.int64)}
        if pages.swa_slots is not None:
            out[("swa_slots",)] = pages.swa_slots.to(torch.int64)
        return out

    def _on_rows(self, room: int, msg: p.RowsSent, tensors: Tensors) -> list[DecodeEvent]:
        return [Heard(room)]            # the rows are in this side's memory already

    def _on_message(self, sock: zmq.Socket, msg: Any) -> list[DecodeEvent]:
        if not isinstance(msg, p.Rehello) or msg.room not in self.rooms:
            return super()._on_message(sock, msg)
        for key, link in self.links.items():
            if link.sock is sock:
                self.told.pop(key, None)
        self._send_reserve(msg.room)
        return []

    def close(self) -> None:
        super().close()
        if self.registered is not None:
            self._deregister()
            self.registered = None
