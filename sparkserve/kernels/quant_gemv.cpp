// y = x @ W.T for decode-sized M, fp32 activations and fp32 accumulation, W read straight from its
// GGUF block format (Q4_1, Q8_0), bf16 or fp16. Each weight block is expanded to exactly the fp32 values
// gguf-py's `dequantize` gives (Q4_1: d*q + m, Q8_0: d*q, bf16: the top half of an fp32, fp16: F16C), so
// results differ from F.linear on the dequantized weight only by summation order. The quantized
// weights are streamed once for all M rows. Two schemes:
//  - M < kPanelMinM (decode, small verify blocks): blocks are expanded in registers and used at
//    once by tiles of up to 8 x rows (one load per FMA; re-expanded for each tile).
//  - larger M (batched decode, verify blocks): a panel of 3 output rows is expanded once into an
//    fp32 buffer in L1, and a 4 x 3 register-blocked micro-kernel (12 ymm accumulators, 7 loads
//    per 12 FMAs) runs over it for every 4-row (or 3-row) tile of x.
// Rows of W are split over the kernels' thread pool (thread_pool.h).
//
// Built with -mavx2 -mfma -mf16c by sparkserve/kernels/build.py, which checks the CPU first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "block_linear.h"
#include "int8_common.h"
#include "int8_packed.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

using sparkserve::hsum;

// ggml type ids (gguf.GGMLQuantizationType), and sparkserve's Q6_S (kernels/blocks.py)
using sparkserve::int8::kQ4_0;
using sparkserve::int8::kQ4_1;
using sparkserve::int8::kQ6_S;
using sparkserve::int8::kQ8_0;
constexpr int kBF16 = 30;
constexpr int kF16 = 1;

// Bytes per 32 weights (the packed types as the block types they hold).
constexpr int block_bytes(int qt) {
  qt = sparkserve::int8::gguf_type_of(qt);
  return qt == kQ4_0 ? 18 : qt == kQ4_1 ? 20 : qt == kQ8_0 ? 34 : qt == kQ6_S ? 28 : 64;
}

inline float fp16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Expand one block of 32 weights into w[0..3] (elements 0-7, 8-15, 16-23, 24-31).
template <int QT>
inline void expand(const uint8_t* blk, __m256 w[4]);

// 8 bytes at p, zero- or sign-extended to 8 int32 lanes (the load folds into vpmov{z,s}xbd).
inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <>
inline void expand<kQ4_1>(const uint8_t* blk, __m256 w[4]) {
  // block_q4_1: fp16 d, fp16 m, 16 bytes qs; low nibbles are elements 0..15, high 16..31.
  int32_t dm_bits;
  std::memcpy(&dm_bits, blk, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));          // [d, m, 0, 0]
  const __m256 d = _mm256_broadcastss_ps(dm);
  const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m256i b0 = u8x8(blk + 4), b1 = u8x8(blk + 12);                // bytes 0-7, 8-15
  const __m256i lo4 = _mm256_set1_epi32(0x0F);
  // d*q is exact in fp32 (11-bit by 4-bit mantissas), so fma(d, q, m) == d*q + m bit for bit.
  w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, lo4)), m);
  w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, lo4)), m);
  w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m);
  w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m);
}

template <>
inline void expand<kQ4_0>(const uint8_t* blk, __m256 w[4]) {
  // block_q4_0: fp16 d, 16 bytes qs (Q4_1's nibble order); w = d * (q - 8), exact in fp32.
  const __m256 d = _mm256_set1_ps(fp16_to_fp32(blk));
  const __m256i b0 = u8x8(blk + 2), b1 = u8x8(blk + 10);
  const __m256i lo4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
  const __m256i q[4] = {_mm256_and_si256(b0, lo4), _mm256_and_si256(b1, lo4), _mm256_srli_epi32(b0, 4),
                        _mm256_srli_epi32(b1, 4)};
  for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], eight)));
}

