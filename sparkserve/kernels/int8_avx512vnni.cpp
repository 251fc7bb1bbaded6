// Int8 kernel, AVX-512 VNNI variant, on packed weights (int8_common.h): one zmm holds one 32-input
// block of 16 output rows, 4 inputs per int32 lane, so for each x row and block 8 vpdpbusd (the x
// bytes broadcast from memory) sum the block in int32, and one convert + FMA scales it into 16
// output rows at once. The unpacked block is reused by every x row of a tile. Built with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni (build.py); run only where the CPU has them
// (int8_dispatch.cpp).
#include <immintrin.h>

#include <cstdint>

#include "int8_common.h"

namespace {

using sparkserve::int8::kGroupRows;
using sparkserve::int8::kTile;
using sparkserve::int8::packed_m_at;
using sparkserve::int8::packed_quants_at;
using sparkserve::int8::packed_record_bytes;
using sparkserve::int8::QuantX;

constexpr int kQ4_1 = 3;

// acc += u8(w) . s8(4 bytes at p, broadcast to every lane). GCC 12 does not fold
// _mm512_set1_epi32(load) into the instruction's {1to16} memory broadcast, hence the asm.
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One group of 16 output rows against the MT rows of one x tile: acc[m] lane r = y[m][row r].
template <int QT, int MT>
inline void group_tile(const uint8_t* wg, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                       const int32_t* xn, __m512 acc[MT]) {
  constexpr int64_t GB = packed_record_bytes(QT);
  constexpr int QOFF = packed_quants_at(QT);
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = wg + blk * GB;
    for (int o = 0; o < GB; o += 64)     // the same block of the next group
      _mm_prefetch(reinterpret_cast<const char*>(rec + nb * GB + o), _MM_HINT_T0);
    const __m512 dw = halves(rec);
    __m512 mw = _mm512_setzero_ps();
    __m512i w[8];
    if (QT == kQ4_1) {
      mw = halves(rec + packed_m_at);
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512(rec + QOFF + 64 * i);
        w[i] = _mm512_and_si512(raw, lo4);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
      }
    } else {
      for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(rec + QOFF + 64 * i);
    }
    const int8_t* xb = xq + blk * (MT * 32);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xr = xb + m * 32;
      const int64_t i = blk * kTile + m;
      // two dependency chains of 4; Q8_0 starts at -128 * sum(q_x) to undo the weights' +128
      __m512i a0 = QT == kQ4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(xn[i]);
      __m512i a1 = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        a0 = dot4(a0, w[g], xr + 4 * g);
        a1 = dot4(a1, w[g + 4], xr + 16 + 4 * g);
      }
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), _mm512_mul_ps(dw, _mm512_set1_ps(xd[i])),
                               acc[m]);
      if (QT == kQ4_1) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[i]), acc[m]);
    }
  }
}

template <int QT, int MT>
void tile_rows(const QuantX& q, int64_t m0, const uint8_t* wp, int64_t n, const float* bias, float* y,
               int64_t N) {
  constexpr int64_t GB = packed_record_bytes(QT);
  const int64_t nb = q.K / 32;
  __m512 acc[MT];
  // m0 is a multiple of kTile: the tile's scales start at m0 * nb
  group_tile<QT, MT>(wp + n / kGroupRows * nb * GB, nb, q.qs + m0 * q.K, q.d + m0 * nb, q.s + m0 * nb,
                     q.xn + m0 * nb, acc);
  const int64_t valid = N - n < kGroupRows ? N - n : kGroupRows;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n, mask, _mm512_add_ps(acc[m], b));
}

template <int QT>
void rows_typed(const QuantX& q, const uint8_t* wp, int64_t n0, int64_t n1, const float* bias, float* y,
                int64_t N) {
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    for (int64_t m0 = 0; m0 < q.M; m0 += kTile) {
      switch (q.M - m0 < kTile ? q.M - m0 : kTile) {
        case 8: tile_rows<QT, 8>(q, m0, wp, n, bias, y, N); break;
        case 7: tile_rows<QT, 7>(q, m0, wp, n, bias, y, N); break;
        case 6: tile_rows<QT, 6>(q, m0, wp, n, bias, y, N); break;
        case 5: tile_rows<QT, 5>(q, m0, wp, n, bias, y, N); break;
        case 4: tile_rows<QT, 4>(q, m0, wp, n, bias, y, N); break;
        case 3: tile_rows<QT, 3>(q, m0, wp, n, bias, y, N); break;
        case 2: tile_rows<QT, 2>(q, m0, wp, n, bias, y, N); break;
        default: tile_rows<QT, 1>(q, m0, wp, n, bias, y, N); break;
      }
    }
  }
}

}  // namespace

namespace sparkserve::int8 {

void rows_avx512vnni_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1,
                            const float* bias, float* y, int64_t N) {
  if (qtype == kQ4_1) rows_typed<3>(q, wp, n0, n1, bias, y, N);
  else rows_typed<8>(q, wp, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
