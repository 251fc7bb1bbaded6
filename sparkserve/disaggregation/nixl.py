"""The nixl transfer backend (`pip install 'sparkserve[nixl]'`): a NIXL agent with the UCX
backend on each side; the decode side's hello carries its agent metadata (which holds its
registered memory), the prefill side loads it and WRITEs the rows (registered.py says what moves
when). Pool memory is CPU memory (DRAM)."""
from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np

from sparkserve.disaggregation.auth import PeerAuth
from sparkserve.disaggregation.registered import Peer, Plan, Regions, RegisteredDecode, RegisteredPrefill

WRITE_TIMEOUT_S = 60.0


def _agent(role: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config
    name = f"sparkserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _descs(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.stack([addrs, lengths, np.zeros_like(addrs)], axis=1).astype(np.uint64)


class _Registering:
    agent: Any
    reg: Any = None

    def _register_regions(self, regs: Regions) -> None:
        self.reg = self.agent.register_memory([(ptr, n, 0, "") for ptr, n in regs], "DRAM")

    def _deregister(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None


class NixlPrefillTransfer(_Registering, RegisteredPrefill):
    backend = "nixl"

    def __init__(self, port: int, host: str = "127.0.0.1", auth: PeerAuth | None = None):
        self.agent = _agent("prefill")
        super().__init__(port, host, auth)

    def _register(self, regs: Regions, toward: str) -> None:
        self._register_regions(regs)

    def _connect(self, peer: Peer) -> Any:
        return self.agent.add_remote_agent(peer.meta)

    def _disconnect(self, handle: Any) -> None:
        try:
            self.agent.remove_remote_agent(handle)
        except Exception:   # noqa: BLE001  (already gone)
            pass

    def _write(self, handle: Any, p: Plan) -> None:
        xfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(_descs(p.src, p.length), "DRAM"),
                                          self.agent.get_xfer_descs(_descs(p.dst, p.length), "DRAM"), handle)
        try:
            state = self.agent.transfer(xfer)
            end, spins = time.monotonic() + WRITE_TIMEOUT_S, 0
            while state == "PROC":
                spins += 1
                if spins > 1000:
                    time.sleep(0.0001)
                    if time.monotonic() > end:
                        raise RuntimeError(f"nixl write unfinished after {WRITE_TIMEOUT_S:g} s")
                state = self.agent.check_xfer_state(xfer)
            if state != "DONE":
                raise RuntimeError(f"nixl write state {state}")
        finally:
            self.agent.release_xfer_handle(xfer)


class NixlDecodeTransfer(_Registering, RegisteredDecode):
    backend = "nixl"

    def __init__(self, auth: PeerAuth | None = None) -> None:
        self.agent = _agent("decode")
        super().__init__(auth)

    def _register(self, regs: Regions, toward: str) -> bytes:
        self._register_regions(regs)
        return self.agent.get_agent_metadata()