template <>
inline void expand<kQ8_0>(const uint8_t* blk, __m256 w[4]) {
  // block_q8_0: fp16 d, 32 int8 qs. d*q is exact in fp32.
  const __m256 d = _mm256_set1_ps(fp16_to_fp32(blk));
  for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(i8x8(blk + 2 + 8 * j)));
}

template <>
inline void expand<kQ6_S>(const uint8_t* blk, __m256 w[4]) {
  // Q6_S: fp16 d, int8 scales of elements 0..15 and 16..31, 16 nibble bytes (as Q4_1's), 8 bytes
  // of high bits (element 16c + 4k + j: byte 4c + j, bits 2k); w = (d * scale) * (u - 32), in
  // that order, as gguf-py's Q6_K.
  const float d = fp16_to_fp32(blk);
  const float ds[2] = {d * static_cast<int8_t>(blk[2]), d * static_cast<int8_t>(blk[3])};
  alignas(32) float v[32];
  for (int e = 0; e < 32; ++e) {
    const int low = e < 16 ? blk[4 + e] & 0x0F : blk[4 + e - 16] >> 4;
    const int high = blk[20 + 4 * (e / 16) + e % 4] >> (2 * (e % 16 / 4)) & 3;
    v[e] = ds[e / 16] * static_cast<float>((low | high << 4) - 32);
  }
  for (int j = 0; j < 4; ++j) w[j] = _mm256_load_ps(v + 8 * j);
}

template <>
inline void expand<kBF16>(const uint8_t* blk, __m256 w[4]) {
  for (int j = 0; j < 4; ++j) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * j));
    w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <>
inline void expand<kF16>(const uint8_t* blk, __m256 w[4]) {
  for (int j = 0; j < 4; ++j)
    w[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * j)));
}

// ---- Small M: expansion in registers ----
// x rows are packed in tiles of up to 8 rows: tile t (rows 8t .. 8t+mt-1) is stored at 8t*K as
// [K/32 blocks][mt rows][32], so a block's x values for the whole tile sit in one contiguous run
// and every load is a fixed offset from one pointer.
constexpr int64_t kTile = 8;
// Output rows taken together: each x tile is reused across the group while it is in L1. (Cutting
// K into L1-sized chunks as well measured slower on SmolLM2 shapes, even at K = 4096.)
constexpr int64_t kGroup = 16;

// One output row for the MT rows of one x tile: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
// A accumulators per x row keep enough independent FMA chains in flight when MT is small.
template <int QT, int MT>
inline void row_tile(const uint8_t* wrow, int64_t nblocks, const float* xt, float* y, int64_t N, float b) {
  constexpr int A = MT == 1 ? 4 : (MT <= 3 ? 2 : 1);
  constexpr int BB = block_bytes(QT);
  __m256 acc[MT][A];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    __m256 w[4];
    expand<QT>(wrow + blk * BB, w);
    const float* xb = xt + blk * (MT * 32);
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j)
        acc[m][j % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * 32 + 8 * j), w[j], acc[m][j % A]);
  }
  for (int m = 0; m < MT; ++m) {
    __m256 s = acc[m][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[m][a]);
    y[m * N] = hsum(s) + b;
  }
}

template <int QT, int MT>
void group_tile(const uint8_t* w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t nblocks,
                const float* xt, float* yt, int64_t N, const float* bias) {
  for (int64_t n = g0; n < g1; ++n)
    row_tile<QT, MT>(w + n * row_bytes, nblocks, xt, yt + n, N, bias ? bias[n] : 0.0f);
}

// Output rows [n0, n1) for all M rows of x.
template <int QT>
void rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* xpk, int64_t M,
          int64_t K, float* y, int64_t N, const float* bias) {
  const int64_t nblocks = K / 32;
  for (int64_t g0 = n0; g0 < n1; g0 += kGroup) {
    const int64_t g1 = std::min(n1, g0 + kGroup);
    for (int64_t m = 0; m < M; m += kTile) {
      const float* xt = xpk + m * K;
      float* yt = y + m * N;
      switch (std::min(kTile, M - m)) {
        case 8: group_tile<QT, 8>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        case 7: group_tile<QT, 7>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        case 6: group_tile<QT, 6>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        case 5: group_tile<QT, 5>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        case 4: group_tile<QT, 4>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        case 3: group_tile<QT, 3>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        case 2: group_tile<QT, 2>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
        default: group_tile<QT, 1>(w, row_bytes, g0, g1, nblocks, xt, yt, N, bias); break;
      }
    }
  }
}

