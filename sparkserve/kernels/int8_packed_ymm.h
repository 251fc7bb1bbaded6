// The packed-weight kernel body of the ymm variants (int8_avx2.cpp, int8_avxvnni.cpp): the packed
// layout of int8_common.h read 8 output rows at a time (one half of each 64-byte chunk), so one
// ymm lane is one output row. `Isa::block_dot<QT>(w, xr, start)` sums one 32-input block per row
// in int32, from `start`, over the unpacked weight vectors (unpack_block, int8_common.h) and the x
// bytes at xr. x tiles of 8 rows go in two passes of 4, so weights and accumulators (nearly) fit
// the 16 registers. Internal linkage: each variant's copy is compiled with its own flags.
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
using sparkserve::int8::QuantX;

constexpr int kHalf = 8;          // output rows per ymm
constexpr int kPass = 4;          // x rows per pass

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// Rows [8h, 8h + 8) of one group against x rows [m1, m1 + MT) of one tile of mt rows.
template <class Isa, int QT, int MT>
inline void half_pass(const uint8_t* wg, int64_t nb, int h, const int8_t* xq, int64_t mt, int64_t m1,
                      const float* xd, const float* xs, const int32_t* xn, bool prefetch, __m256 acc[MT]) {
  constexpr int64_t GB = packed_record_bytes(QT);
  constexpr int QOFF = packed_quants_at(QT);
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = wg + blk * GB;
    if (prefetch && h == 0 && m1 == 0) sparkserve::int8::prefetch_record(rec + nb * GB, GB);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
    const __m256 mw = QT == kQ4_1
        ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + packed_m_at + 16 * h)))
        : _mm256_setzero_ps();
    __m256i w[16];
    sparkserve::int8::unpack_block<QT, Isa>(
        [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + QOFF + 64 * i + 32 * h)); },
        [&](__m256i v) { return _mm256_and_si256(v, lo4); },
        [&](__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4); }, w);
    const int8_t* xb = xq + blk * (mt * 32);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = blk * kTile + m1 + m;
      const __m256i start = _mm256_set1_epi32(dot_start<QT>(xn[i]));
      const __m256i p = Isa::template block_dot<QT>(w, xb + (m1 + m) * 32, start);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_set1_ps(xd[i])), acc[m]);
      if (QT == kQ4_1) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[i]), acc[m]);
    }
  }
}

// As half_pass for Q6_S (int8_packed_zmm.h's group_tile_q6, 8 rows at a time).
template <class Isa, int MT>
inline void half_pass_q6(const uint8_t* wg, int64_t nb, int h, const int8_t* xq, int64_t mt, int64_t m1,
                         const float* xd, const int32_t* ha, const int32_t* hb, bool prefetch, __m256 acc[MT]) {
  constexpr int64_t GB = packed_record_bytes(kQ6_S);
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = wg + blk * GB;
    if (prefetch && h == 0 && m1 == 0) sparkserve::int8::prefetch_record(rec + nb * GB, GB);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
    const uint8_t* sc = rec + sparkserve::int8::packed_sc_at + kHalf * h;
    const __m256i sca = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
    const __m256i scb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)));
    __m256i w[8];
    sparkserve::int8::unpack_q6<__m256i>(
        [&](int i) {
          return _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(rec + packed_quants_at(kQ6_S) + 64 * i + 32 * h));
        },
        [&](__m256i v) { return _mm256_and_si256(v, lo4); },
        [&](__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4); },
        [](__m256i v) { return _mm256_slli_epi16(v, 4); }, [](__m256i v) { return _mm256_slli_epi16(v, 2); },
        [](__m256i v) { return _mm256_srli_epi16(v, 2); },
        [&](__m256i w, __m256i v) { return _mm256_or_si256(w, _mm256_and_si256(v, bits45)); }, w);
    const int8_t* xb = xq + blk * (mt * 32);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = blk * kTile + m1 + m;
      const int8_t* xr = xb + (m1 + m) * 32;
      const __m256i pa = Isa::dot16(w, xr, _mm256_set1_epi32(ha[i]));
      const __m256i pb = Isa::dot16(w + 4, xr + 16, _mm256_set1_epi32(hb[i]));
      const __m256i p = _mm256_add_epi32(_mm256_mullo_epi32(pa, sca), _mm256_mullo_epi32(pb, scb));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_set1_ps(xd[i])), acc[m]);
    }
  }
}

template <class Isa, int QT, int MT>
void store_pass(const QuantX& q, const uint8_t* wp, int64_t n, int h, int64_t m0, int64_t mt, int64_t m1,
                const float* bias, float* y, int64_t N) {
  constexpr int64_t GB = packed_record_bytes(QT);
  const int64_t nb = q.K / 32, row0 = n + kHalf * h;
  const uint8_t* wg = wp + n / kGroupRows * nb * GB;
  __m256 acc[MT];
  const bool prefetch = q.M >= sparkserve::int8::kPrefetchMinRows;
  const int8_t* xq = q.qs + m0 * q.K;
  if constexpr (QT == kQ6_S)
    half_pass_q6<Isa, MT>(wg, nb, h, xq, mt, m1, q.d + m0 * nb, q.ha + m0 * nb, q.hb + m0 * nb, prefetch, acc);
  else
    half_pass<Isa, QT, MT>(wg, nb, h, xq, mt, m1, q.d + m0 * nb, q.s + m0 * nb, q.xn + m0 * nb, prefetch, acc);
  const int64_t valid = N - row0 < kHalf ? N - row0 : kHalf;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 b = bias ? _mm256_maskload_ps(bias + row0, mask) : _mm256_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm256_maskstore_ps(y + (m0 + m1 + m) * N + row0, mask, _mm256_add_ps(acc[m], b));
}

template <class Isa, int QT>
void packed_rows_typed(const QuantX& q, const uint8_t* wp, int64_t n0, int64_t n1, const float* bias, float* y,
                       int64_t N) {
  for (int64_t n = n0; n < n1; n += kGroupRows)
    for (int h = 0; h < 2 && n + kHalf * h < N; ++h)
      for (int64_t m0 = 0; m0 < q.M; m0 += kTile) {
        const int64_t mt = q.M - m0 < kTile ? q.M - m0 : kTile;
        for (int64_t m1 = 0; m1 < mt; m1 += kPass) {
          switch (mt - m1 < kPass ? mt - m1 : kPass) {
            case 4: store_pass<Isa, QT, 4>(q, wp, n, h, m0, mt, m1, bias, y, N); break;
            case 3: store_pass<Isa, QT, 3>(q, wp, n, h, m0, mt, m1, bias, y, N); break;
            case 2: store_pass<Isa, QT, 2>(q, wp, n, h, m0, mt, m1, bias, y, N); break;
            default: store_pass<Isa, QT, 1>(q, wp, n, h, m0, mt, m1, bias, y, N); break;
          }
        }
      }
}

// The entry of a ymm variant (PackedRowsFn) for its Isa.
template <class Isa>
void packed_rows(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                 float* y, int64_t N) {
  sparkserve::int8::with_int8_type(
      qtype, [&](auto qt) { packed_rows_typed<Isa, decltype(qt)::value>(q, wp, n0, n1, bias, y, N); });
}

}  // namespace
