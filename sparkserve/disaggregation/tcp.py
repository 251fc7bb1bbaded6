"""The tcp transfer backend: no extra install. The rows travel over the control channel itself
(control.py): each `rows` notice carries them as raw frames (wire.py), and the decode side checks
them against its reservation and writes them (RequestRows.write: mem/transfer.py write_request,
or its ranks' pieces under tensor or pipeline parallel)."""
from __future__ import annotations

from sparkserve.disaggregation import protocol as p
from sparkserve.disaggregation.backend import Heard, Reservation
from sparkserve.disaggregation.control import ControlDecode, ControlPrefill, DecodeEvent
from sparkserve.disaggregation.wire import Tensors, pack
from sparkserve.mem.transfer import RequestRows, check_rows


class TcpPrefillTransfer(ControlPrefill):
    backend = "tcp"

    def send_rows(self, res: Reservation, src: RequestRows, lo: int, last: bool) -> None:
        first, n = max(lo, res.start), len(src.pages.slots)
        if first >= n and not last:
            return
        rows = src.read(min(first, n), last)
        self._send(res, pack(p.RowsSent(room=res.room, lo=min(first, n)), rows))


class TcpDecodeTransfer(ControlDecode):
    backend = "tcp"

    def _on_rows(self, room: int, msg: p.RowsSent, tensors: Tensors) -> list[DecodeEvent]:
        _, dst, start = self.rooms[room]
        try:
            check_rows(tensors, dst.shapes, msg.lo, len(dst.pages.slots))
            dst.write(tensors, msg.lo, start)
        except ValueError as e:
            return self._refuse(room, str(e))
        return [Heard(room)]
