"""The kernel build folder is keyed on everything the build command holds, so two virtualenvs
with the same torch but other include paths never rebuild each other's build."""
from __future__ import annotations

import torch.utils.cpp_extension as cpp

from sparkserve.kernels import build


def test_build_dir_follows_the_build_command(monkeypatch):
    here = build.build_dir()
    assert build.build_dir() == here                          # stable for the same command
    real = cpp.include_paths()
    monkeypatch.setattr(cpp, "include_paths", lambda *a, **k: ["/other/venv/include"] + real[1:])
    assert build.build_dir() != here
    monkeypatch.setattr(cpp, "include_paths", lambda *a, **k: real)
    monkeypatch.setattr(build, "CFLAGS", build.CFLAGS + ["-DX"])
    assert build.build_dir() != here
