// The block-weight linear kernel as a C++ entry point, for the kernels that call it without
// going through Python (the native forward step) and for the Python binding (quant_linear).
#pragma once
#include <cstdint>

namespace sparkserve {

// Bytes per 32 weights of a GGUF block type (Q4_1, Q8_0, BF16, F16).
int block_bytes_of(int qtype);

// y[M, N] = x[M, K] @ W.T (+ bias[N]): W is N rows of K/32 blocks of `qtype`, x and y are
// contiguous fp32. Output rows are split over the kernels' thread pool.
void block_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int qtype,
                  const float* bias, float* y);

}  // namespace sparkserve
