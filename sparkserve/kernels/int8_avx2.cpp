// Int8 kernel, AVX2 variant (maddubs + madd), and the activation quantizer every variant uses.
// Built with -mavx2 -mfma -mf16c only (build.py).
#include "int8_kernel.h"
#include "int8_packed_ymm.h"

namespace {

struct Isa {
  static constexpr int R = 1;   // output rows per vector
  using I = __m256i;
  using F = __m256;
  struct W {
    __m256i u;   // unsigned bytes: Q4_1 nibbles, or |w| of Q8_0
    __m256i s;   // Q8_0: w, whose sign goes onto x
  };
  static W prep_q4_1(const uint8_t* const* b) { return {q4_1_bytes(b[0]), _mm256_setzero_si256()}; }
  static W prep_q8_0(const uint8_t* const* b) {
    const __m256i w = q8_0_bytes(b[0]);
    return {_mm256_sign_epi8(w, w), w};
  }
  static I xload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // Pairs of u8*s8 products fit int16 (|w| <= 128, |x| <= 127), then pairs of those in int32.
  static I dot_q4_1(const W& w, I x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, x), _mm256_set1_epi16(1));
  }
  static I dot_q8_0(const W& w, I x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, _mm256_sign_epi8(x, w.s)), _mm256_set1_epi16(1));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F cvt(I p) { return _mm256_cvtepi32_ps(p); }
  static F wscale(const float* dw) { return _mm256_set1_ps(dw[0]); }
  static F bcast(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void hsums(F v, float* out) { out[0] = hsum8(v); }
};

// On packed Q4_1 weights: nibbles are at most 15, so a maddubs pair is at most 2 * 15 * 127 and
// the eight of a block add up in int16 before one madd. (Q8_0's bytes would saturate maddubs:
// it stays on the GGUF-layout kernel above.)
struct PackedIsa {
  template <int QT>
  static __m256i block_dot(const __m256i w[8], const int8_t* xr, __m256i start) {
    static_assert(QT == 3, "the AVX2 packed kernel reads Q4_1 only");
    __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xr));
    for (int g = 1; g < 8; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], bcast4(xr + 4 * g)));
    return _mm256_add_epi32(start, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
};

}  // namespace

namespace sparkserve::int8 {

void rows_avx2_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                      float* y, int64_t N) {
  (void)qtype;   // Q4_1 (int8_dispatch.cpp sends Q8_0 to rows_avx2)
  packed_rows_typed<PackedIsa, 3>(q, wp, n0, n1, bias, y, N);
}

void rows_avx2(const QuantX& q, const uint8_t* w, int64_t row_bytes, int qtype, int64_t n0, int64_t n1,
               const float* bias, float* y, int64_t N) {
  rows_any<Isa>(q, w, row_bytes, qtype, n0, n1, bias, y, N);
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
