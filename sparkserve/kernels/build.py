"""Build of the C++ kernels (torch.utils.cpp_extension), once per torch ABI.

The extension is compiled into $XDG_CACHE_HOME (~/.cache)/sparkserve/kernels/<key>/ by
`sparkserve build-kernels` (the README's install step) or else on first use, and loaded from there
by every later process. The key (`cache_key()`) covers what decides binary compatibility, not
where things are installed: the contents of the sources and headers, the flags, torch's version and
C++ ABI, Python's ABI tag, the compiler's identity and the platform; so a second virtualenv (or a
fresh clone) with the same torch loads the first one's build. A finished build is imported
directly (no ninja run, whose build file holds the first environment's paths); the .so finds
libtorch / libc10 by soname among the libraries the running torch has loaded (no RPATH), so it
does not depend on the environment that built it. A file lock makes concurrent first starts build
once. Without an x86-64 CPU with AVX2 + FMA + F16C, without a compiler, or if the build fails,
one warning is logged and `load_extension()` returns None: callers keep their pure-torch path.
SPARKSERVE_DISABLE_KERNELS=1 forces that fallback.

The int8-activation kernels come in CPU variants (VARIANTS), each its own translation unit compiled
here to an object file with its own ISA flags and linked into the extension; a variant the compiler
rejects is left out (the AVX2 one is required; the AMX ones call the AVX-512 VNNI one for single rows
and need it). int8_dispatch.cpp picks one at run time by the CPU's flags;
SPARKSERVE_KERNEL_VARIANTS_OFF=amx,avx512vnni,avx512,avxvnni switches variants off (see `variant()`).
"amx_emulated" is the AMX kernel on software tiles, which tests run on CPUs without AMX, and
"avxvnni_evex" the AVX-VNNI kernel on AVX-512 VNNI's dpbusd, for CPUs without AVX-VNNI. Other
kernels for one ISA beyond the baseline (ISA_UNITS: the AVX-512 and AVX-512 VNNI prefill attention
tiles and decode attention chunk kernels) are compiled and left out the same way; their callers check
the CPU at run time."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_DIR, f)
           for f in ("quant_gemv.cpp", "int8_dispatch.cpp", "int8_packed.cpp", "rms_norm.cpp",
                     "decode_attention.cpp", "native_llama.cpp", "native_draft.cpp", "markov_greedy.cpp",
                     "moe_experts.cpp", "argmax.cpp", "sample.cpp", "prefill_attention.cpp",
                     "prefill_attention_avx2.cpp", "decode_attention_avx2.cpp", "thread_pool.cpp",
                     "native_mla.cpp", "bindings.cpp")]
HEADERS = [os.path.join(_DIR, f)
           for f in ("simd.h", "block_linear.h", "int8_common.h", "int8_packed.h", "int8_packed_ymm.h",
                     "int8_packed_zmm.h", "int8_amx_body.h", "int8_avxvnni_body.h", "amx_tiles.h",
                     "paged_attention.h", "prefill_attention.h", "prefill_tile.h", "rms_norm.h",
                     "native_llama.h", "native_draft.h", "markov_greedy.h", "moe_experts.h", "thread_pool.h",
                     "vec_ymm.h", "vec_zmm.h", "decode_chunk.h", "decode_tile.h", "native_mla.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# the separately compiled units (variants, ISA_UNITS): these, then each one's own flags
UNIT_CFLAGS = ["-O3", "-fPIC", "-std=c++17", "-mavx2", "-mfma", "-mf16c"]
# int8 kernel variants, each after the one it calls: name -> extra ISA flags (on top of the AVX2
# baseline). The dispatcher's order is int8_dispatch.cpp's.
VARIANTS = {
    "avx2": [],
    "avxvnni": ["-mavxvnni"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl"],
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
    "amx_emulated": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],    # tests only
    "avxvnni_evex": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],    # tests only
}
# variants that call another one (the AMX kernels send single rows to AVX-512 VNNI)
VARIANT_NEEDS = {"amx": "avx512vnni", "amx_emulated": "avx512vnni"}
VARIANT_SOURCES = [os.path.join(_DIR, f"int8_{name}.cpp") for name in VARIANTS]
# Other kernels for one ISA beyond the baseline, compiled and left out as the variants are:
# name -> (source, flags); the extension sees SPARKSERVE_HAS_<NAME> for each one built.
ISA_UNITS = {"prefill_avx512": ("prefill_attention_avx512.cpp", VARIANTS["avx512"]),
             "decode_avx512": ("decode_attention_avx512.cpp", VARIANTS["avx512"]),
             "decode_avx512vnni": ("decode_attention_avx512vnni.cpp", VARIANTS["avx512vnni"]),
             "prefill_avx512vnni": ("prefill_attention_avx512vnni.cpp", VARIANTS["avx512vnni"])}
UNIT_SOURCES = [os.path.join(_DIR, src) for src, _ in ISA_UNITS.values()]
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


def _cxx() -> str:
    return os.environ.get("CXX", "c++")     # what torch.utils.cpp_extension compiles with


@functools.lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> str:
    """`cxx --version` (names the compiler and its version), or why it cannot be run."""
    try:
        r = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return f"{r.returncode}:{r.stdout.strip()}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unusable: {type(e).__name__}"


def _key_parts() -> list[str]:
    """What the build's binary compatibility depends on besides the source contents; no paths
    (include folders and the sources' folder differ between virtualenvs and clones)."""
    return [f"torch {torch.__version__} {torch.version.git_version}",
            f"cxx11abi {int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"python {sysconfig.get_config_var('SOABI')} {sysconfig.get_config_var('EXT_SUFFIX')}",
            f"compiler {_cxx()} {_compiler_identity(_cxx())}",
            f"platform {sys.platform} {platform.machine()} {' '.join(platform.libc_ver())}",
            *CFLAGS, "ld", *LDFLAGS, "units", *UNIT_CFLAGS,
            repr(VARIANTS), repr(VARIANT_NEEDS), repr(ISA_UNITS)]


def cache_key() -> str:
    """The build's key: _key_parts() and each source's and header's name and contents."""
    h = hashlib.sha256("\0".join(_key_parts()).encode())
    for path in SOURCES + HEADERS + VARIANT_SOURCES + UNIT_SOURCES:
        with open(path, "rb") as f:
            h.update(b"\0" + os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def _compile_unit(path: str, src: str, obj: str, flags: list[str]) -> str | None:
    """Compile src to path/obj (once) with UNIT_CFLAGS and `flags`; None, or the compiler's message
    if it rejects them."""
    obj = os.path.join(path, obj)
    if not os.path.exists(obj):
        cmd = [_cxx(), *UNIT_CFLAGS, *flags, "-c", os.path.join(_DIR, src), "-o", obj + ".tmp"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:                # no such compiler
            return f"{' '.join(cmd)}: {e}"
        if r.returncode != 0:
            msg = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}")
            log.info("%s left out: the compiler rejects %s (%s)", src, " ".join(flags), msg[-300:])
            return f"{' '.join(cmd)}\n{msg}"
        os.replace(obj + ".tmp", obj)
    return None


def _compile_variants(path: str) -> list[str]:
    """Compile each int8 variant to path/int8_<name>.o with its flags; the names that compiled.
    The AVX2 variant (with the quantizer) is required: its failure raises with the compiler's message."""
    built = []
    for name, flags in VARIANTS.items():
        need = VARIANT_NEEDS.get(name)
        if need is not None and need not in built:
            log.info("int8 kernel variant %s left out: it needs %s", name, need)
            continue
        err = _compile_unit(path, f"int8_{name}.cpp", f"int8_{name}.o", flags)
        if err is None:
            built.append(name)
        elif name == "avx2":
            raise RuntimeError(f"the int8 kernel (avx2) failed to compile:\n{err}")
    return built


def cache_root() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sparkserve", "kernels")


def build_dir() -> str:
    return os.path.join(cache_root(), cache_key())


_DONE = "built"        # written into the build folder once its .so has loaded


def _import(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, name + ".so"))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _announce(path: str) -> None:
    log.warning("building the C++ CPU kernels once (about a minute) into %s "
                "(`sparkserve build-kernels` does this at install)", path)


def _build(announce: Callable[[str], None] = _announce) -> tuple[ModuleType, bool]:
    """(the extension, whether this call built it): imported from the cache when built there;
    `announce(folder)` is called when a build starts."""
    path = build_dir()
    name = f"sparkserve_kernels_{os.path.basename(path)}"
    if os.path.exists(os.path.join(path, _DONE)):
        return _import(path, name), False
    from torch.utils.cpp_extension import load
    os.makedirs(path, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # another process building this: wait for it
        if os.path.exists(os.path.join(path, _DONE)):
            return _import(path, name), False
        # torch's own lock file in the build folder: holding the flock, nobody else is building,
        # so one left here is from a build that was killed, and torch would wait on it forever
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "lock"))
        announce(path)
        t0 = time.monotonic()
        variants = _compile_variants(path)
        units = [n for n, (src, flags) in ISA_UNITS.items()
                 if _compile_unit(path, src, f"{n}.o", flags) is None]
        defines = [f"-DSPARKSERVE_HAS_{v.upper()}" for v in variants + units]
        objs = [os.path.join(path, f"{o}.o") for o in [f"int8_{v}" for v in variants] + units]
        ext = load(name=name, sources=SOURCES, extra_cflags=CFLAGS + defines,
                   extra_ldflags=[*LDFLAGS, *objs], build_directory=path, verbose=False)
        with open(os.path.join(path, _DONE), "w") as f:
            f.write(f"{time.monotonic() - t0:.1f} s\n")
        log.info("built the C++ CPU kernels in %.0f s", time.monotonic() - t0)
        return ext, True


