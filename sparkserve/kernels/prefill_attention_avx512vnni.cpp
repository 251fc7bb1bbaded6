// The prefill attention tile (prefill_tile.h) on zmm registers with an int8 pool's q . k scores as
// VNNI integer dot products; every other pool type takes the avx512 tile's float scores, and the
// softmax and P V are the avx512 tile's for all. Built with -mavx512vnni on top of avx512's flags
// (build.py ISA_UNITS); run only where the CPU has AVX-512 VNNI (prefill_attention.cpp).
//
// The query rounding is the decode kernel's (decode_attention_avx512vnni.cpp): each query row
// quantized to int8 per block of the keys' scales (scale amax / 127, half to even), so a row
// scores as it would in a decode step up to fp32 summation order (CP decode rows, long VERIFY
// blocks and extends over 16 tokens run here). The layout is the float tile's, transposed: the
// tile's 48 query rows lie across three registers as 4 bytes per row (dims d .. d + 3), a key's 4
// bytes at d are broadcast, and one vpdpbusd adds 4 products for 16 rows at once, so the scores
// come out as S[key][row] vectors for the tile's mask and online softmax. dpbusd multiplies
// unsigned by signed bytes: keys go in as k + 128 (a sign-bit flip), queries signed, and each
// row's int32 sum starts at -128 times the sum of its query bytes in the block, so it is exactly
// sum q8 * k8. Per block of the keys' scales the int32 sums become fp32 once, times the row's
// query scale (with the softmax scale folded in) and the key's block scale.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "prefill_tile.h"
#include "vec_zmm.h"

namespace {

struct PrefillZmm : sparkserve::Zmm {
  static constexpr int kKeys = 8, kPvRows = 6, kPvVecs = 4;
};

constexpr int64_t kRows = 3 * 16;      // the tile's query rows: three zmm of int32 / fp32 lanes
constexpr int kScoreKeys = 4;          // keys per register tile: 12 int32 sums and 12 fp32 scores

// The scores of a tile over an int8 pool (the Scores policy of attend_tile).
struct Int8Scores {
  int64_t D, qb, nb;
  int8_t* q8;        // [D / 4][kRows][4]: row r's query bytes d .. d + 3 at (d / 4 * kRows + r) * 4
  int32_t* bias;     // [nb][kRows]: -128 x the sum of the row's query bytes in the block
  float* qscale;     // [nb][kRows]: the row's block scale amax / 127 times the softmax scale
  uint8_t* kb;       // [kBlockKeys][D]: the block's key bytes + 128
  float* kscale;     // [kBlockKeys][nb]