// Pack x [M, K] into the tile layout above (a no-op copy for M == 1, which callers skip).
void pack_x(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t nblocks = K / 32;
  for (int64_t m0 = 0; m0 < M; m0 += kTile) {
    const int64_t mt = std::min(kTile, M - m0);
    float* dst = out + m0 * K;
    for (int64_t blk = 0; blk < nblocks; ++blk)
      for (int64_t m = 0; m < mt; ++m)
        std::memcpy(dst + (blk * mt + m) * 32, x + (m0 + m) * K + blk * 32, 32 * sizeof(float));
  }
}

// ---- Larger M: expanded panels and a register-blocked micro-kernel ----
// Panels of kNR output rows are expanded as [K/8][kNR][8] floats and x is packed in tiles of 4 (or
// 3) rows as [K/8][rows][8], so the micro-kernel walks one pointer through each. 4 x 3 measured best
// among 4x3, 3x4 (needs a 17th register), 6x2, 5x2 and 2x6 on Zen 3.
constexpr int kNR = 3;              // the tile code below assumes 3
constexpr int64_t kPanelMinM = 8;   // below this the register scheme wins (measured)

// x tiles have 4 rows, or 3 for the last few so that no tile has 1 or 2 (with 3 or 6
// accumulators those are bound by the 4-cycle FMA latency): 9 = 3+3+3, 10 = 4+3+3, 33 = 6x4+3x3.
// Rows of the tile starting at row m; any M >= 6 splits this way.
inline int64_t tile_rows(int64_t M, int64_t m) { return M - m <= 3 * ((4 - M % 4) % 4) ? 3 : 4; }
// K is cut into chunks of 96 steps of 8 inputs (24 blocks): a panel chunk (9 KiB) and an x tile's
// chunk (12 KiB) then stay in L1 together for wide K (down_proj); K <= 768 is a single chunk.
constexpr int64_t kChunkSteps = 96;

// Four horizontal sums at once: [sum a, sum b, sum c, sum d].
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One x tile (MR rows packed at xt) times one panel chunk (wb) over `steps` x 8 inputs. Partial
// sums wait in acc_io between the chunks of a wide K.
// noinline: inlined into panels(), GCC 12 stored all 12 accumulators to the stack every step (2x
// slower); the unrolled small loops let it keep them in registers around the main loop too (+2%).
template <int MR>
__attribute__((noinline)) void tile(const float* xt, const float* wb, int64_t steps, float* acc_io,
                                    bool first, bool last, float* y, int64_t N, int64_t n0, int nr,
                                    const float* bias) {
  __m256 acc[MR][kNR];
  #pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n)
      acc[m][n] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_io + (m * kNR + n) * 8);
  for (int64_t st = 0; st < steps; ++st) {
    __m256 w[kNR];
    for (int n = 0; n < kNR; ++n) w[n] = _mm256_loadu_ps(wb + (st * kNR + n) * 8);
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(xt + (st * MR + m) * 8);
      for (int n = 0; n < kNR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, w[n], acc[m][n]);
    }
  }
  if (!last) {
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < kNR; ++n) _mm256_storeu_ps(acc_io + (m * kNR + n) * 8, acc[m][n]);
    return;
  }
  // y[m, n0 .. n0+nr-1]: the three row sums at once, stored without touching y past n0 + nr.
  alignas(16) float bb[4] = {0, 0, 0, 0};
  if (bias)
    for (int n = 0; n < kNR; ++n) bb[n] = n < nr ? bias[n0 + n] : 0.0f;
  const __m128 b = _mm_load_ps(bb);
  #pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const __m128 s = _mm_add_ps(hsum4(acc[m][0], acc[m][1], acc[m][2], _mm256_setzero_ps()), b);
    float* out = y + m * N + n0;
    if (nr == 1) {
      _mm_store_ss(out, s);
      continue;
    }
    _mm_storel_pi(reinterpret_cast<__m64*>(out), s);
    if (nr == 3) _mm_store_ss(out + 2, _mm_movehl_ps(s, s));
  }
}

