// The AVX-VNNI int8 kernel body on packed weights (int8_packed_ymm.h): dpbusd sums 4 u8*s8
// products per int32 lane in one instruction. int8_avxvnni.cpp builds it with AVX-VNNI's VEX dpbusd;
// int8_avxvnni_evex.cpp with AVX-512 VNNI's EVEX dpbusd at ymm width (the same result), so tests run
// this code on CPUs that have AVX-512 VNNI but not AVX-VNNI.
#pragma once

#ifdef SPARKSERVE_AVXVNNI_EVEX
#define SPARKSERVE_DPBUSD _mm256_dpbusd_epi32
#else
#define SPARKSERVE_DPBUSD _mm256_dpbusd_avx_epi32
#endif

#include "int8_packed_ymm.h"

namespace {

// On packed weights: dpbusd in two chains of 4; Q8_0's quants are q + 128 and `start` undoes it.
struct PackedIsa {
  static void unpack_q8_0(__m256i raw, __m256i& w, __m256i&) { w = raw; }
  template <int QT>
  static __m256i block_dot(const __m256i w[16], const int8_t* xr, __m256i start) {
    __m256i a0 = start, a1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      a0 = SPARKSERVE_DPBUSD(a0, w[g], bcast4(xr + 4 * g));
      a1 = SPARKSERVE_DPBUSD(a1, w[g + 4], bcast4(xr + 4 * (g + 4)));
    }
    return _mm256_add_epi32(a0, a1);
  }
  // half a Q6_S block: inputs 0..15 of w[0..3]
  static __m256i dot16(const __m256i w[4], const int8_t* xr, __m256i start) {
    __m256i a0 = start, a1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; g += 2) {
      a0 = SPARKSERVE_DPBUSD(a0, w[g], bcast4(xr + 4 * g));
      a1 = SPARKSERVE_DPBUSD(a1, w[g + 1], bcast4(xr + 4 * g + 4));
    }
    return _mm256_add_epi32(a0, a1);
  }
};

}  // namespace
