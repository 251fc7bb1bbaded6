// Int8 kernel, AVX2 variant, and the activation quantizer every variant uses. Built with -mavx2
// -mfma -mf16c only (build.py). Q4_1 runs on packed weights (int8_packed_ymm.h); Q8_0 reads the
// GGUF blocks as they are: its bytes would saturate maddubs in the packed layout's +128 form, so
// it keeps llama.cpp's trick of |w| as the unsigned operand with w's sign moved onto x.
#include <cstring>

#include "int8_packed_ymm.h"

namespace {

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Nibbles are at most 15, so a maddubs pair is at most 2 * 15 * 127 and the eight of a block add
// up in int16 before one madd.
struct PackedIsa {
  template <int QT>
  static __m256i block_dot(const __m256i w[8], const int8_t* xr, __m256i start) {
    static_assert(QT == 3, "the AVX2 packed kernel reads Q4_1 only");
    __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xr));
    for (int g = 1; g < 8; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], bcast4(xr + 4 * g)));
    return _mm256_add_epi32(start, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
};

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One output row (Q8_0 GGUF row `wr`, nb blocks of 34 bytes) against the MT rows of an x tile.
// Per block and x row: maddubs + madd sum 32 products into 8 int32 lanes, which are scaled by
// d_w * d_x and accumulated in fp32; the lanes are summed at the end.
template <int MT>
inline void q8_0_row(const uint8_t* wr, int64_t nb, const int8_t* xq, const float* xd, float out[MT]) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = wr + blk * 34;
    uint16_t h;
    std::memcpy(&h, b, 2);
    const __m256 dw = _mm256_set1_ps(_cvtsh_ss(h));
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m256i u = _mm256_sign_epi8(w, w);        // |w| (|w| <= 128: a pair fits int16)
    const int8_t* xb = xq + blk * (MT * 32);
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + m * 32));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(x, w)), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_set1_ps(xd[blk * kTile + m])),
                               acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum8(acc[m]);
}

template <int MT>
void q8_0_tile(const QuantX& q, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
               const float* bias, float* y, int64_t N) {
  const int64_t nb = q.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    float out[MT];
    q8_0_row<MT>(w + n * row_bytes, nb, q.qs + m0 * q.K, q.d + m0 * nb, out);
    const float b = bias ? bias[n] : 0.0f;
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n] = out[m] + b;
  }
}

}  // namespace

namespace sparkserve::int8 {

void rows_avx2_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                      float* y, int64_t N) {
  (void)qtype;   // Q4_1 (int8_dispatch.cpp sends Q8_0 to rows_avx2)
  packed_rows_typed<PackedIsa, 3>(q, wp, n0, n1, bias, y, N);
}

// Q8_0 only. Output rows go in groups of 16 that reuse each x tile while it is in L1.
void rows_avx2(const QuantX& q, const uint8_t* w, int64_t row_bytes, int qtype, int64_t n0, int64_t n1,
               const float* bias, float* y, int64_t N) {
  (void)qtype;
  for (int64_t g0 = n0; g0 < n1; g0 += 16) {
    const int64_t g1 = min64(n1, g0 + 16);
    for (int64_t m0 = 0; m0 < q.M; m0 += kTile) {
      switch (min64(kTile, q.M - m0)) {
        case 8: q8_0_tile<8>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        case 7: q8_0_tile<7>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        case 6: q8_0_tile<6>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        case 5: q8_0_tile<5>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        case 4: q8_0_tile<4>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        case 3: q8_0_tile<3>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        case 2: q8_0_tile<2>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
        default: q8_0_tile<1>(q, m0, w, row_bytes, g0, g1, bias, y, N); break;
      }
    }
  }
}

void quantize_rows(const float* x, int64_t m0, int64_t m1, const QuantX& q) {
  const int64_t K = q.K, nb = K / 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // undoes the packs' lane interleave
  for (int64_t t0 = m0; t0 < m1; t0 += kTile) {
    const int64_t mt = min64(kTile, q.M - t0);
    int8_t* qs = q.qs + t0 * K;
    float* d = q.d + t0 * nb;
    float* s = q.s + t0 * nb;
    int32_t* xn = q.xn + t0 * nb;
    for (int64_t blk = 0; blk < nb; ++blk) {
      for (int64_t m = 0; m < kTile; ++m) {
        if (m >= mt) {
          d[blk * kTile + m] = s[blk * kTile + m] = 0.0f;
          xn[blk * kTile + m] = 0;
          continue;
        }
        const float* xp = x + (t0 + m) * K + blk * 32;
        __m256 v[4];
        for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xp + 8 * j);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float dd = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m256i iv[4];
        for (int j = 0; j < 4; ++j) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));   // round to nearest even
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        const __m256i b = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + (blk * mt + m) * 32), b);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        const int32_t isum = _mm_cvtsi128_si32(t);
        d[blk * kTile + m] = dd;
        s[blk * kTile + m] = dd * static_cast<float>(isum);
        xn[blk * kTile + m] = -128 * isum;
      }
    }
  }
}

}  // namespace sparkserve::int8
