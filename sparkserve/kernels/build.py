"""JIT build of the C++ kernels (torch.utils.cpp_extension), once per build command.

The extension is compiled on first use into ~/.cache/sparkserve/kernels/<hash>/ and loaded from
there by every later process. The hash covers everything the build command holds (sources,
flags, torch version, and the include paths, which differ between virtualenvs), so two
environments never rebuild each other's build; a file lock makes concurrent first starts build
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
kernels for one ISA beyond the baseline (ISA_UNITS: the AVX-512 prefill attention tile and decode
attention chunk kernels) are compiled and left out the same way; their callers check the CPU at run
time."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import subprocess
import sysconfig
import threading
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_DIR, f)
           for f in ("quant_gemv.cpp", "int8_dispatch.cpp", "int8_packed.cpp", "rms_norm.cpp",
                     "decode_attention.cpp", "native_llama.cpp", "native_draft.cpp", "markov_greedy.cpp",
                     "argmax.cpp", "sample.cpp", "prefill_attention.cpp", "prefill_attention_avx2.cpp",
                     "decode_attention_avx2.cpp", "thread_pool.cpp", "bindings.cpp")]
HEADERS = [os.path.join(_DIR, f)
           for f in ("simd.h", "block_linear.h", "int8_common.h", "int8_packed.h", "int8_packed_ymm.h",
                     "int8_packed_zmm.h", "int8_amx_body.h", "int8_avxvnni_body.h", "amx_tiles.h",
                     "paged_attention.h", "prefill_attention.h", "prefill_tile.h", "rms_norm.h",
                     "native_llama.h", "native_draft.h", "markov_greedy.h", "thread_pool.h", "vec_ymm.h",
                     "vec_zmm.h", "decode_chunk.h", "decode_tile.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
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
             "decode_avx512": ("decode_attention_avx512.cpp", VARIANTS["avx512"])}
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


def _build_command() -> list[str]:
    """What the compiler command depends on besides the sources."""
    from torch.utils.cpp_extension import include_paths
    return [torch.__version__, sysconfig.get_paths()["include"], os.environ.get("CXX", "c++"),
            *CFLAGS, *include_paths(), repr(VARIANTS), repr(ISA_UNITS)]


def _compile_unit(path: str, src: str, obj: str, flags: list[str]) -> bool:
    """Compile src to path/obj (once) with the baseline and `flags`; False if the compiler rejects it."""
    obj = os.path.join(path, obj)
    if not os.path.exists(obj):
        cmd = [os.environ.get("CXX", "c++"), "-O3", "-fPIC", "-std=c++17", "-mavx2", "-mfma", "-mf16c",
               *flags, "-c", os.path.join(_DIR, src), "-o", obj + ".tmp"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log.info("%s left out: the compiler rejects %s (%s)", src, " ".join(flags),
                     r.stderr.strip()[-300:])
            return False
        os.replace(obj + ".tmp", obj)
    return True


def _compile_variants(path: str) -> list[str]:
    """Compile each int8 variant to path/int8_<name>.o with its flags; the names that compiled.
    The AVX2 variant (with the quantizer) is required: its failure raises."""
    built = []
    for name, flags in VARIANTS.items():
        need = VARIANT_NEEDS.get(name)
        if need is not None and need not in built:
            log.info("int8 kernel variant %s left out: it needs %s", name, need)
            continue
        if _compile_unit(path, f"int8_{name}.cpp", f"int8_{name}.o", flags):
            built.append(name)
        elif name == "avx2":
            raise RuntimeError("int8 kernel (avx2) failed to compile (see the log)")
    return built


def build_dir() -> str:
    h = hashlib.sha256("\0".join(_build_command()).encode())
    for path in SOURCES + HEADERS + VARIANT_SOURCES + UNIT_SOURCES:
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
        # torch's own lock file in the build folder: holding the flock, nobody else is building,
        # so one left here is from a build that was killed, and torch would wait on it forever
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "lock"))
        if not os.path.exists(os.path.join(path, name + ".so")):
            log.info("building the CPU kernels (first run, about a minute) in %s", path)
        variants = _compile_variants(path)
        units = [n for n, (src, flags) in ISA_UNITS.items() if _compile_unit(path, src, f"{n}.o", flags)]
        defines = [f"-DSPARKSERVE_HAS_{v.upper()}" for v in variants + units]
        objs = [os.path.join(path, f"{o}.o") for o in [f"int8_{v}" for v in variants] + units]
        return load(name=name, sources=SOURCES, extra_cflags=CFLAGS + defines,
                    extra_ldflags=["-fopenmp", *objs], build_directory=path, verbose=False)


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
            else:
                log.info("sparkserve int8 kernel variant: %s, decode attention: %s, prefill attention: %s",
                         ext.int8_variant(), ext.decode_attention_variants()[0],  # type: ignore[union-attr]
                         ext.prefill_attention_variant() or "SDPA")  # type: ignore[union-attr]
            _state["ext"] = ext
        return _state["ext"]  # type: ignore[return-value]
