// The packed-weight kernel body of the zmm variants (int8_avx512vnni.cpp, int8_avx512.cpp): one
// zmm holds one 32-input block of 16 output rows (the packed layout of int8_common.h), 4 inputs
// per int32 lane, so for each x row and block `Isa::block_dot<QT>(w, xr, start)` sums the block in
// int32 over the unpacked weight vectors (unpack_block) and the x bytes at xr, and one convert +
// FMA scales it into 16 output rows at once: no horizontal sums. The unpacked block is reused by
// every x row of a tile. Internal linkage: each variant's copy is compiled with its own flags.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "int8_common.h"

namespace {

using sparkserve::int8::dot_start;
using sparkserve::int8::kGroupRows;
using sparkserve::int8::kQ4_1;
using sparkserve::int8::kQ6_S;
using sparkserve::int8::kTile;
using sparkserve::int8::packed_m_at;
using sparkserve::int8::packed_quants_at;
using sparkserve::int8::packed_record_bytes;
using sparkserve::int8::packed_sc_at;
using sparkserve::int8::QuantX;

inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc + one block's int32 dot products p (16 output rows) times their scales: d_w d_x, and for
// Q4_1 the m_w s_x term. Every zmm kernel (and the AMX one) applies this one rule in this order,
// so a row's result is the same bit for bit whichever of them computes it.
template <int QT>
inline __m512 add_block(__m512 acc, __m512i p, __m512 dw, __m512 mw, float xd, float xs) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(xd)), acc);
  return QT == kQ4_1 ? _mm512_fmadd_ps(mw, _mm512_set1_ps(xs), acc) : acc;
}

// y[m0 + m][n, n + 16) = acc[m] + bias, for the output rows below N.
template <int MT>
inline void store_tile(const __m512 acc[MT], int64_t m0, int64_t n, const float* bias, float* y, int64_t N) {
  const int64_t valid = N - n < kGroupRows ? N - n : kGroupRows;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * N + n, mask, _mm512_add_ps(acc[m], b));
}

// One group of 16 output rows against the MT rows of one x tile: acc[m] lane r = y[m][row r].
template <class Isa, int QT, int MT>
inline void group_tile(const uint8_t* wg, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                       const int32_t* xn, bool prefetch, __m512 acc[MT]) {
  constexpr int64_t GB = packed_record_bytes(QT);
  constexpr int QOFF = packed_quants_at(QT);
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = wg + blk * GB;
    if (prefetch) sparkserve::int8::prefetch_record(rec + nb * GB, GB);
    const __m512 dw = halves(rec);
    const __m512 mw = QT == kQ4_1 ? halves(rec + packed_m_at) : _mm512_setzero_ps();
    __m512i w[16];
    sparkserve::int8::unpack_block<QT, Isa>(
        [&](int i) { return _mm512_loadu_si512(rec + QOFF + 64 * i); },
        [&](__m512i v) { return _mm512_and_si512(v, lo4); },
        [&](__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4); }, w);
    const int8_t* xb = xq + blk * (MT * 32);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = blk * kTile + m;
      const __m512i start = _mm512_set1_epi32(dot_start<QT>(xn[i]));
      acc[m] = add_block<QT>(acc[m], Isa::template block_dot<QT>(w, xb + m * 32, start), dw, mw, xd[i], xs[i]);
    }
  }
}

