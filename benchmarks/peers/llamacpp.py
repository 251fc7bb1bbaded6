"""The real llama.cpp as a speed peer: `llama-bench` and `llama-server` built from source, once per
machine kind, so benchmarks compare sparkserve with llama.cpp in the same run on the same CPU;
`llama-batched-bench` decodes a batch of sequences (kv_cache_dtype.py's batch-8 peer); `llama-quantize`
makes the other GGUF types of a model they compare on (`quantized`).

    python benchmarks/peers/llamacpp.py [--force]   # find or build (first build ~5 min), print paths

    from peers.llamacpp import tool             # (with benchmarks/ on sys.path)
    bench = tool("llama-bench")                # the one rule every benchmark finds llama.cpp by

Which llama.cpp a benchmark runs (`tool`; every script asks it, none looks on its own):
  1. an explicit path: the script's flag (structured.py --llama-server) or the tool's variable,
     LLAMA_BENCH / LLAMA_SERVER / LLAMA_BATCHED_BENCH / LLAMA_QUANTIZE;
  2. LLAMA_CPP_LIB_PATH: a llama.cpp build's bin/ directory holding the tools (a shared-library
     build, whose libllama gguf_conformance.py's Python bindings load: `lib_dir`);
  3. a copy found: the one build() made for the ISA (cached), else, for the native ISA, a build
     beside the checkout (LOCAL_BUILD: ../llamacpp/build/bin) or one on PATH;
  4. else build() makes it now.
A path given that does not exist is an error naming the variable, never a silent fallback.

Why from source: llama-cpp-python's server is a Python wrapper (one request at a time); issue #20
wants the C++ tools with continuous batching. The source is the llama-cpp-python sdist from PyPI
(pinned below; it vendors llama.cpp at LLAMA_CPP_COMMIT), fetched with `pip download`, so only PyPI
must be reachable. Needs cmake, a C++ compiler (g++) and ninja (`pip install ninja` gives one).

Binaries go to ~/.cache/sparkserve/peers/llama.cpp-<version>-<hash>/bin/, where the hash covers the
CPU flags and the compiler (GGML_NATIVE=ON compiles for this CPU: another machine kind builds its own).
A file lock makes two concurrent first runs build once. The GCC 12 AMX fix (ldtilecfg) is applied to
the source before every build, so AMX machines get a peer that does not segfault at batch > 1.
Environment: SPARKSERVE_PEERS_CACHE (cache root), SPARKSERVE_LLAMACPP_SDIST (a local sdist .tar.gz
instead of downloading), SPARKSERVE_BUILD_JOBS (parallel compile jobs, default: all cores)."""
from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"       # the one pin: sdist of llama-cpp-python that vendors llama.cpp
LLAMA_CPP_COMMIT = "0c1e57098"             # what that sdist vendors (for the record only)
PATCH_LEVEL = 1                            # bump when the patches below change: forces a rebuild
TARGETS = ("llama-bench", "llama-server", "llama-batched-bench", "llama-quantize")
CMAKE_ARGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
# What the build may use of the CPU: "native" is all of it; "avx2" stands in for an AVX2-only
# machine (a laptop before AVX-VNNI), "avx512" for an AVX-512 one without VNNI (Skylake-SP/X), on a
# bigger one, beside sparkserve with the same cap (results_io.ISA_ENV). The later -D of a name wins
# in cmake.
_AVX2 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
         "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
         "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
ISA_ARGS = {
    "native": [],
    "avx2": _AVX2 + ["-DGGML_AVX512=OFF"],
    "avx512": _AVX2 + ["-DGGML_AVX512=ON"],
}

# GCC 12's _tile_loadconfig() declares an 8-byte memory operand, so the stores that fill the 64-byte
# tile config are dropped and AMX matmuls (batch > 1) segfault (llama.cpp issue #20824).
AMX_FILE = "ggml/src/ggml-cpu/amx/mmq.cpp"
AMX_OLD = "    _tile_loadconfig(&tc);\n"
AMX_NEW = ("#if defined(__GNUC__) && !defined(__clang__)\n"
           "    __asm__ volatile (\"ldtilecfg %0\" :: \"m\" (tc));   // sparkserve: GCC 12 fix\n"
           "#else\n"
           "    _tile_loadconfig(&tc);\n"
           "#endif\n")


def _log(msg: str) -> None:
    print(f"[llama.cpp peer] {msg}", file=sys.stderr, flush=True)


