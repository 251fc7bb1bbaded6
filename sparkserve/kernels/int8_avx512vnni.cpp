// Int8 kernel, AVX-512 VNNI variant, on packed weights (int8_packed_zmm.h): 8 vpdpbusd per x row
// and block, the x bytes broadcast from memory. Built with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni (build.py); run only where the CPU has them (int8_dispatch.cpp).
#include "int8_packed_zmm.h"

namespace {

// acc += u8(w) . s8(4 bytes at p, broadcast to every lane). GCC 12 does not fold
// _mm512_set1_epi32(load) into the instruction's {1to16} memory broadcast, hence the asm.
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Two dependency chains of 4; Q8_0's quants are q + 128 and `start` undoes it.
struct VnniZmm {
  static void unpack_q8_0(__m512i raw, __m512i& w, __m512i&) { w = raw; }
  template <int QT>
  static __m512i block_dot(const __m512i w[16], const int8_t* xr, __m512i start) {
    __m512i a0 = start, a1 = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      a0 = dot4(a0, w[g], xr + 4 * g);
      a1 = dot4(a1, w[g + 4], xr + 16 + 4 * g);
    }
    return _mm512_add_epi32(a0, a1);
  }
  // half a Q6_S block: inputs 0..15 of w[0..3]
  static __m512i dot16(const __m512i w[4], const int8_t* xr, __m512i start) {
    __m512i a0 = start, a1 = _mm512_setzero_si512();
    for (int g = 0; g < 4; g += 2) {
      a0 = dot4(a0, w[g], xr + 4 * g);
      a1 = dot4(a1, w[g + 1], xr + 4 * g + 4);
    }
    return _mm512_add_epi32(a0, a1);
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avx512vnni_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1,
                            const float* bias, float* y, int64_t N) {
  packed_rows<VnniZmm>(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