  Int8Scores(const Tile& t, float*, float*) : D(t.D), qb(t.qb), nb(t.D / t.qb) {
    thread_local std::vector<int8_t> q_bytes;
    thread_local std::vector<int32_t> q_bias;
    thread_local std::vector<float> q_scale, k_scale;
    thread_local std::vector<uint8_t> k_bytes;
    thread_local std::vector<int8_t> row;
    q_bytes.assign(D * kRows, 0);
    q_bias.assign(nb * kRows, 0);
    q_scale.assign(nb * kRows, 0.f);
    k_bytes.resize(sparkserve::prefill::kBlockKeys * D);
    k_scale.resize(sparkserve::prefill::kBlockKeys * nb);
    row.resize(D);
    q8 = q_bytes.data(), bias = q_bias.data(), qscale = q_scale.data();
    kb = k_bytes.data(), kscale = k_scale.data();
    const int64_t rows = t.nq * t.G;
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = t.q + (r / t.G) * t.q_query + (r % t.G) * t.q_head;
      for (int64_t b = 0; b < nb; ++b) {
        __m512 amax = _mm512_setzero_ps();
        for (int64_t c = b * qb; c < (b + 1) * qb; c += 16)
          amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(q + c)));
        const float m = _mm512_reduce_max_ps(amax), inv = m > 0.f ? 127.f / m : 0.f;
        int32_t sum = 0;
        for (int64_t c = b * qb; c < (b + 1) * qb; c += 16) {
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c), _mm512_set1_ps(inv)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row.data() + c), _mm512_cvtsepi32_epi8(v));
          sum += _mm512_reduce_add_epi32(v);      // |v| <= 127: the saturation changes nothing
        }
        bias[b * kRows + r] = -128 * sum;
        qscale[b * kRows + r] = m / 127.f * t.scale;
      }
      for (int64_t d = 0; d < D; ++d) q8[(d / 4 * kRows + r) * 4 + d % 4] = row[d];
    }
  }

  // s[x][0 .. kRows) for the block's keys j0 .. j0 + n - 1; keys n .. n8 score 0 (masked later).
  void block(const Tile& t, int64_t j0, int64_t n, int64_t n8, float* s) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const __mmask64 tail = D % 64 == 0 ? ~__mmask64{0} : (__mmask64{1} << (D % 64)) - 1;
    const int8_t* keys = static_cast<const int8_t*>(t.k);
    for (int64_t x = 0; x < n8; ++x) {
      const int64_t at = x < n ? (t.slots[j0 + x] * t.Hkv + t.h) * D : -1;
      for (int64_t c = 0; c < D; c += 64) {
        const __mmask64 m = c + 64 <= D ? ~__mmask64{0} : tail;
        const __m512i k = at < 0 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi8(m, keys + at + c);
        _mm512_mask_storeu_epi8(kb + x * D + c, m, _mm512_xor_si512(k, flip));
      }
      for (int64_t b = 0; b < nb; ++b) kscale[x * nb + b] = at < 0 ? 0.f : _cvtsh_ss(t.k_scale[at / qb + b]);
    }
    for (int64_t x = 0; x < n8; x += kScoreKeys) scores4(x, s);
  }

  // Scores of keys x0 .. x0 + 3 of the block for all the tile's rows.
  void scores4(int64_t x0, float* s) const {
    __m512 f[kScoreKeys][3];
    for (auto& fx : f)
      for (__m512& v : fx) v = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i a[kScoreKeys][3];
      for (int v = 0; v < 3; ++v) {
        const __m512i start = _mm512_loadu_si512(bias + b * kRows + 16 * v);
        for (int x = 0; x < kScoreKeys; ++x) a[x][v] = start;
      }
      for (int64_t d = b * qb; d < (b + 1) * qb; d += 4) {
        const int8_t* qd = q8 + d * kRows;
        const __m512i q0 = _mm512_loadu_si512(qd), q1 = _mm512_loadu_si512(qd + 64),
                      q2 = _mm512_loadu_si512(qd + 128);
        for (int x = 0; x < kScoreKeys; ++x) {
          int32_t word;
          std::memcpy(&word, kb + (x0 + x) * D + d, 4);
          const __m512i k = _mm512_set1_epi32(word);
          a[x][0] = _mm512_dpbusd_epi32(a[x][0], k, q0);
          a[x][1] = _mm512_dpbusd_epi32(a[x][1], k, q1);
          a[x][2] = _mm512_dpbusd_epi32(a[x][2], k, q2);
        }
      }
      for (int v = 0; v < 3; ++v) {
        const __m512 qs = _mm512_loadu_ps(qscale + b * kRows + 16 * v);
        for (int x = 0; x < kScoreKeys; ++x)
          f[x][v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[x][v]), qs),
                                    _mm512_set1_ps(kscale[(x0 + x) * nb + b]), f[x][v]);
      }
    }
    for (int x = 0; x < kScoreKeys; ++x)
      for (int v = 0; v < 3; ++v) _mm512_storeu_ps(s + (x0 + x) * kRows + 16 * v, f[x][v]);
  }
};

}  // namespace

namespace sparkserve::prefill {

void tile_avx512vnni(const Tile& t) {
  if (t.kv_type == 3) return attend_tile<PrefillZmm, Int8Scores>(t);
  attend_tile<PrefillZmm>(t);
}

}  // namespace sparkserve::prefill
