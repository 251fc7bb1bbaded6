"""JIT build of the C++ kernels (torch.utils.cpp_extension), once per build command.

The extension is compiled on first use into ~/.cache/sparkserve/kernels/<hash>/ and loaded from
there by every later process. The hash covers everything the build command holds (sources,
flags, torch version, and the include paths, which differ between virtualenvs), so two
environments never rebuild each other's build; a file lock makes concurrent first starts build
once. Without an x86-64 CPU with AVX2 + FMA + F16C, without a compiler, or if the build fails,
one warning is logged and `load_extension()` returns None: callers keep their pure-torch path.
SPARKSERVE_DISABLE_KERNELS=1 forces that fallback."""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sysconfig
import threading
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_DIR, f)
           for f in ("quant_gemv.cpp", "rms_norm.cpp", "decode_attention.cpp", "native_llama.cpp",
                     "thread_pool.cpp", "bindings.cpp")]
HEADERS = [os.path.join(_DIR, f) for f in ("simd.h", "block_linear.h", "paged_attention.h",
                                                "rms_norm.h", "native_llama.h", "thread_pool.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_state: dict[str, object] = {}     # "ext": module or None once tried


def disabled_by_env() -> bool:
    return os.environ.get("SPARKSERVE_DISABLE_KERNELS", "").strip().lower() not in ("", "0", "false", "no")


def cpu_problem() -> str | None:
    """Why this CPU cannot run the kernels, or None if it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPU architecture {platform.machine()} is not x86-64"
    try:
        with open("/proc/cpuinfo") as f:
            flags: set[str] = set()
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2/FMA/F16C"
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def _build_command() -> list[str]:
    """What the compiler command depends on besides the sources."""
    from torch.utils.cpp_extension import include_paths
    return [torch.__version__, sysconfig.get_paths()["include"], os.environ.get("CXX", "c++"),
            *CFLAGS, *include_paths()]


def build_dir() -> str:
    h = hashlib.sha256("\0".join(_build_command()).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    key = h.hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sparkserve", "kernels", key)


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load
    path = build_dir()
    os.makedirs(path, exist_ok=True)
    name = f"sparkserve_kernels_{os.path.basename(path)}"
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # another process building this: wait for it
        if not os.path.exists(os.path.join(path, name + ".so")):
            log.info("building the CPU kernels (first run, about a minute) in %s", path)
        return load(name=name, sources=SOURCES, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                    build_directory=path, verbose=False)


def load_extension() -> ModuleType | None:
    """The compiled extension (built on first call), or None when the kernels cannot be used."""
    if disabled_by_env():
        return None
    with _lock:
        if "ext" not in _state:
            ext, why = None, cpu_problem()
            if why is None:
                try:
                    ext = _build()
                except Exception as e:       # no compiler, no ninja, compile error, ...
                    lines = str(e).strip().splitlines()
                    why = f"build failed: {type(e).__name__}: {lines[-1] if lines else ''}"
            if why is not None:
                log.warning("sparkserve quantized kernels unavailable (%s); using the fp32 path", why)
            _state["ext"] = ext
        return _state["ext"]  # type: ignore[return-value]
