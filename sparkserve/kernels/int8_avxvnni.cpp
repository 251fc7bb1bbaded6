// Int8 kernel, AVX-VNNI variant, on packed weights (int8_packed_ymm.h): dpbusd sums 4 u8*s8
// products per int32 lane in one instruction. Built with -mavx2 -mfma -mf16c -mavxvnni
// (build.py); run only where the CPU has avx_vnni (int8_dispatch.cpp).
#include "int8_packed_ymm.h"

namespace {

// On packed weights: dpbusd in two chains of 4; Q8_0's quants are q + 128 and `start` undoes it.
struct PackedIsa {
  static void unpack_q8_0(__m256i raw, __m256i& w, __m256i&) { w = raw; }
  template <int QT>
  static __m256i block_dot(const __m256i w[16], const int8_t* xr, __m256i start) {
    __m256i a0 = start, a1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      a0 = _mm256_dpbusd_avx_epi32(a0, w[g], bcast4(xr + 4 * g));
      a1 = _mm256_dpbusd_avx_epi32(a1, w[g + 4], bcast4(xr + 4 * (g + 4)));
    }
    return _mm256_add_epi32(a0, a1);
  }
  // half a Q6_S block: inputs 0..15 of w[0..3]
  static __m256i dot16(const __m256i w[4], const int8_t* xr, __m256i start) {
    __m256i a0 = start, a1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; g += 2) {
      a0 = _mm256_dpbusd_avx_epi32(a0, w[g], bcast4(xr + 4 * g));
      a1 = _mm256_dpbusd_avx_epi32(a1, w[g + 1], bcast4(xr + 4 * g + 4));
    }
    return _mm256_add_epi32(a0, a1);
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avxvnni_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                         float* y, int64_t N) {
  packed_rows<PackedIsa>(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