// Output rows [p0*kNR, p1*kNR) ∩ [0, N) for all M rows (x packed by pack_tiles).
template <int QT>
void panels(const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t p1, const float* xpk, int64_t M,
            int64_t K, float* y, int64_t N, const float* bias) {
  constexpr int BB = block_bytes(QT);
  const int64_t steps = K / 8;
  const int64_t cs = std::min(steps, kChunkSteps);
  // (In a last panel of fewer than kNR rows the others compute on stale values and are not stored.)
  std::vector<float> wbuf(kNR * cs * 8, 0.0f), accbuf(M * kNR * 8);
  float* wb = wbuf.data();
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kNR;
    const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n0));
    if (p + 1 < p1) {  // the next panel's blocks, fetched while this one computes (-15% on the LM head)
      const char* nxt = reinterpret_cast<const char*>(w + (n0 + kNR) * row_bytes);
      const int64_t bytes = std::min<int64_t>(kNR, N - n0 - kNR) * row_bytes;
      for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(nxt + off, _MM_HINT_T0);
    }
    for (int64_t c0 = 0; c0 < steps; c0 += cs) {
      const int64_t cn = std::min(cs, steps - c0);
      for (int r = 0; r < nr; ++r) {
        const uint8_t* blk = w + (n0 + r) * row_bytes + c0 / 4 * BB;
        for (int64_t b = 0; b < cn / 4; ++b) {
          __m256 v[4];
          expand<QT>(blk + b * BB, v);
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(wb + ((b * 4 + j) * kNR + r) * 8, v[j]);
        }
      }
      const bool first = c0 == 0, last = c0 + cn == steps;
      for (int64_t m = 0, mt; m < M; m += mt) {
        mt = tile_rows(M, m);
        const float* xt = xpk + m * K + c0 * mt * 8;
        float* acc = accbuf.data() + m * kNR * 8;
        if (mt == 4) tile<4>(xt, wb, cn, acc, first, last, y + m * N, N, n0, nr, bias);
        else tile<3>(xt, wb, cn, acc, first, last, y + m * N, N, n0, nr, bias);
      }
    }
  }
}

// Pack x [M, K] in the tiles of tile_rows, each [K/8][rows][8].
void pack_tiles(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
    mt = tile_rows(M, m0);
    float* dst = out + m0 * K;
    for (int64_t s = 0; s < K / 8; ++s)
      for (int64_t m = 0; m < mt; ++m)
        std::memcpy(dst + (s * mt + m) * 8, x + (m0 + m) * K + s * 8, 8 * sizeof(float));
  }
}

bool known_type(int64_t qtype) {
  return sparkserve::int8::int8_reads(static_cast<int>(qtype)) || qtype == kBF16 || qtype == kF16;
}

// Calls f with the block type as a compile-time constant (std::integral_constant<int, QT>).
template <typename F>
void by_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); break;
    case kQ6_S: f(std::integral_constant<int, kQ6_S>{}); break;
    case kF16: f(std::integral_constant<int, kF16>{}); break;
    default: f(std::integral_constant<int, kBF16>{}); break;
  }
}

}  // namespace