// As group_tile for Q6_S: each half of a block sums in int32 from its share of the +32 offset
// (`Isa::dot16`), and the halves' int8 scales join them, still in int32.
template <class Isa, int MT>
inline void group_tile_q6(const uint8_t* wg, int64_t nb, const int8_t* xq, const float* xd, const int32_t* ha,
                          const int32_t* hb, bool prefetch, __m512 acc[MT]) {
  constexpr int64_t GB = packed_record_bytes(kQ6_S);
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = wg + blk * GB;
    if (prefetch) sparkserve::int8::prefetch_record(rec + nb * GB, GB);
    const __m512 dw = halves(rec);
    const auto* sc = reinterpret_cast<const __m128i*>(rec + packed_sc_at);   // sc_a, then sc_b
    const __m512i sca = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc));
    const __m512i scb = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1));
    __m512i w[8];
    sparkserve::int8::unpack_q6<__m512i>(
        [&](int i) { return _mm512_loadu_si512(rec + packed_quants_at(kQ6_S) + 64 * i); },
        [&](__m512i v) { return _mm512_and_si512(v, lo4); },
        [&](__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4); },
        [](__m512i v) { return _mm512_slli_epi16(v, 4); }, [](__m512i v) { return _mm512_slli_epi16(v, 2); },
        [](__m512i v) { return _mm512_srli_epi16(v, 2); },
        [&](__m512i w, __m512i v) { return _mm512_ternarylogic_epi32(w, v, bits45, 0xF8); },   // w | (v & m)
        w);
    const int8_t* xb = xq + blk * (MT * 32);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = blk * kTile + m;
      const __m512i pa = Isa::dot16(w, xb + m * 32, _mm512_set1_epi32(ha[i]));
      const __m512i pb = Isa::dot16(w + 4, xb + m * 32 + 16, _mm512_set1_epi32(hb[i]));
      const __m512i p = _mm512_add_epi32(_mm512_mullo_epi32(pa, sca), _mm512_mullo_epi32(pb, scb));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(xd[i])), acc[m]);
    }
  }
}

template <class Isa, int QT, int MT>
void tile_rows(const QuantX& q, int64_t m0, const uint8_t* wp, int64_t n, const float* bias, float* y,
               int64_t N) {
  constexpr int64_t GB = packed_record_bytes(QT);
  const int64_t nb = q.K / 32;
  const uint8_t* wg = wp + n / kGroupRows * nb * GB;
  __m512 acc[MT];
  // m0 is a multiple of kTile: the tile's scales start at m0 * nb
  const bool prefetch = q.M >= sparkserve::int8::kPrefetchMinRows;
  const int8_t* xq = q.qs + m0 * q.K;
  if constexpr (QT == kQ6_S)
    group_tile_q6<Isa, MT>(wg, nb, xq, q.d + m0 * nb, q.ha + m0 * nb, q.hb + m0 * nb, prefetch, acc);
  else
    group_tile<Isa, QT, MT>(wg, nb, xq, q.d + m0 * nb, q.s + m0 * nb, q.xn + m0 * nb, prefetch, acc);
  store_tile<MT>(acc, m0, n, bias, y, N);
}

template <class Isa, int QT>
void packed_rows_typed(const QuantX& q, const uint8_t* wp, int64_t n0, int64_t n1, const float* bias, float* y,
                       int64_t N) {
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    for (int64_t m0 = 0; m0 < q.M; m0 += kTile) {
      switch (q.M - m0 < kTile ? q.M - m0 : kTile) {
        case 8: tile_rows<Isa, QT, 8>(q, m0, wp, n, bias, y, N); break;
        case 7: tile_rows<Isa, QT, 7>(q, m0, wp, n, bias, y, N); break;
        case 6: tile_rows<Isa, QT, 6>(q, m0, wp, n, bias, y, N); break;
        case 5: tile_rows<Isa, QT, 5>(q, m0, wp, n, bias, y, N); break;
        case 4: tile_rows<Isa, QT, 4>(q, m0, wp, n, bias, y, N); break;
        case 3: tile_rows<Isa, QT, 3>(q, m0, wp, n, bias, y, N); break;
        case 2: tile_rows<Isa, QT, 2>(q, m0, wp, n, bias, y, N); break;
        default: tile_rows<Isa, QT, 1>(q, m0, wp, n, bias, y, N); break;
      }
    }
  }
}

// The entry of a zmm variant (PackedRowsFn) for its Isa.
template <class Isa>
void packed_rows(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                 float* y, int64_t N) {
  sparkserve::int8::with_int8_type(
      qtype, [&](auto qt) { packed_rows_typed<Isa, decltype(qt)::value>(q, wp, n0, n1, bias, y, N); });
}

}  // namespace
