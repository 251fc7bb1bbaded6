// Vector operations on zmm registers (16 fp32 lanes) for the attention tiles written once over a
// vector type (prefill_tile.h, decode_tile.h). Plain intrinsics only: the units that include it
// are compiled with their own ISA flags (-mavx512f -mavx512bw -mavx512vl, build.py ISA_UNITS).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace sparkserve {

struct Zmm {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_load_ps(p); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static I load_int(const int32_t* p) { return _mm512_load_si512(p); }
  // Sixteen float16 (kv_type 1) or bfloat16 values as fp32 (exactly).
  static F load_half(const uint16_t* p, int kv_type) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (kv_type == 1) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  // Sixteen int8 / fp8 values as fp32, as Ymm's.
  static F load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_fp8(const uint8_t* p, bool e4m3) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = e4m3 ? _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                                             _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8))
                           : _mm256_slli_epi16(w, 8);
    return _mm512_cvtph_ps(h);
  }
  // s where key j is among the row's keys (j < end, j >= end - window), else -inf.
  static F hide_unseen(F s, int32_t j, I end, int32_t window) {
    const I jv = _mm512_set1_epi32(j);
    __mmask16 seen = _mm512_cmplt_epi32_mask(jv, end);
    if (window > 0) seen &= _mm512_cmpge_epi32_mask(jv, _mm512_sub_epi32(end, _mm512_set1_epi32(window)));
    return _mm512_mask_blend_ps(seen, _mm512_set1_ps(-__builtin_inff()), s);
  }
  static F zero_if_neg_inf(F x) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ), x, zero());
  }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  // The four sums of a0..a3 (each folded to 8 lanes, then Ymm's hadd tree).
  static __m128 sum4(F a0, F a1, F a2, F a3) {
    const auto fold = [](F a) {
      return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    };
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(fold(a0), fold(a1)), _mm256_hadd_ps(fold(a2), fold(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
  static bool differ(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ) != 0; }
  // exp(x) for x <= 0: simd.h's exp256 on 16 lanes (Cephes' expf), and exactly 0 below -87.
  static F exp(F x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const F n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    static constexpr float kPoly[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                                      5.0000001201e-1f};
    F y = _mm512_set1_ps(1.9875691500e-4f);
    for (float c : kPoly) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const I e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(e));
  }
};


}  // namespace sparkserve