namespace sparkserve {

int block_bytes_of(int qtype) { return block_bytes(qtype); }

void block_linear(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int qtype,
                  const float* bp, float* yp) {
  TORCH_CHECK(!int8::is_packed_type(qtype), "block linear: packed blocks (type ", qtype,
              ") are read with int8 activations only");
  if (M == 0 || N == 0) return;
  const int64_t row_bytes = K / 32 * block_bytes(qtype);
  std::vector<float> packed;
  if (M >= kPanelMinM) {
    packed.resize(M * K);
    pack_tiles(xp, M, K, packed.data());
    const float* xq = packed.data();
    const int64_t P = (N + kNR - 1) / kNR;   // panels, at least ~32 KiB of weights per task
    const int64_t grain = std::max<int64_t>(1, (32 << 10) / (row_bytes * kNR));
    sparkserve::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      by_type(qtype, [&](auto qt) { panels<qt.value>(wp, row_bytes, p0, p1, xq, M, K, yp, N, bp); });
    });
    return;
  }
  if (M > 1) {
    packed.resize(M * K);
    pack_x(xp, M, K, packed.data());
    xp = packed.data();
  }
  // At least ~32 KiB of weights per task: small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes);
  sparkserve::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    by_type(qtype, [&](auto qt) { rows<qt.value>(wp, row_bytes, n0, n1, xp, M, K, yp, N, bp); });
  });
}

}  // namespace sparkserve

// x: [M, K] float32; w: [N, K/32 * block_bytes] uint8 (one row of blocks per output row);
// bias: optional [N] float32. Returns [M, N] float32.
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, std::optional<at::Tensor> bias) {
  TORCH_CHECK(!sparkserve::int8::is_packed_type(static_cast<int>(qtype)), "quant_linear: packed blocks (type ",
              qtype, ") are read with int8 activations only (quant_linear_int8)");
  TORCH_CHECK(known_type(qtype), "quant_linear: unsupported type ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: w must be a contiguous 2-D uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "quant_linear: K must be a multiple of 32, got ", K);
  const int64_t row_bytes = K / 32 * block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(w.size(1) == row_bytes, "quant_linear: w has ", w.size(1), " bytes per row, expected ", row_bytes);
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "quant_linear: bad bias");
    bp = b.data_ptr<float>();
  }
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  sparkserve::block_linear(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, static_cast<int>(qtype), bp,
                           y.data_ptr<float>());
  return y;
}

// Rows `ids` of a block weight [N, K/32 * block_bytes], expanded to fp32 exactly as gguf-py's
// `dequantize` gives them: the embedding of a model served quantized looks its rows up here, a
// few a step, on the calling thread (a torch op would wake its own thread pool beside the
// kernels' spinning one).
at::Tensor dequantize_rows(at::Tensor w, int64_t qtype, int64_t K, at::Tensor ids) {
  const bool packed = sparkserve::int8::is_packed_type(static_cast<int>(qtype));
  qtype = sparkserve::int8::gguf_type_of(static_cast<int>(qtype));
  TORCH_CHECK(known_type(qtype), "dequantize_rows: unsupported type ", qtype);
  TORCH_CHECK(K % 32 == 0, "dequantize_rows: K must be a multiple of 32, got ", K);
  const int64_t row_bytes = K / 32 * block_bytes(static_cast<int>(qtype)), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes,
              "dequantize_rows: w must be a contiguous uint8 [N, ", row_bytes, "] tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "dequantize_rows: ids must be 1-D int64");
  const at::Tensor idx = ids.contiguous();
  const int64_t n = idx.numel(), bb = block_bytes(static_cast<int>(qtype));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "dequantize_rows: id ", ip[i], " out of range");
  auto y = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(!packed || N % sparkserve::int8::kGroupRows == 0, "dequantize_rows: packed rows come in groups of ",
              sparkserve::int8::kGroupRows);
  by_type(qtype, [&](auto qt) {
    uint8_t gguf[64];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = wp + ip[i] * row_bytes + b * bb;
        if (packed) {
          sparkserve::int8::gguf_block_of_packed(wp, ip[i], b, K / 32, qt.value, gguf);
          blk = gguf;
        }
        __m256 v[4];
        expand<qt.value>(blk, v);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(yp + i * K + 32 * b + 8 * j, v[j]);
      }
  });
  return y;
}
