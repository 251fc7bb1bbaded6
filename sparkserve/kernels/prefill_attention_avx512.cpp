// One tile of the prefill attention on AVX-512 (prefill_attention.h): flash attention with the
// score matrix transposed, so that every step is a vertical vector operation. The tile's 48 query
// rows (its queries x the G heads of one kv head) lie across three zmm registers; a block of keys
// gives scores S[key][row] as 8 x 3 register tiles over the head dim (one broadcast key value times
// a row of transposed queries), the per-row max and sum are vector max / add down the keys, and
// P V adds each key's V row, times its 6-row group's probabilities, to outputs kept in L1.
// Blocks past every row's last key are never visited and only the blocks across a row's edge
// are masked, so a causal prompt costs half of the full product. Built with -mavx512f
// -mavx512bw -mavx512vl (build.py); run only where the CPU has them (prefill_attention.cpp).
#include <immintrin.h>

#include <cstdint>

#include "prefill_attention.h"

namespace {

using sparkserve::prefill::kBlockKeys;
using sparkserve::prefill::kTileRows;
using sparkserve::prefill::Tile;

inline int64_t lo_of(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t hi_of(int64_t a, int64_t b) { return a > b ? a : b; }

// exp(x) for x <= 0: simd.h's exp256 on 16 lanes (Cephes' expf), and exactly 0 below -87 (masked
// scores are -inf).
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  static constexpr float kPoly[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                    5.0000001201e-1f};
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : kPoly) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(e));
}

// Sixteen K/V elements as fp32 (exactly: every float16 and bfloat16 value is a float32 one).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p, int kv_type) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (kv_type == 1) return _mm512_cvtph_ps(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Keys j0 .. j0 + n - 1 of the tile's kv head as fp32 rows [kBlockKeys][D], zeros past n up to a
// multiple of 8 (the score tile's width).
void load_block(const Tile& t, const void* base, int64_t j0, int64_t n, float* dst) {
  const int64_t D = t.D;
  for (int64_t x = 0; x < n; ++x) {
    const int64_t row = (t.slots[j0 + x] * t.Hkv + t.h) * D;
    float* d = dst + x * D;
    if (t.kv_type == 0) {
      const float* s = static_cast<const float*>(base) + row;
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(d + c, load16(s + c));
    } else {
      const uint16_t* s = static_cast<const uint16_t*>(base) + row;
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(d + c, load16(s + c, t.kv_type));
    }
  }
  for (int64_t x = n; x < ((n + 7) & ~int64_t{7}); ++x)
    for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(dst + x * D + c, _mm512_setzero_ps());
}

// s[x][0 .. 48) = sum_d kb[x][d] qt[d][0 .. 48) for 8 keys: 24 accumulators.
inline void score_tile(const float* qt, const float* kb, int64_t D, float* s) {
  __m512 a[8][3];
  for (int x = 0; x < 8; ++x)
    for (int v = 0; v < 3; ++v) a[x][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* qd = qt + d * kTileRows;
    const __m512 q0 = _mm512_load_ps(qd), q1 = _mm512_load_ps(qd + 16), q2 = _mm512_load_ps(qd + 32);
    for (int x = 0; x < 8; ++x) {
      const __m512 k = _mm512_set1_ps(kb[x * D + d]);
      a[x][0] = _mm512_fmadd_ps(k, q0, a[x][0]);
      a[x][1] = _mm512_fmadd_ps(k, q1, a[x][1]);
      a[x][2] = _mm512_fmadd_ps(k, q2, a[x][2]);
    }
  }
  for (int x = 0; x < 8; ++x)
    for (int v = 0; v < 3; ++v) _mm512_store_ps(s + x * kTileRows + 16 * v, a[x][v]);
}

// o[r][c0 .. c0 + 16 NV) += sum_x p[x][r] vb[x][c0 ..] for the 6 rows r0 ..: 6 x NV accumulators.
template <int NV>
inline void pv_tile(const float* p, const float* vb, int64_t n, int64_t D, int64_t r0, int64_t c0, float* o) {
  __m512 acc[6][NV];
  for (int r = 0; r < 6; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_loadu_ps(o + (r0 + r) * D + c0 + 16 * i);
  for (int64_t x = 0; x < n; ++x) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = _mm512_loadu_ps(vb + x * D + c0 + 16 * i);
    for (int r = 0; r < 6; ++r) {
      const __m512 pr = _mm512_set1_ps(p[x * kTileRows + r0 + r]);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(pr, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < 6; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + (r0 + r) * D + c0 + 16 * i, acc[r][i]);
}

void pv(const float* p, const float* vb, int64_t n, int64_t D, float* o) {
  for (int64_t r0 = 0; r0 < kTileRows; r0 += 6) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) pv_tile<4>(p, vb, n, D, r0, c, o);
    switch ((D - c) / 16) {
      case 3: pv_tile<3>(p, vb, n, D, r0, c, o); break;
      case 2: pv_tile<2>(p, vb, n, D, r0, c, o); break;
      case 1: pv_tile<1>(p, vb, n, D, r0, c, o); break;
      default: break;
    }
  }
}

}  // namespace

