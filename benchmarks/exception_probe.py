"""Toolchain diagnostic (not a benchmark): does a C++ error raised in a torch extension reach Python
on this machine? On one image (docs/kernel-notes.md) every error the kernels' extension raised
killed the process while torch's own examples did not. This builds small extensions bound the way
sparkserve's are (plain pybind11 `m.def`, no torch error wrapper), with and without the kernels'
compiler flags, and once more linked with an object compiled apart (as the kernels' ISA variants
are), and raises from each entry in a fresh process, so one crash does not hide the rest.

    PYTHONPATH=. python benchmarks/exception_probe.py      (gpu_machine.sh amx runs it)
prints one line per case: caught, or the signal that ended the process."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import sparkserve  # noqa: F401  (before torch: its OpenMP threads must be told to wait passively)

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <stdexcept>
#ifdef PROBE_LINKED
float helper_sum(const float* p, int n);   // in an object compiled apart (HELPER)
#endif

void torch_check() { TORCH_CHECK(false, "probe"); }
void torch_check_int(int64_t n) { TORCH_CHECK(n > 0, "probe: n = ", n, " bytes per row"); }
void std_error() { throw std::runtime_error("probe"); }
// vector work on an over-aligned frame first (the kernels' entry points realign their stacks)
void after_vectors(at::Tensor x) {
  alignas(64) float buf[64];
  const float* p = x.data_ptr<float>();
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i + 8 <= 64; i += 8) {
    _mm256_store_ps(buf + i, _mm256_loadu_ps(p + i));
    acc = _mm256_add_ps(acc, _mm256_load_ps(buf + i));
  }
  float s[8];
  _mm256_storeu_ps(s, acc);
#ifdef PROBE_LINKED
  s[0] += helper_sum(p, 64);
#endif
  TORCH_CHECK(s[0] < -1e30f, "probe: sum ", s[0], " over ", x.size(0));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("torch_check", &torch_check);
  m.def("torch_check_int", &torch_check_int);
  m.def("std_error", &std_error);
  m.def("after_vectors", &after_vectors);
  m.def("torch_check_wrapped", torch::wrap_pybind_function(torch_check));   // load_inline's way
}
"""
# compiled as build.py compiles the ISA variants: no torch headers or flags, std:: inline code of its own
HELPER = r"""
#include <immintrin.h>
#include <functional>
float helper_sum(const float* p, int n) {
  std::function<float(int)> at = [p](int i) { return p[i]; };
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i));
  float s[8];
  _mm256_storeu_ps(s, acc);
  return s[0] + at(0) * 0.0f;
}
"""
FLAVOURS = ("O3_avx2", "kernel_flags", "linked_object")
CALLS = {"torch_check": "m.torch_check()", "torch_check_int": "m.torch_check_int(0)",
         "std_error": "m.std_error()", "after_vectors": "m.after_vectors(torch.ones(64))",
         "torch_check_wrapped": "m.torch_check_wrapped()",
         # the reference: sparkserve's own extension refusing a bad weight
         "sparkserve_rms_norm":
             "kernels.load_extension().rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)"}


def build(flags: str):
    from torch.utils.cpp_extension import load_inline

    from sparkserve.kernels.build import CFLAGS
    cflags, ldflags = (["-O3", "-mavx2"], []) if flags == "O3_avx2" else (CFLAGS, ["-fopenmp"])
    if flags == "linked_object":
        d = os.path.join(tempfile.gettempdir(), "exception_probe_helper")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "helper.cpp"), "w") as f:
            f.write(HELPER)
        cxx = os.environ.get("CXX", "c++")
        subprocess.run([cxx, "-O3", "-fPIC", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-c",
                        os.path.join(d, "helper.cpp"), "-o", os.path.join(d, "helper.o")], check=True)
        cflags, ldflags = [*cflags, "-DPROBE_LINKED"], [*ldflags, os.path.join(d, "helper.o")]
    return load_inline(f"exception_probe_{flags}", SOURCE, extra_cflags=cflags, extra_ldflags=ldflags)


def main() -> int:
    if len(sys.argv) == 3:                       # child: build (cached) and make one call
        import torch  # noqa: F401

        from sparkserve import kernels  # noqa: F401
        m = build(sys.argv[1])  # noqa: F841
        try:
            eval(CALLS[sys.argv[2]])
        except RuntimeError as e:
            print("caught:", str(e).splitlines()[0])
        return 0
    for flags in FLAVOURS:
        subprocess.run([sys.executable, "-c", f"import sys; sys.argv[1:] = ['{flags}']; "
                        "import exception_probe as p; p.build(sys.argv[1])"],
                       cwd=sys.path[0], check=True)
        for call in CALLS:
            r = subprocess.run([sys.executable, __file__, flags, call], capture_output=True, text=True)
            what = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else (
                f"rc {r.returncode} {r.stderr.strip().splitlines()[-1:] }")
            print(f"{flags:13s} {call:20s} {what}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
