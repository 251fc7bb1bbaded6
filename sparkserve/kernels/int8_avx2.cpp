// Int8 kernel, AVX2 variant, on packed weights (int8_packed_ymm.h, maddubs: MaddubsYmm), and the
// activation quantizer every variant uses. Built with -mavx2 -mfma -mf16c only (build.py).
#include "int8_packed_ymm.h"

namespace {

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

inline int32_t hsum_epi32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// The block dot without VNNI: maddubs sums pairs of u8 * s8 in int16. Q4_1's nibbles are at most
// 15, so a pair is at most 2 * 15 * 127 and the eight of a block add up in int16 before one madd.
// Q8_0 takes llama.cpp's form: |q| (at most 128) as the unsigned operand and q's sign moved onto
// x, one madd per maddubs; this signed dot needs no `start` (the +128 offset is gone).
struct MaddubsYmm {
  static void unpack_q8_0(__m256i raw, __m256i& abs_q, __m256i& q) {
    q = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
    abs_q = _mm256_abs_epi8(q);
  }
  template <int QT>
  static __m256i block_dot(const __m256i w[16], const int8_t* xr, __m256i start) {
    if (!sparkserve::int8::nibble_type(QT)) {
      __m256i a = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i p = _mm256_maddubs_epi16(w[g], _mm256_sign_epi8(bcast4(xr + 4 * g), w[8 + g]));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
      }
      return a;
    }
    __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xr));
    for (int g = 1; g < 8; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], bcast4(xr + 4 * g)));
    return _mm256_add_epi32(start, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
  // half a Q6_S block (u at most 63: two pairs add up in int16, then one madd)
  static __m256i dot16(const __m256i w[4], const int8_t* xr, __m256i start) {
    const __m256i ones = _mm256_set1_epi16(1);
    const auto pair = [&](int g) {   // inputs 4g..4g+7
      return _mm256_add_epi16(_mm256_maddubs_epi16(w[g], bcast4(xr + 4 * g)),
                              _mm256_maddubs_epi16(w[g + 1], bcast4(xr + 4 * g + 4)));
    };
    const __m256i s01 = pair(0), s23 = pair(2);
    return _mm256_add_epi32(start, _mm256_add_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones)));
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avx2_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                      float* y, int64_t N) {
  packed_rows<MaddubsYmm>(q, wp, qtype, n0, n1, bias, y, N);
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
    int32_t* ha = q.ha + t0 * nb;
    int32_t* hb = q.hb + t0 * nb;
    for (int64_t blk = 0; blk < nb; ++blk) {
      for (int64_t m = 0; m < kTile; ++m) {
        if (m >= mt) {
          d[blk * kTile + m] = s[blk * kTile + m] = 0.0f;
          xn[blk * kTile + m] = ha[blk * kTile + m] = hb[blk * kTile + m] = 0;
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
        const __m256i suma = _mm256_add_epi32(iv[0], iv[1]), sumb = _mm256_add_epi32(iv[2], iv[3]);
        const __m256i b = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + (blk * mt + m) * 32), b);
        const int32_t ia = hsum_epi32(suma), ib = hsum_epi32(sumb), isum = ia + ib;
        d[blk * kTile + m] = dd;
        s[blk * kTile + m] = dd * static_cast<float>(isum);
        xn[blk * kTile + m] = -128 * isum;
        ha[blk * kTile + m] = -32 * ia;
        hb[blk * kTile + m] = -32 * ib;
      }
    }
  }
}

}  // namespace sparkserve::int8
