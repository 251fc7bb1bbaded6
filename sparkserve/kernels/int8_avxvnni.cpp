// Int8 kernel, AVX-VNNI variant: dpbusd sums 4 u8*s8 products per int32 lane in one instruction
// (no int16 step). Built with -mavx2 -mfma -mf16c -mavxvnni (build.py); run only where the CPU
// has avx_vnni (int8_dispatch.cpp).
#include "int8_kernel.h"
#include "int8_packed_ymm.h"

namespace {

struct Isa {
  static constexpr int R = 1;
  using I = __m256i;
  using F = __m256;
  struct W {
    __m256i u;   // unsigned bytes: Q4_1 nibbles, or |w| of Q8_0
    __m256i s;   // Q8_0: w, whose sign goes onto x
  };
  static W prep_q4_1(const uint8_t* const* b) { return {q4_1_bytes(b[0]), _mm256_setzero_si256()}; }
  static W prep_q8_0(const uint8_t* const* b) {
    const __m256i w = q8_0_bytes(b[0]);
    return {_mm256_sign_epi8(w, w), w};
  }
  static I xload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I dot_q4_1(const W& w, I x) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w.u, x); }
  static I dot_q8_0(const W& w, I x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w.u, _mm256_sign_epi8(x, w.s));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F cvt(I p) { return _mm256_cvtepi32_ps(p); }
  static F wscale(const float* dw) { return _mm256_set1_ps(dw[0]); }
  static F bcast(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void hsums(F v, float* out) { out[0] = hsum8(v); }
};

// On packed weights: dpbusd in two chains of 4; Q8_0's quants are q + 128 and `start` undoes it.
struct PackedIsa {
  template <int QT>
  static __m256i block_dot(const __m256i w[8], const int8_t* xr, __m256i start) {
    __m256i a0 = start, a1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      a0 = _mm256_dpbusd_avx_epi32(a0, w[g], bcast4(xr + 4 * g));
      a1 = _mm256_dpbusd_avx_epi32(a1, w[g + 4], bcast4(xr + 4 * (g + 4)));
    }
    return _mm256_add_epi32(a0, a1);
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avxvnni_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                         float* y, int64_t N) {
  if (qtype == 3) packed_rows_typed<PackedIsa, 3>(q, wp, n0, n1, bias, y, N);
  else packed_rows_typed<PackedIsa, 8>(q, wp, n0, n1, bias, y, N);
}

void rows_avxvnni(const QuantX& q, const uint8_t* w, int64_t row_bytes, int qtype, int64_t n0, int64_t n1,
                  const float* bias, float* y, int64_t N) {
  rows_any<Isa>(q, w, row_bytes, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
