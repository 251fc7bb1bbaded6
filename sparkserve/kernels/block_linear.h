// The block-weight linear kernel as a C++ entry point, for the kernels that call it without
// going through Python (the native forward step) and for the Python binding (quant_linear).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace sparkserve {

// Bytes per 32 weights of a block type (Q4_0, Q4_1, Q8_0, Q6_S, BF16, F16; a packed type as its own).
int block_bytes_of(int qtype);

// y[M, N] = x[M, K] @ W.T (+ bias[N]): W is N rows of K/32 blocks of `qtype`, x and y are
// contiguous fp32. Output rows are split over the kernels' thread pool.
void block_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int qtype,
                  const float* bias, float* y);

// As block_linear, with each x row quantized to int8 in blocks of 32 (scale amax/127, as llama.cpp's
// Q8_0/Q8_1 activations) and integer dot products against Q4_0 / Q4_1 / Q8_0 / Q6_S blocks (int32 inside a
// block, fp32 across blocks), on the best variant this CPU runs (int8_dispatch.cpp). BF16 / F16
// weights, or every variant switched off by SPARKSERVE_KERNEL_VARIANTS_OFF, take block_linear.
// `w` is the tensor of the blocks (uint8 [N, row bytes], contiguous): either packed already
// (a packed type, int8_common.h) or GGUF blocks, of which a variant reads a packed
// copy made on first use (int8_packed.h).
void block_linear_int8(const float* x, int64_t M, int64_t K, const at::Tensor& w, int64_t N, int qtype,
                       const float* bias, float* y);

// The int8 variant block_linear_int8 runs: "avx512vnni", "avxvnni", "avx2", or "fp32" (none).
const char* int8_variant();

// Whether the CPU runs the instructions of int8 variant `name` ("avx512": AVX-512 F/BW/VL) and
// SPARKSERVE_KERNEL_VARIANTS_OFF leaves that name on: other kernels built for the same ISA follow it.
bool isa_usable(const char* name);

}  // namespace sparkserve
