"""The frontend and the scheduler process talk over ZMQ ipc:// sockets that carry pickled messages
(messages.py), so no one but the server's own user may reach them: the sockets live in a private
directory (0700, this user's), which is gone when the server stops."""
from __future__ import annotations

import os
import stat

from server_harness import ServerProcess


def _family(pid: int) -> set[int]:
    """`pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def _ipc_dirs(pid: int) -> set[str]:
    """Directories of the sparkserve ipc sockets that the server `pid` (or a process it started)
    holds (from /proc/net/unix and the processes' fds: another test's server beside it is not it)."""
    inodes = set()
    for p in _family(pid):
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = set()
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            path = fields[-1] if len(fields) > 7 else ""
            folder = os.path.dirname(path)
            if (fields[6] in inodes and os.path.basename(folder).startswith("sparkserve-")
                    and path.endswith(("/in", "/out"))):
                out.add(folder)
    return out


def test_the_scheduler_sockets_are_private(llama_dir):
    server = ServerProcess("--model-path", llama_dir, "--max-total-tokens", "256")
    try:
        server.wait_ready()
        mine = _ipc_dirs(server.proc.pid)
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
