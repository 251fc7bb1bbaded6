"""The tcp transfer backend: no extra install. The rows travel over the control channel itself
(control.py): each `rows` notice carries them as raw frames (wire.py), and the decode side writes
them into its reservation (RequestRows.write: mem/transfer.py write_request, or its ranks' pieces
under tensor or pipeline parallel)."""
from __future__ import annotations

from typing import Any

from sparkserve.disaggregation.backend import Heard, Reservation
from sparkserve.disaggregation.control import ControlDecode, ControlPrefill, DecodeEvent
from sparkserve.disaggregation.wire import pack
from sparkserve.mem.transfer import RequestRows, Rows


class TcpPrefillTransfer(ControlPrefill):
    backend = "tcp"

    def send_rows(self, res: Reservation, src: RequestRows, lo: int, last: bool) -> None:
        first, n = max(lo, res.start), len(src.pages.slots)
        if first >= n and not last:
            return
        rows = src.read(min(first, n), last)
        self._send(res, pack({"kind": "rows", "room": res.room, "lo": first}, rows))


class TcpDecodeTransfer(ControlDecode):
    backend = "tcp"

    def _on_rows(self, room: int, msg: dict[str, Any], rows: Rows | None) -> list[DecodeEvent]:
        _, dst, start = self.rooms[room]
        try:
            dst.write(rows, msg["lo"], start)
        except ValueError as e:
            return self._refuse(room, str(e))
        return [Heard(room)]