def cpu_flags() -> list[str]:
    """The CPU's feature flags (first 'flags' line of /proc/cpuinfo), sorted."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        return f"{cxx}: {out.splitlines()[0] if out else '?'}"
    except (OSError, subprocess.SubprocessError):
        return f"{cxx}: ?"


def _cmake_args(isa: str) -> list[str]:
    if isa not in ISA_ARGS:
        raise ValueError(f"isa must be one of {', '.join(ISA_ARGS)}, not {isa!r}")
    return CMAKE_ARGS + ISA_ARGS[isa]


def cache_dir(isa: str = "native") -> Path:
    """~/.cache/sparkserve/peers/llama.cpp-<version>-<hash of CPU flags, compiler, build options>."""
    root = Path(os.environ.get("SPARKSERVE_PEERS_CACHE") or Path.home() / ".cache/sparkserve/peers")
    key = json.dumps([cpu_flags(), _compiler(), _cmake_args(isa), PATCH_LEVEL])
    return root / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _binaries(d: Path) -> dict[str, Path]:
    return {t: d / "bin" / t for t in TARGETS}


def _ready(d: Path, name: str | None = None) -> bool:
    """Whether the build at d is done, with the tool `name` (default: every one of TARGETS; a build
    made before a tool joined TARGETS serves the others, and build() remakes it for the new one)."""
    want = [_binaries(d)[name]] if name else _binaries(d).values()
    return (d / "build.json").exists() and all(p.exists() for p in want)


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run cmd, appending its output to log; on failure raise with the log's tail."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd).returncode
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-60:])
        raise RuntimeError(f"llama.cpp peer build step failed (exit {rc}): {' '.join(map(str, cmd))}\n"
                           f"--- last lines of {log} ---\n{tail}")


def _fetch_sdist(work: Path, log: Path) -> Path:
    local = os.environ.get("SPARKSERVE_LLAMACPP_SDIST")
    if local:
        return Path(local)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(work)], log)
    found = glob.glob(str(work / "llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python sdist in {work}")
    return Path(found[0])


def _extract_llama_cpp(sdist: Path, work: Path) -> Path:
    """Extract only vendor/llama.cpp from the sdist; return its directory."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        if not members:
            raise RuntimeError(f"{sdist} has no vendor/llama.cpp")
        tar.extractall(work, members=members, filter="data")
    src = next(work.glob("*/vendor/llama.cpp"))
    return src


def apply_patches(src: Path) -> list[str]:
    """Apply the source fixes (idempotent: an already patched tree is left alone)."""
    done = []
    f = src / AMX_FILE
    if f.exists():
        text = f.read_text()
        if "ldtilecfg %0" not in text:
            if AMX_OLD not in text:
                raise RuntimeError(f"AMX fix: `{AMX_OLD.strip()}` not found in {f}")
            f.write_text(text.replace(AMX_OLD, AMX_NEW))
        done.append("amx-ldtilecfg")
    return done


def _check_tools() -> None:
    missing = [t for t in ("cmake", "ninja") if not shutil.which(t)]
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        missing.append("c++ (g++)")
    if missing:
        raise RuntimeError(f"building the llama.cpp peer needs {', '.join(missing)} on PATH "
                           "(ninja: `pip install ninja`)")


