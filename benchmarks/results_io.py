"""Where benchmark scripts put their results: NAME.json (raw numbers) and NAME.md (the table)."""
from __future__ import annotations

import json
import os
import sys

# SPARKSERVE_BENCH_RESULTS=DIR sends a trial run elsewhere, leaving the checked-in results alone
RESULTS = (os.environ.get("SPARKSERVE_BENCH_RESULTS")
           or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))


def write_results(name: str, data, lines: list[str]) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def peer_env(**extra: str) -> dict[str, str]:
    """The environment to start a peer in (llama.cpp, transformers in a process of its own): this
    process's without what importing sparkserve added (sparkserve.ENV_DEFAULTS: OpenMP threads that
    wait passively, which slow llama.cpp's several times), plus `extra`."""
    import sparkserve
    env = {k: v for k, v in os.environ.items() if sparkserve.ENV_DEFAULTS.get(k) != v}
    env.update(extra)
    return env


# the SIMD features that decide which kernels llama.cpp and sparkserve can use on this CPU
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                     "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


# --isa avx2 runs what an AVX2-only machine (a laptop before AVX-VNNI) would, on a bigger CPU, and
# --isa avx512 what an AVX-512 machine without VNNI (Skylake-SP/X) would: sparkserve's int8
# kernels, torch's own (ATen) and oneDNN are held to that, as is llama.cpp's build
# (peers/llamacpp.py ISA_ARGS).
ISA_ENV = {"native": {},
           "avx2": {"SPARKSERVE_KERNEL_VARIANTS_OFF": "amx,avx512vnni,avx512,avxvnni",
                    "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
           "avx512": {"SPARKSERVE_KERNEL_VARIANTS_OFF": "amx,avx512vnni,avxvnni",
                      "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}


def cap_isa(isa: str) -> None:
    """Hold this process to `isa`: torch reads its caps when it loads, so a process without them
    in its environment runs itself again with them (and exits with that run's status)."""
    want = ISA_ENV[isa]
    if any(os.environ.get(k) != v for k, v in want.items()):
        # without sparkserve's additions: the new process's import makes them again, and knows them
        os.execve(sys.executable, [sys.executable, *sys.argv], peer_env(**want))


def isa_build(isa: str) -> str:
    """How llama.cpp was built for `isa`, for result headers."""
    off = "VNNI/AMX" if isa == "avx512" else "AVX-512/VNNI/AMX"
    return "GGML_NATIVE" if isa == "native" else f"{isa.upper()} only (GGML_NATIVE off, {off} off)"


def results_name(name: str, isa: str) -> str:
    """decode, decode_avx2, ...: a capped run keeps the machine's own results."""
    return name if isa == "native" else f"{name}_{isa}"


def machine_info(isa: str = "native") -> dict:
    """CPU model, cores, SIMD flags (from /proc/cpuinfo) and the ISA cap, for result headers: the
    project's machines differ (AVX2 only, AVX-512 + VNNI, AMX), so a number means nothing without them."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
            "isa": isa}


def machine_line(info: dict | None = None) -> str:
    """One Markdown line: 'CPU: AMD EPYC, 2 CPUs; flags: avx2 fma f16c'."""
    info = info or machine_info()
    cap = "" if info.get("isa", "native") == "native" else \
        f"; **held to {info['isa'].upper()}{' without VNNI' if info['isa'] == 'avx512' else ''}** " \
        "(sparkserve, torch, oneDNN and llama.cpp's build)"
    return (f"CPU: {info['cpu']}, {info['cpus']} CPUs; flags: {' '.join(info['flags']) or 'none of interest'}"
            f"{cap}")


def sparkserve_kernels() -> str:
    """Which sparkserve kernels ran: the int8 variant this CPU picked (the benchmarks run the
    default --activation-quant int8, as llama.cpp quantizes its activations), the native step and the
    decode / prefill attention's variants, or that the C++ kernels are unavailable; and the KV pool's dtype
    (the GGUF default float16, llama.cpp's own default cache type). Shared by decode.py and serving.py."""
    from sparkserve import kernels
    if not kernels.available():
        return "unavailable (torch fallback)"
    ext = kernels.load_extension()
    prefill = ext.prefill_attention_variant() or "none (SDPA)"
    return (f"C++, int8 activations on {kernels.variant()}, native decode step, decode attention on "
            f"{ext.decode_attention_variants()[0]}, prefill attention on {prefill}, float16 KV pool")
