// Vector operations on ymm registers (8 fp32 lanes), as vec_zmm.h for CPUs without AVX-512
// (the extension's baseline -mavx2 -mfma -mf16c).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace sparkserve {

struct Ymm {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  static F load(const float* p) { return _mm256_load_ps(p); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static I load_int(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  // Eight float16 (kv_type 1) or bfloat16 values as fp32 (exactly).
  static F load_half(const uint16_t* p, int kv_type) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (kv_type == 1) return _mm256_cvtph_ps(raw);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  // Eight int8 values as fp32 (a quantized pool's elements, before their block scale).
  static F load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // Eight fp8 values as fp32 through float16 bits: e5m2 is a float16's high byte; e4m3 (`e4m3`)
  // moved into float16's fields reads as its value / 256 (normal and subnormal alike), which the
  // caller's scale makes up for. Exact either way.
  static F load_fp8(const uint8_t* p, bool e4m3) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = e4m3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                          _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8))
                           : _mm_slli_epi16(w, 8);
    return _mm256_cvtph_ps(h);
  }
  // s where key j is among the row's keys (j < end, j >= end - window), else -inf.
  static F hide_unseen(F s, int32_t j, I end, int32_t window) {
    const I jv = _mm256_set1_epi32(j);
    I seen = _mm256_cmpgt_epi32(end, jv);
    if (window > 0) seen = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_sub_epi32(end, _mm256_set1_epi32(window)), jv), seen);
    return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), s, _mm256_castsi256_ps(seen));
  }
  static F zero_if_neg_inf(F x) {
    return _mm256_blendv_ps(x, zero(), _mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_EQ_OQ));
  }
  static float hsum(F v) { return sparkserve::hsum(v); }
  // The four sums of a0..a3.
  static __m128 sum4(F a0, F a1, F a2, F a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
  static bool differ(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_UQ)) != 0; }
  // exp(x) for x <= 0 (simd.h's exp256), exactly 0 below -87.
  static F exp(F x) {
    return _mm256_and_ps(sparkserve::exp256(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
  }
};


}  // namespace sparkserve