def build_kernels(announce: Callable[[str], None] = _announce) -> tuple[str, bool, str]:
    """For `sparkserve build-kernels`: (the build folder, whether built now, a line on what the
    extension runs). Raises with the compiler's message when the build fails; ValueError when
    the kernels are not used here (SPARKSERVE_DISABLE_KERNELS, or the CPU)."""
    why = "SPARKSERVE_DISABLE_KERNELS is set" if disabled_by_env() else cpu_problem()
    if why is not None:
        raise ValueError(why)
    ext, built = _build(announce)
    with _lock:
        _state.setdefault("ext", ext)
    return build_dir(), built, _describe(ext)


def _describe(ext: ModuleType) -> str:
    return (f"int8 kernel variant: {ext.int8_variant()}, decode attention: "
            f"{ext.decode_attention_variants()[0]}, "
            f"prefill attention: {ext.prefill_attention_variant() or 'SDPA'}")


def load_extension() -> ModuleType | None:
    """The compiled extension (built on first call), or None when the kernels cannot be used."""
    if disabled_by_env():
        return None
    with _lock:
        if "ext" not in _state:
            ext, why = None, cpu_problem()
            if why is None:
                try:
                    ext = _build()[0]
                except Exception as e:       # no compiler, no ninja, compile error, ...
                    lines = str(e).strip().splitlines()
                    why = f"build failed: {type(e).__name__}: {lines[-1] if lines else ''}"
            if why is not None:
                log.warning("sparkserve quantized kernels unavailable (%s); using the fp32 path", why)
            else:
                log.info("sparkserve %s", _describe(ext))  # type: ignore[arg-type]
            _state["ext"] = ext
        return _state["ext"]  # type: ignore[return-value]
