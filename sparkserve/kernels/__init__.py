"""C++ CPU kernels for batch-1 / small-batch inference.

`quant_linear(x, w, bias)` computes `x @ W.T (+ bias)` in fp32 from a `BlockWeight` (Q4_0, Q4_1,
Q8_0, Q6_S, BF16, F16), reading the blocks once for all rows of x (quant_gemv.cpp; used by layers/linear.py).
`quant_linear_int8` does the same with x quantized to int8 per block of 32 and integer dot products
for Q4_0 / Q4_1 / Q8_0 / Q6_S (int8_*.cpp), on the CPU variant `variant()` names (chosen at load by the CPU's
flags; SPARKSERVE_KERNEL_VARIANTS_OFF=amx,avx512vnni,avx512,avxvnni switches variants off).
The extension also has `rms_norm` and `add_rms_norm` (rms_norm.cpp; used by layers/norm.py) and
`decode_attention` (decode_attention.cpp: paged attention without the K/V gather, in zmm or ymm;
layers/attention.py),
`prefill_attention` (prefill_attention.cpp: the same for prefill chunks, in zmm or ymm tiles; both
score an int8 pool with VNNI integer dot products where the CPU has AVX-512 VNNI)
and `argmax_rows` / `sample_rows` / `logprob_rows` (argmax.cpp, sample.cpp: the sampler's draws
and logprobs on CPU).
Built on first use (build.py); when that is impossible `load_extension()` is None and callers
use their torch path (F.linear / oneDNN on the fp32 weight, F.rms_norm)."""
from __future__ import annotations

import torch

from sparkserve.kernels.blocks import BF16, BLOCK_BYTES, F16, INT8_TYPES, Q4_0, Q4_1, Q6_S, Q8_0, BlockWeight
from sparkserve.kernels.build import load_extension

__all__ = ["BlockWeight", "Q4_0", "Q4_1", "Q8_0", "Q6_S", "BF16", "F16", "BLOCK_BYTES", "INT8_TYPES",
           "available", "load_extension", "quant_linear", "quant_linear_int8", "dequantize_rows", "variant",
           "runnable_variants", "int8_beats_gemm", "argmax_rows", "sample_rows", "logprob_rows"]


def available() -> bool:
    return load_extension() is not None


def quant_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32. Raises if the kernels are unavailable."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("sparkserve kernels are unavailable (see the warning logged at first use)")
    return ext.quant_linear(x, w.blocks, w.qtype, bias)


def quant_linear_int8(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None,
                      variant: str = "") -> torch.Tensor:
    """As quant_linear, with int8 activations for INT8_TYPES (BF16 / F16 stay fp32). `variant`
    names one to use instead of the dispatcher's choice (it must run on this CPU)."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("sparkserve kernels are unavailable (see the warning logged at first use)")
    return ext.quant_linear_int8(x, w.blocks, w.qtype, bias, variant)


def dequantize_rows(w: BlockWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (1-D int64) of `w` as fp32 [len(ids), K], the values `w.dequantize()` has; on the
    calling thread (no torch thread pool) where the kernels are built."""
    ext = load_extension()
    if ext is None:
        return w.rows(ids).dequantize()
    return ext.dequantize_rows(w.blocks, w.qtype, w.in_features, ids)


def _rows_extension(x: torch.Tensor):
    """The extension where x is what its row kernels read (CPU float32 [N, V > 0], rows
    contiguous), else None."""
    readable = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1
    return load_extension() if readable and x.shape[-1] else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [N, V] (the first maximum; a NaN's first where a row has one). CPU
    float32 rows run on the kernels' threads: torch's argmax is several times slower, and its
    OpenMP region leaves threads awake beside the next native step."""
    ext = _rows_extension(x)
    return x.argmax(-1) if ext is None else ext.argmax_rows(x)


def sample_rows(logits: torch.Tensor, rows: list[int], temperature: list[float], top_k: list[int],
                top_p: list[float], min_p: list[float], u: torch.Tensor) -> torch.Tensor | None:
    """One id per listed row of logits [N, V], drawn at u [len(rows)] (float64 in [0, 1)) from the
    distribution executor/sampler.py's processed_probs gives each row's temperature (> 0), top_k,
    top_p and min_p: the first id in id order whose cumulative mass exceeds u times the total.
    None where the kernels cannot take the logits (another device, dtype or layout)."""
    ext = _rows_extension(logits)
    if ext is None:
        return None
    return ext.sample_rows(logits, rows, temperature, top_k, top_p, min_p, u.tolist())


def logprob_rows(logits: torch.Tensor, rows: list[int], ids: list[int],
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per listed row of logits [N, V]: log_softmax at ids[j], and the k best values and their ids
    (best first; ties by id). None where the kernels cannot take the logits."""
    ext = _rows_extension(logits)
    return None if ext is None else ext.logprob_rows(logits, rows, ids, k)


def variant() -> str:
    """The int8 kernel variant that runs: "avx512vnni", "amx", "avx512", "avxvnni", "avx2", or "fp32" when
    the kernels are unavailable or every variant is switched off (then int8 requests compute in fp32)."""
    ext = load_extension()
    return "fp32" if ext is None else ext.int8_variant()


def int8_beats_gemm() -> bool:
    """Whether the int8 variant in use is faster than oneDNN's fp32 GEMM at prefill sizes too, so
    int8 layers send it every row count. It is wherever oneDNN computes with vectors no wider
    than the kernel's (docs/kernel-notes.md): the AVX-512 kernels, AMX's among them, always (about 0.25-0.6x
    oneDNN's time at 128-512 rows, with or without VNNI), the ymm variants on CPUs without
    AVX-512 (about 0.5-0.65x AVX2 oneDNN's), but not against AVX-512 oneDNN (1-1.3x its time)."""
    v = variant()
    ymm_onednn = torch.backends.cpu.get_cpu_capability() != "AVX512"
    return v in ("amx", "avx512vnni", "avx512") or (v in ("avxvnni", "avx2") and ymm_onednn)


def runnable_variants(test_only: bool = False) -> list[str]:
    """The int8 variants built here that this CPU runs, best first (ignoring the env switch).
    test_only: instead the ones the dispatcher never picks, which quant_linear_int8 runs by name:
    "amx_emulated" (the AMX kernel on software tiles, for CPUs without AMX) and "avxvnni_evex" (the
    AVX-VNNI kernel on AVX-512 VNNI's dpbusd, for CPUs without AVX-VNNI)."""
    ext = load_extension()
    return [] if ext is None else list(ext.int8_variants_runnable(test_only))
