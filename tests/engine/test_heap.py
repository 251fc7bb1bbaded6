"""sparkserve/mem/heap.py: release_freed_memory, which load_model and load_dspark_draft call so
that what loading freed inside the heap (GGUF blocks once packed, dropped fp32 weights) leaves the
process's resident memory instead of staying with glibc; and lazy_zeros, which lets the KV and
state pools take RAM only as requests fill them."""
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


# In a fresh interpreter: a KV pool of 2 x 2 x 65537 slots x 1 KiB (256 MiB), resident MiB before,
# after it is made, after every element is read (a read maps the shared zero page), after 16384
# slots of one K tensor are written, and whether it read as zeros.
POOL_SCRIPT = r"""
import json, torch
from sparkserve.mem.kv_pool import KVPool
def rss():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS")).split()[1]) // 1024
before = rss()
pool = KVPool(num_slots=65536, num_layers=2, num_kv_heads=4, head_dim=64)
made = rss()
zero = all(int(t.count_nonzero()) == 0 for t in pool.k + pool.v)
read = rss()
pool.k[0][1:16385] = 1.0
print(json.dumps([before, made, read, rss(), zero, pool.k[0].dtype == torch.float32]))
"""


def test_pools_take_memory_as_they_fill():
    out = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, made, read, written, zero, fp32 = json.loads(out.stdout.strip().splitlines()[-1])
    assert zero and fp32
    assert made - before < 16, (before, made)          # torch.zeros would make all 256 MiB resident
    assert read - before < 16, (before, read)
    assert 14 <= written - read < 40, (read, written)   # the 16 MiB written (2 MiB pages at most)
