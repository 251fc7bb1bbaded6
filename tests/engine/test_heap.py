"""release_freed_memory (sparkserve/mem/heap.py): load_model and load_dspark_draft call it so that
what loading freed inside the heap (GGUF blocks once packed, dropped fp32 weights) leaves the
process's resident memory instead of staying with glibc."""
from __future__ import annotations

import json
import subprocess
import sys

from test_quant_kernels import REPO

# In a fresh interpreter: 96 MiB malloc'ed from the heap (mmap and automatic trimming pushed out
# of reach), touched, then freed below a live block that holds the heap's top, so free() alone
# cannot shrink the heap. Prints the resident MiB before the frees, after them, after the helper.
SCRIPT = r"""
import ctypes, json
from sparkserve.mem.heap import release_freed_memory
libc = ctypes.CDLL(None)
libc.mallopt(-3, 1 << 30)      # M_MMAP_THRESHOLD
libc.mallopt(-1, 1 << 30)      # M_TRIM_THRESHOLD
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS")).split()[1]) // 1024
blocks = [libc.malloc(1 << 20) for _ in range(97)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
before = rss()
for b in blocks[:-1]:
    libc.free(b)
freed = rss()
ok = release_freed_memory()
print(json.dumps([before, freed, rss(), ok]))
"""


def test_freed_heap_pages_leave_the_process():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    before, freed, after, ok = json.loads(out.stdout.strip().splitlines()[-1])
    assert ok, "glibc's malloc_trim was not found"
    assert freed > before - 16, (before, freed)          # free() alone keeps the pages resident
    assert after < freed - 64, (freed, after)            # the helper returns them
