"""The frontend and the scheduler process talk over ZMQ ipc:// sockets that carry pickled messages
(messages.py), so no one but the server's own user may reach them: the sockets live in a private
directory (0700, this user's), which is gone when the server stops."""
from __future__ import annotations

import os
import stat

from server_harness import ServerProcess


def _ipc_dirs() -> set[str]:
    """Directories of the sparkserve ipc sockets bound on this machine (from /proc/net/unix)."""
    out = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            path = fields[-1] if len(fields) > 7 else ""
            folder = os.path.dirname(path)
            if os.path.basename(folder).startswith("sparkserve-") and path.endswith(("/in", "/out")):
                out.add(folder)
    return out


def test_the_scheduler_sockets_are_private(llama_dir):
    before = _ipc_dirs()
    server = ServerProcess("--model-path", llama_dir, "--max-total-tokens", "256")
    try:
        server.wait_ready()
        mine = _ipc_dirs() - before
        assert mine, "no ipc socket directory found"
        for d in mine:
            st = os.stat(d)
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid(), (d, oct(st.st_mode))
            for name in ("in", "out"):
                assert stat.S_ISSOCK(os.stat(os.path.join(d, name)).st_mode)
    finally:
        assert server.stop() == 0
        server.remove_log()
    for d in mine:
        assert not os.path.exists(d)
