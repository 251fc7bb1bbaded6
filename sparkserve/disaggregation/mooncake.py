"""The mooncake transfer backend (`pip install 'sparkserve[mooncake]'`): a Mooncake TransferEngine
on each side with its own peer-to-peer handshake (no metadata server) over the TCP protocol (the
RDMA protocol needs the CUDA build and RDMA devices). The decode side's hello carries its
engine's session address; the prefill side writes the rows with one batched synchronous write
per chunk (registered.py says what moves when). The engine refuses a write outside the memory
the other side registered."""
from __future__ import annotations

from typing import Any

from sparkserve.disaggregation.registered import (
    Peer,
    Plan,
    Regions,
    RegisteredDecode,
    RegisteredPrefill,
    local_ip,
)

PROTOCOL = "tcp"
MAX_BATCH = 1024        # descriptors per batched write: its TCP transport queues about 4000 at most


class _Engine:
    engine: Any = None
    session: str = ""
    regs: Regions = []

    def _start(self, toward: str) -> None:
        if self.engine is not None:
            return
        from mooncake.engine import TransferEngine
        host = local_ip(toward)
        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise RuntimeError(f"the mooncake transfer engine did not start on {host}")
        self.engine, self.session = engine, f"{host}:{engine.get_rpc_port()}"

    def _register(self, regs: Regions, toward: str) -> bytes:
        self._start(toward)
        for ptr, n in regs:
            if self.engine.register_memory(ptr, n) != 0:
                raise RuntimeError(f"mooncake could not register {n} bytes at {ptr:#x}")
        self.regs = regs
        return self.session.encode()

    def _deregister(self) -> None:
        for ptr, _ in self.regs:
            self.engine.unregister_memory(ptr)
        self.regs = []


class MooncakePrefillTransfer(_Engine, RegisteredPrefill):
    backend = "mooncake"

    def _connect(self, peer: Peer) -> Any:
        return peer.meta.decode()   # the session "host:port": the engine handshakes on first use

    def _disconnect(self, handle: Any) -> None:
        pass

    def _write(self, handle: Any, p: Plan) -> None:
        for i in range(0, len(p.length), MAX_BATCH):
            part = slice(i, i + MAX_BATCH)
            ret = self.engine.batch_transfer_sync_write(handle, p.src[part].tolist(), p.dst[part].tolist(),
                                                        p.length[part].tolist())
            if ret != 0:
                raise RuntimeError(f"mooncake write to {handle} returned {ret}")


class MooncakeDecodeTransfer(_Engine, RegisteredDecode):
    backend = "mooncake"
