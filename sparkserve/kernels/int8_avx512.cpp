// Int8 kernel, AVX-512 variant for CPUs without VNNI (Skylake-SP/X), on packed weights
// (int8_packed_zmm.h). Built with -mavx512f -mavx512bw -mavx512vl (build.py); run only where the
// CPU has them (int8_dispatch.cpp).
#include "int8_packed_zmm.h"

namespace {

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// maddubs sums pairs of u8 * s8 in int16, so weights must be nibbles (at most 15: a pair is at
// most 2 * 15 * 127 and the eight of a block add up in int16 before one madd); a Q8_0 byte goes
// as 16 * high + low nibble. (AVX-512 has no byte sign instruction for MaddubsYmm's Q8_0 form.)
struct MaddubsZmm {
  static void unpack_q8_0(__m512i raw, __m512i& lo, __m512i& hi) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(raw, lo4);
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
  }
  template <int QT>
  static __m512i block_dot(const __m512i w[16], const int8_t* xr, __m512i start) {
    __m512i lo = _mm512_maddubs_epi16(w[0], bcast4(xr)), hi = _mm512_setzero_si512();
    if (!sparkserve::int8::nibble_type(QT)) hi = _mm512_maddubs_epi16(w[8], bcast4(xr));
    for (int g = 1; g < 8; ++g) {
      const __m512i x = bcast4(xr + 4 * g);
      lo = _mm512_add_epi16(lo, _mm512_maddubs_epi16(w[g], x));
      if (!sparkserve::int8::nibble_type(QT)) hi = _mm512_add_epi16(hi, _mm512_maddubs_epi16(w[8 + g], x));
    }
    __m512i p = _mm512_add_epi32(start, _mm512_madd_epi16(lo, _mm512_set1_epi16(1)));
    if (!sparkserve::int8::nibble_type(QT)) p = _mm512_add_epi32(p, _mm512_madd_epi16(hi, _mm512_set1_epi16(16)));
    return p;
  }
  // half a Q6_S block (u at most 63: two pairs add up in int16, then one madd)
  static __m512i dot16(const __m512i w[4], const int8_t* xr, __m512i start) {
    const __m512i ones = _mm512_set1_epi16(1);
    const auto pair = [&](int g) {   // inputs 4g..4g+7
      return _mm512_add_epi16(_mm512_maddubs_epi16(w[g], bcast4(xr + 4 * g)),
                              _mm512_maddubs_epi16(w[g + 1], bcast4(xr + 4 * g + 4)));
    };
    const __m512i s01 = pair(0), s23 = pair(2);
    return _mm512_add_epi32(start, _mm512_add_epi32(_mm512_madd_epi16(s01, ones), _mm512_madd_epi16(s23, ones)));
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avx512_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1,
                        const float* bias, float* y, int64_t N) {
  packed_rows<MaddubsZmm>(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
