// Int8 kernel, AVX-512 VNNI variant: one zmm holds a block of two output rows (low and high 256
// bits), each x block is broadcast to both halves, and dpbusd sums 4 u8*s8 products per int32
// lane. Built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (build.py); run only where the
// CPU has them (int8_dispatch.cpp).
#include "int8_kernel.h"

namespace {

inline __m512i two_rows(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

struct Isa {
  static constexpr int R = 2;
  using I = __m512i;
  using F = __m512;
  struct W {
    __m512i u;       // unsigned bytes: Q4_1 nibbles, or |w| of Q8_0
    __mmask64 neg;   // Q8_0: bytes where w < 0 (x is negated there)
  };
  static W prep_q4_1(const uint8_t* const* b) { return {two_rows(q4_1_bytes(b[0]), q4_1_bytes(b[1])), 0}; }
  static W prep_q8_0(const uint8_t* const* b) {
    const __m512i w = two_rows(q8_0_bytes(b[0]), q8_0_bytes(b[1]));
    return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
  }
  static I xload(const int8_t* p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I dot_q4_1(const W& w, I x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.u, x); }
  static I dot_q8_0(const W& w, I x) {
    const __m512i sx = _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.u, sx);
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F cvt(I p) { return _mm512_cvtepi32_ps(p); }
  static F wscale(const float* dw) {
    const __m256d lo = _mm256_castps_pd(_mm256_set1_ps(dw[0])), hi = _mm256_castps_pd(_mm256_set1_ps(dw[1]));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
  }
  static F bcast(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void hsums(F v, float* out) {
    out[0] = hsum8(_mm512_castps512_ps256(v));
    out[1] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avx512vnni(const QuantX& q, const uint8_t* w, int64_t row_bytes, int qtype, int64_t n0, int64_t n1,
                     const float* bias, float* y, int64_t N) {
  rows_any<Isa>(q, w, row_bytes, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
