"""The kernel build is cached per torch ABI, not per virtualenv: its key follows the sources'
contents, the flags, torch and the compiler, never the include or source paths (which differ
between virtualenvs and clones), so a second environment with the same torch loads the first's
build. `sparkserve build-kernels` (the README's install step) names a cached build or builds one,
and a failed build shows the compiler's message."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.utils.cpp_extension as cpp

from sparkserve.kernels import build

FAKE_CXX = "#!/bin/sh\necho 'fake-cxx: error: this is not a compiler' >&2\nexit 1\n"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPARKSERVE_DISABLE_KERNELS"}
    env.update(extra)
    return env


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkserve", *args], capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)


def _needs_kernels():
    """A CPU that runs the kernels must build them (a failed build is this test's failure, not a skip)."""
    why = build.cpu_problem()
    if why is not None:
        pytest.skip(f"the C++ kernels need an x86-64 CPU with AVX2/FMA/F16C: {why}")
    assert build.load_extension() is not None, "the kernels failed to build on a CPU that runs them"


def test_cache_key_follows_contents_not_paths(monkeypatch, tmp_path):
    here = build.cache_key()
    assert build.cache_key() == here                            # stable for the same build
    # another virtualenv: other include folders (torch's and Python's)
    real = cpp.include_paths()
    monkeypatch.setattr(cpp, "include_paths", lambda *a, **k: ["/other/venv/include"] + real[1:])
    monkeypatch.setattr(build.sysconfig, "get_paths", lambda *a, **k: {"include": "/other/venv/py"})
    assert build.cache_key() == here
    # another clone: the same sources in another folder
    copies = tmp_path / "clone"
    copies.mkdir()
    lists = ("SOURCES", "HEADERS", "VARIANT_SOURCES", "UNIT_SOURCES")
    for name in lists:
        moved = []
        for path in getattr(build, name):
            shutil.copy(path, copies)
            moved.append(str(copies / os.path.basename(path)))
        monkeypatch.setattr(build, name, moved)
    assert build.cache_key() == here
    # ... but an edited source or header is another build
    header = copies / "simd.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert build.cache_key() != here
    header.write_text(header.read_text()[:-len("\n// edited\n")])
    assert build.cache_key() == here
    # so are other flags, another torch, another compiler
    with monkeypatch.context() as m:
        m.setattr(build, "CFLAGS", build.CFLAGS + ["-DX"])
        assert build.cache_key() != here
    with monkeypatch.context() as m:
        m.setattr(build, "UNIT_CFLAGS", build.UNIT_CFLAGS + ["-DX"])
        assert build.cache_key() != here
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.99.0+cpu")
        assert build.cache_key() != here
    with monkeypatch.context() as m:
        m.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
        assert build.cache_key() != here
    with monkeypatch.context() as m:
        other = tmp_path / "other-cxx"
        other.write_text("#!/bin/sh\necho 'other-cxx 99.1'\n")
        other.chmod(0o755)
        m.setenv("CXX", str(other))
        assert build.cache_key() != here
    assert build.cache_key() == here
    assert build.build_dir() == os.path.join(build.cache_root(), here)


def test_build_kernels_names_the_cached_build():
    _needs_kernels()
    t0 = time.monotonic()
    r = _cli("build-kernels")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already built" in r.stdout and build.build_dir() in r.stdout, r.stdout
    assert "building" not in r.stdout + r.stderr
    assert time.monotonic() - t0 < 30


def test_another_environment_loads_the_build_without_rebuilding():
    """Another virtualenv's torch headers sit elsewhere: the build in the cache loads as it is
    (no ninja run over the first environment's build file)."""
    _needs_kernels()
    code = ("import sparkserve\n"
            "import torch.utils.cpp_extension as c\n"
            "c.include_paths = lambda *a, **k: ['/nonexistent/venv/include']\n"
            "from sparkserve.kernels import build\n"
            "def no_build(path): raise SystemExit('rebuilt in ' + path)\n"
            "ext, built = build._build(no_build)\n"
            "assert not built\n"
            "print(build._describe(ext))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "int8 kernel variant" in r.stdout


def test_failed_build_exits_1_with_the_compilers_message(tmp_path):
    _needs_kernels()
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    r = _cli("build-kernels", env=_env(CXX=str(cxx), XDG_CACHE_HOME=str(cache)), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    error = r.stderr.partition("sparkserve: error:")[2]          # after the log lines
    assert "fake-cxx: error: this is not a compiler" in error, r.stderr
    assert str(cache / "sparkserve" / "kernels") in r.stdout + r.stderr
    assert not any(cache.glob("sparkserve/kernels/*/built"))


def test_a_first_start_says_it_builds(monkeypatch, tmp_path, caplog):
    """Where nothing is built yet, load_extension's build logs what it does before it starts."""
    _needs_kernels()
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=build.log.name), \
            pytest.raises(RuntimeError, match="fake-cxx: error"):
        build._build()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("building the C++ CPU kernels once" in m and str(tmp_path / "cache") in m for m in said), said
