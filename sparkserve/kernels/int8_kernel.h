// The integer-dot kernel body shared by the CPU variants: int8_<variant>.cpp defines `struct Isa`
// (vector types and the few instructions that differ) and includes this file. Everything here has
// internal linkage, so each variant's copy is compiled with its own flags and stays its own.
//
// Per 32-weight block and x row: the 32 byte products are summed in int32 lanes (AVX2: maddubs +
// madd, VNNI: dpbusd), the lanes converted to fp32 and accumulated with the scale d_w * d_x; the
// Q4_1 offset m adds m * s_x (s_x = d_x * sum of the row's quantized block), accumulated for all
// rows of a tile at once. The weights need unsigned bytes: Q4_1 nibbles are; Q8_0 uses |w| with the
// sign moved onto x (llama.cpp's trick). Weights are read once per tile of up to kTile x rows while
// that tile's x stays in L1 across a group of output rows, so W is streamed once per call.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8_common.h"

namespace {

using sparkserve::int8::kTile;
using sparkserve::int8::QuantX;

constexpr int kQ4_1 = 3;
constexpr int64_t kGroup = 16;   // output rows that reuse one x tile while it is in L1

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles (low: elements 0..15, high: 16..31).
inline __m256i q4_1_bytes(const uint8_t* blk) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i lo = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo), _mm_and_si128(q, lo));
}
// Q8_0 block: fp16 d, 32 int8.
inline __m256i q8_0_bytes(const uint8_t* blk) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The MT rows of one x tile against Isa::R output rows (wrow[r]); out[m][r] without bias.
template <class Isa, int QT, int MT>
inline void dot_tile(const uint8_t* const wrow[Isa::R], int64_t nb, int bb, const int8_t* xq,
                     const float* xd, const float* xs, float out[MT][Isa::R]) {
  constexpr int R = Isa::R;
  typename Isa::F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = Isa::zero();
  __m256 accm[R];   // Q4_1: sum of m * s_x, lane = tile row
  for (int r = 0; r < R; ++r) accm[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b[R];
    float dw[R];
    __m128 dm[R];   // Q4_1: [d, m] in one conversion
    for (int r = 0; r < R; ++r) {
      b[r] = wrow[r] + blk * bb;
      if (QT == kQ4_1) {
        int32_t bits;
        std::memcpy(&bits, b[r], 4);
        dm[r] = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        dw[r] = _mm_cvtss_f32(dm[r]);
      } else {
        dw[r] = half_at(b[r]);
      }
    }
    const typename Isa::W w = QT == kQ4_1 ? Isa::prep_q4_1(b) : Isa::prep_q8_0(b);
    const typename Isa::F ws = Isa::wscale(dw);
    const int8_t* xb = xq + blk * (MT * 32);
    const float* db = xd + blk * kTile;
    for (int m = 0; m < MT; ++m) {
      const typename Isa::I x = Isa::xload(xb + m * 32);
      const typename Isa::I p = QT == kQ4_1 ? Isa::dot_q4_1(w, x) : Isa::dot_q8_0(w, x);
      acc[m] = Isa::fma(Isa::cvt(p), Isa::mul(ws, Isa::bcast(db[m])), acc[m]);
    }
    if (QT == kQ4_1) {
      const __m256 s = _mm256_loadu_ps(xs + blk * kTile);
      for (int r = 0; r < R; ++r)
        accm[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm[r])), s, accm[r]);
    }
  }
  alignas(32) float ms[R][8];
  for (int r = 0; r < R; ++r) _mm256_store_ps(ms[r], accm[r]);
  for (int m = 0; m < MT; ++m) {
    Isa::hsums(acc[m], out[m]);
    if (QT == kQ4_1)
      for (int r = 0; r < R; ++r) out[m][r] += ms[r][m];
  }
}

// Output rows [g0, g1) for the tile of x rows [m0, m0 + MT).
template <class Isa, int QT, int MT>
void group_tile(const QuantX& q, int64_t m0, const uint8_t* w, int64_t row_bytes, int bb, int64_t g0,
                int64_t g1, const float* bias, float* y, int64_t N) {
  constexpr int R = Isa::R;
  const int64_t nb = q.K / 32;
  const int8_t* xq = q.qs + m0 * q.K;
  const float* xd = q.d + m0 * nb;   // m0 is a multiple of kTile: tile m0/kTile starts at m0*nb
  const float* xs = q.s + m0 * nb;
  for (int64_t n = g0; n < g1; n += R) {
    const uint8_t* wrow[R];
    for (int r = 0; r < R; ++r) wrow[r] = w + min64(n + r, g1 - 1) * row_bytes;  // past g1: not stored
    float out[MT][R];
    dot_tile<Isa, QT, MT>(wrow, nb, bb, xq, xd, xs, out);
    for (int r = 0; r < R && n + r < g1; ++r) {
      const float b = bias ? bias[n + r] : 0.0f;
      for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n + r] = out[m][r] + b;
    }
  }
}

template <class Isa, int QT>
void rows_typed(const QuantX& q, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                const float* bias, float* y, int64_t N) {
  constexpr int bb = QT == kQ4_1 ? 20 : 34;
  for (int64_t g0 = n0; g0 < n1; g0 += kGroup) {
    const int64_t g1 = min64(n1, g0 + kGroup);
    for (int64_t m0 = 0; m0 < q.M; m0 += kTile) {
      switch (min64(kTile, q.M - m0)) {
        case 8: group_tile<Isa, QT, 8>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        case 7: group_tile<Isa, QT, 7>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        case 6: group_tile<Isa, QT, 6>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        case 5: group_tile<Isa, QT, 5>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        case 4: group_tile<Isa, QT, 4>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        case 3: group_tile<Isa, QT, 3>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        case 2: group_tile<Isa, QT, 2>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
        default: group_tile<Isa, QT, 1>(q, m0, w, row_bytes, bb, g0, g1, bias, y, N); break;
      }
    }
  }
}

template <class Isa>
void rows_any(const QuantX& q, const uint8_t* w, int64_t row_bytes, int qtype, int64_t n0, int64_t n1,
              const float* bias, float* y, int64_t N) {
  if (qtype == kQ4_1) rows_typed<Isa, 3>(q, w, row_bytes, n0, n1, bias, y, N);
  else rows_typed<Isa, 8>(q, w, row_bytes, n0, n1, bias, y, N);
}

}  // namespace
