// The decode attention's chunk kernels with the q . k scores of an int8 pool as VNNI integer dot
// products: the avx512 kernels (decode_tile.h on zmm) for every other pool type, for the softmax
// and for P V. Built with -mavx512vnni on top of avx512's flags (build.py ISA_UNITS); run only
// where the CPU has AVX-512 VNNI (decode_attention.cpp).
//
// The float path scales each int8 key to fp32 and multiplies it by the query in fp32: per key and
// 64 values, 4 widenings, 4 conversions, 4 scalings and an FMA per query row and 16 values. Here
// each query row is quantized once per chunk call (int8, one scale amax / 127 per block of the
// row the keys' scales cover, as llama.cpp quantizes its activations for a q8_0 dot product; one
// scale per head row moved SmolLM2's greedy tokens at near-ties several times more often, its
// queries having outlier channels), and a key's 64 bytes go into one
// vpdpbusd per query row (int32 sums of 4 products per lane). dpbusd multiplies unsigned by signed
// bytes: the keys go in as k + 128 (a sign-bit flip), the queries signed, and each lane's
// accumulator starts at -128 times the sum of its 4 query bytes, so the int32 sums are exactly
// sum q8 * k8. Each lane lies inside one of the key's scale blocks (32 values, or the whole row),
// so the sums convert to fp32 once per 64 values, times the lane's query and key block scales.
// The only rounding beyond the float path's is the query's to int8: |score error| <= sum over
// blocks of amax(q block) / 254 * sum |k| of the dequantized key block
// (tests/engine/test_kv_quant_vnni.py). A row's result still depends only on its query and keys
// (the quantization is per row), so a VERIFY row equals the decode step at its position bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_tile.h"
#include "vec_zmm.h"

namespace sparkserve::decode {

namespace {

// Query rows per register tile: 4 rows x 4 keys of fp32 accumulators, the 4 keys' bytes and their
// 4 lane-scale vectors leave 8 of the 32 zmm for the query, its bias and scales, and the products.
constexpr int kTileRows = 4;

// A query row as dpbusd takes it: int8 values in 64-byte chunks (zero past D), each lane's
// starting sum (-128 times the sum of its 4 bytes) and each lane's block scale (0 past D).
struct QuantQuery {
  const int8_t* q;
  const int32_t* bias;
  const float* lane_scale;
};

// Quantize R query rows of D values, blocks of qb, into `bytes` (R x Dp), `bias` and `scales`
// (R x Dp / 4 each).
void quantize_queries(const float* const* q, int64_t R, int64_t D, int64_t Dp, int64_t qb_len,
                      std::vector<int8_t>& bytes, std::vector<int32_t>& bias, std::vector<float>& scales,
                      std::vector<QuantQuery>& out) {
  bytes.assign(R * Dp, 0);
  bias.resize(R * Dp / 4);
  scales.assign(R * Dp / 4, 0.f);
  out.resize(R);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < R; ++r) {
    int8_t* qb = bytes.data() + r * Dp;
    float* ls = scales.data() + r * Dp / 4;
    for (int64_t b0 = 0; b0 < D; b0 += qb_len) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t c = b0; c < b0 + qb_len; c += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(q[r] + c)));
      const float m = _mm512_reduce_max_ps(amax);
      const float inv = m > 0.f ? 127.f / m : 0.f;
      std::fill(ls + b0 / 4, ls + (b0 + qb_len) / 4, m / 127.f);
      for (int64_t c = b0; c < b0 + qb_len; c += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q[r] + c), _mm512_set1_ps(inv)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + c), _mm512_cvtsepi32_epi8(v));
      }
    }
    int32_t* b = bias.data() + r * Dp / 4;
    for (int64_t c = 0; c < Dp; c += 64) {
      const __m512i qv = _mm512_loadu_si512(qb + c);
      _mm512_storeu_si512(b + c / 4, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                      _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, qv)));
    }
    out[r] = {qb, b, ls};
  }
}

