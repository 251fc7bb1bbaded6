// Packed weight copies for the int8 variants that read them (int8_packed.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace sparkserve::int8 {

// The packed copy of the Q4_0 / Q4_1 / Q8_0 / Q6_S blocks `w` ([N, K/32 blocks], contiguous), made on first use.
const uint8_t* packed_weights(const at::Tensor& w, int64_t N, int64_t K, int qtype);

// Output row n's block b of packed weights `wp` (K/32 = nb blocks a row) back in block order:
// the block's 18 (Q4_0), 20 (Q4_1), 34 (Q8_0) or 28 (Q6_S) bytes at `out`. qtype: the block type.
void gguf_block_of_packed(const uint8_t* wp, int64_t n, int64_t b, int64_t nb, int qtype, uint8_t* out);

// How many packed copies are held (tests: a copy goes at the next insert after its weights).
int64_t packed_weights_held();

}  // namespace sparkserve::int8