namespace sparkserve::prefill {

void tile_avx512(const Tile& t) {
  const int64_t D = t.D, G = t.G, R = t.nq * G;
  float* qt = t.scratch;                      // [D][48], scaled
  float* o = qt + D * kTileRows;              // [48][D]
  float* s = o + kTileRows * D;               // [kBlockKeys][48]: scores, then probabilities
  float* kb = s + kBlockKeys * kTileRows;     // [kBlockKeys][D]
  float* vb = kb + kBlockKeys * D;
  float* alpha = vb + kBlockKeys * D;         // [48]
  for (int64_t r = 0; r < kTileRows; ++r) {
    const float* qr = t.q + (r / G) * t.q_query + (r % G) * t.q_head;
    for (int64_t d = 0; d < D; ++d) qt[d * kTileRows + r] = r < R ? qr[d] * t.scale : 0.f;
  }
  for (int64_t i = 0; i < kTileRows * D; i += 16) _mm512_storeu_ps(o + i, _mm512_setzero_ps());
  // each row's end (its keys are j < end, and j >= end - window; spare rows are never written)
  __m512i end[3];
  for (int v = 0; v < 3; ++v) {
    alignas(64) int32_t e[16];
    for (int x = 0; x < 16; ++x) e[x] = static_cast<int32_t>(t.end0 + (16 * v + x) / G);
    end[v] = _mm512_load_si512(e);
  }
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  __m512 m[3] = {neg_inf, neg_inf, neg_inf}, l[3];
  for (int v = 0; v < 3; ++v) l[v] = _mm512_setzero_ps();
  const int64_t last_end = t.end0 + t.nq - 1;
  const int64_t j_lo = t.window > 0 ? hi_of(0, t.end0 - t.window) : 0;
  for (int64_t j0 = j_lo; j0 < last_end; j0 += kBlockKeys) {
    const int64_t n = lo_of(kBlockKeys, last_end - j0), n8 = (n + 7) & ~int64_t{7};
    load_block(t, t.k, j0, n, kb);
    load_block(t, t.v, j0, n, vb);
    for (int64_t x = 0; x < n8; x += 8) score_tile(qt, kb + x * D, D, s + x * kTileRows);
    // only blocks across some row's first or last key need the mask
    if (j0 + n8 > t.end0 || (t.window > 0 && j0 < last_end - t.window)) {
      for (int64_t x = 0; x < n8; ++x) {
        const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(j0 + x));
        for (int v = 0; v < 3; ++v) {
          __mmask16 seen = _mm512_cmplt_epi32_mask(j, end[v]);
          if (t.window > 0)
            seen &= _mm512_cmpge_epi32_mask(j, _mm512_sub_epi32(end[v], _mm512_set1_epi32(
                                                   static_cast<int32_t>(t.window))));
          if (x >= n) seen = 0;
          float* sv = s + x * kTileRows + 16 * v;
          _mm512_store_ps(sv, _mm512_mask_blend_ps(seen, neg_inf, _mm512_load_ps(sv)));
        }
      }
    }
    // online softmax: new row maxima, the old sums and outputs rescaled to them
    bool moved = false;
    for (int v = 0; v < 3; ++v) {
      __m512 mx = m[v];
      for (int64_t x = 0; x < n8; ++x) mx = _mm512_max_ps(mx, _mm512_load_ps(s + x * kTileRows + 16 * v));
      // a row with no key yet keeps -inf; it subtracts 0 instead, so exp gives 0, not NaN
      const __m512 base = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ), mx,
                                               _mm512_setzero_ps());
      const __m512 a = exp512(_mm512_sub_ps(m[v], base));
      moved = moved || _mm512_cmp_ps_mask(mx, m[v], _CMP_NEQ_UQ) != 0;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t x = 0; x < n8; ++x) {
        float* sv = s + x * kTileRows + 16 * v;
        const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(sv), base));
        _mm512_store_ps(sv, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[v] = _mm512_fmadd_ps(l[v], a, sum);
      m[v] = mx;
      _mm512_store_ps(alpha + 16 * v, a);
    }
    if (moved)
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t c = 0; c < D; c += 16)
          _mm512_storeu_ps(o + r * D + c, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * D + c)));
      }
    pv(s, vb, n, D, o);
  }
  for (int v = 0; v < 3; ++v) _mm512_store_ps(alpha + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.f), l[v]));
  for (int64_t r = 0; r < R; ++r) {
    float* dst = t.out + (r / G) * t.out_query + (r % G) * t.out_head;
    const __m512 inv = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(dst + c, _mm512_mul_ps(inv, _mm512_loadu_ps(o + r * D + c)));
  }
}

}  // namespace sparkserve::prefill