def _build_into(d: Path, isa: str) -> None:
    _check_tools()
    jobs = os.environ.get("SPARKSERVE_BUILD_JOBS") or str(os.cpu_count() or 2)
    d.mkdir(parents=True, exist_ok=True)
    log = d / "build.log"
    log.write_text(f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (llama.cpp {LLAMA_CPP_COMMIT}), "
                   f"{_compiler()}\n")
    t0 = time.time()
    _log(f"first build of llama.cpp {LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist) "
         f"into {d} with {jobs} jobs: about 5 min on 2 cores; log: {log}")
    with tempfile.TemporaryDirectory(prefix="build-", dir=d) as tmp:
        work = Path(tmp)
        sdist = _fetch_sdist(work, log)
        src = _extract_llama_cpp(sdist, work)
        patches = apply_patches(src)
        t1 = time.time()
        _log(f"source ready in {t1 - t0:.0f} s (patches: {', '.join(patches) or 'none'}); compiling...")
        build = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(build), *_cmake_args(isa)], log)
        _run(["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS], log)
        (d / "bin").mkdir(exist_ok=True)
        for t, dst in _binaries(d).items():
            found = [p for p in (build / "bin" / t, build / t) if p.exists()]
            if not found:
                raise RuntimeError(f"build finished but {t} is missing under {build}")
            shutil.copy2(found[0], dst)
    took = time.time() - t0
    (d / "build.json").write_text(json.dumps({
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "patches": patches, "compiler": _compiler(), "cmake_args": _cmake_args(isa), "isa": isa, "jobs": jobs,
        "build_seconds": round(took, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_flags": cpu_flags()}, indent=1))
    _log(f"first build done in {took:.0f} s ({took / 60:.1f} min)")


def build(force: bool = False, isa: str = "native") -> dict[str, Path]:
    """Build the TARGETS for `isa` unless cached; return {name: path}. Raises on failure."""
    d = cache_dir(isa)
    if _ready(d) and not force:
        return _binaries(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f"{d.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:                # a second first run waits here, then finds the binaries
            _log(f"another process is building (lock {lock.name}); waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if force or not _ready(d):
                (d / "build.json").unlink(missing_ok=True)
                _build_into(d, isa)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _binaries(d)


TOOL_ENV = {"llama-bench": "LLAMA_BENCH", "llama-server": "LLAMA_SERVER",
            "llama-batched-bench": "LLAMA_BATCHED_BENCH", "llama-quantize": "LLAMA_QUANTIZE"}
# a llama.cpp built by hand beside the checkout (shared libraries: gguf_conformance.py's bindings need them)
LOCAL_BUILD = Path(__file__).resolve().parents[3] / "llamacpp" / "build" / "bin"


def _given(path: str, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: {p} is not a file (the llama.cpp peer it names)")
    return p


def find(name: str, isa: str = "native", override: str | None = None) -> Path | None:
    """The llama.cpp tool `name` by the module's rule (steps 1-3), or None when only a build would
    give it."""
    if name not in TOOL_ENV:
        raise ValueError(f"unknown llama.cpp tool {name!r}: one of {', '.join(TOOL_ENV)}")
    if override:
        return _given(override, f"--{name}")
    if os.environ.get(TOOL_ENV[name]):
        return _given(os.environ[TOOL_ENV[name]], TOOL_ENV[name])
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return _given(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], name), "LLAMA_CPP_LIB_PATH")
    if _ready(cache_dir(isa), name):
        return _binaries(cache_dir(isa))[name]
    if isa != "native":
        return None
    if (LOCAL_BUILD / name).is_file():
        return LOCAL_BUILD / name
    found = shutil.which(name)
    return Path(found) if found else None


def tool(name: str, isa: str = "native", override: str | None = None) -> Path:
    """The llama.cpp tool `name` (llama-bench, llama-server, llama-batched-bench, llama-quantize) every
    benchmark runs: found by the module's rule, else built now."""
    return find(name, isa, override) or build(isa=isa)[name]


def lib_dir() -> Path | None:
    """llama.cpp's shared libraries (libllama.so) for Python bindings on them: LLAMA_CPP_LIB_PATH,
    else the directory of the llama-bench `find` gives when libllama sits beside it; None if none."""
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    if env:
        return Path(env)
    bench = find("llama-bench")
    return bench.parent if bench is not None and (bench.parent / "libllama.so").exists() else None


def describe(path: Path, isa: str = "native") -> str:
    """Where a tool came from, for a results page: the cached build's version and commit, or the path."""
    info = build_info(isa)
    if info and path.parent == cache_dir(isa) / "bin":
        return f"{path.name} built from llama.cpp {info['llama_cpp_commit']} (llama-cpp-python " \
               f"{info['llama_cpp_python']} sdist, {info['isa']})"
    return f"{path.name} at {path}"


def build_info(isa: str = "native") -> dict:
    """What build() recorded (version, commit, patches, compiler, build time), or {} if not built."""
    try:
        return json.loads((cache_dir(isa) / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def quantized(src: str, qtype: str, isa: str = "native") -> Path:
    """`src` (a GGUF file) re-quantized to `qtype` (llama-quantize's names: Q4_0, Q4_K_M, Q6_K, ..)
    by llama.cpp's own tool, once: cached beside the peers' builds. From an already quantized file
    (`--allow-requantize`) the weights are rounded twice, which changes the model a little and its
    speed not at all."""
    root = cache_dir(isa).parent / "models"
    dst = root / f"{Path(src).stem}.{qtype}.gguf"
    if not dst.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".part")
        _run([str(tool("llama-quantize", isa)), "--allow-requantize", src, str(tmp), qtype],
             root / f"{dst.name}.log")
        tmp.rename(dst)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--isa", default="native", choices=sorted(ISA_ARGS),
                    help="what the build may use of the CPU")
    a = ap.parse_args()
    t = time.time()
    if a.force:
        build(force=True, isa=a.isa)
    for name in TARGETS:
        print(f"{name}: {describe(tool(name, a.isa), a.isa)}")
    print(f"cache: {cache_dir(a.isa)} ({'built' if time.time() - t > 5 else 'found or cached'}; "
          f"build took {build_info(a.isa).get('build_seconds', '?')} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