// Scores of NR quantized query rows against the four int8 keys at element offsets k[0..4), whose
// fp32 block scales are ks[x][0 .. nb); `lane_block[c / 4 ..]` maps a chunk's 16 lanes to blocks.
template <int NR>
inline void qk_tile_vnni(const QuantQuery* q, const int8_t* kb, const int64_t* k, const float* const* ks,
                         int64_t nb, int64_t D, const int32_t* lane_block, float* s, int64_t ss, int64_t nk) {
  __m512 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < 4; ++x) a[r][x] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask16 scale_mask = static_cast<__mmask16>((1u << nb) - 1);
  __m512 scales[4];
  for (int x = 0; x < 4; ++x) scales[x] = _mm512_maskz_loadu_ps(scale_mask, ks[x]);
  for (int64_t c = 0; c < D; c += 64) {
    const int64_t left = D - c;
    const __mmask64 bytes = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    __m512i kv[4];
    __m512 lane_scale[4];
    for (int x = 0; x < 4; ++x) {
      // bytes past D load as 0 and flip to 128, against query bytes that are 0 there
      kv[x] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, kb + k[x] + c), flip);
      lane_scale[x] = _mm512_permutexvar_ps(_mm512_loadu_si512(lane_block + c / 4), scales[x]);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512i qv = _mm512_loadu_si512(q[r].q + c), bias = _mm512_loadu_si512(q[r].bias + c / 4);
      const __m512 qs = _mm512_loadu_ps(q[r].lane_scale + c / 4);
      for (int x = 0; x < 4; ++x)
        a[r][x] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias, kv[x], qv)), qs),
                                  lane_scale[x], a[r][x]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m128 v = Zmm::sum4(a[r][0], a[r][1], a[r][2], a[r][3]);
    alignas(16) float tmp[4];
    _mm_store_ps(tmp, v);
    for (int64_t x = 0; x < nk; ++x) s[r * ss + x] = tmp[x];
  }
}

void scores_vnni(const float* const* q, int64_t R, const int64_t* rows, int64_t n, const ChunkKV& kv, int64_t D,
                 float* s) {
  thread_local std::vector<int8_t> qbytes;
  thread_local std::vector<int32_t> qbias;
  thread_local std::vector<float> qscales;
  thread_local std::vector<QuantQuery> qq;
  thread_local std::vector<int32_t> lane_block;     // 16 per 64 values: each lane's scale block
  const int64_t Dp = (D + 63) / 64 * 64, qb = kv.qb, nb = D / qb;
  quantize_queries(q, R, D, Dp, qb, qbytes, qbias, qscales, qq);
  lane_block.resize(Dp / 4);
  for (int64_t l = 0; l < Dp / 4; ++l) lane_block[l] = static_cast<int32_t>(std::min(4 * l, D - 1) / qb);
  const auto* kb = static_cast<const int8_t*>(kv.k);
  for (int64_t j = 0; j < n; j += 4) {
    prefetch_rows<3>(kb, rows, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), D);
    prefetch_rows<3>(kv.v, rows, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), D);
    const int64_t nk = std::min<int64_t>(4, n - j);
    int64_t k[4];
    const float* ks[4];
    for (int64_t x = 0; x < 4; ++x) {
      k[x] = rows[j + std::min(x, nk - 1)];
      ks[x] = kv.k_scale + (j + std::min(x, nk - 1)) * nb;
    }
    int64_t r = 0;
    for (; r + kTileRows <= R; r += kTileRows)
      qk_tile_vnni<kTileRows>(qq.data() + r, kb, k, ks, nb, D, lane_block.data(), s + r * n + j, n, nk);
    const QuantQuery* rest = qq.data() + r;
    float* out = s + r * n + j;
    switch (R - r) {
      case 3: qk_tile_vnni<3>(rest, kb, k, ks, nb, D, lane_block.data(), out, n, nk); break;
      case 2: qk_tile_vnni<2>(rest, kb, k, ks, nb, D, lane_block.data(), out, n, nk); break;
      case 1: qk_tile_vnni<1>(rest, kb, k, ks, nb, D, lane_block.data(), out, n, nk); break;
      default: break;
    }
  }
}

// int8 scores through VNNI (a row of at most 16 scale blocks: one zmm of them), else the float path.
void scores_int8_vnni(const float* const* q, int64_t R, const int64_t* rows, int64_t n, const ChunkKV& kv,
                      int64_t D, float* s) {
  if (kv.type == 3 && D / kv.qb <= 16) return scores_vnni(q, R, rows, n, kv, D, s);
  scores_of<Zmm>(q, R, rows, n, kv, D, s);
}

}  // namespace

ChunkKernels kernels_avx512vnni() {
  ChunkKernels k = chunk_kernels<Zmm>();
  k.scores = &scores_int8_vnni;
  return k;
}

}  // namespace sparkserve::decode
