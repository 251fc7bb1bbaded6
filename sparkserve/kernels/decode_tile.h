// The arithmetic of one key chunk of the decode attention (decode_chunk.h), written once over a
// vector type V (vec_ymm.h, vec_zmm.h): scores as register tiles of query rows x four keys, the
// softmax partial of each row, and P V with each V row fetched once for a tile of rows. Each
// (row, key) score and each (row, column) output is summed in one fixed order whatever tile it
// sits in, so a row's bits depend only on its query and keys: a VERIFY row equals the decode
// step at its position, and a half-precision or quantized pool what its (dequantized) values give
// as float32.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_chunk.h"

namespace sparkserve::decode {

// How far ahead of the key in use its K and V rows are fetched. An item's keys are one KV head's
// D values per slot: every Hkv * D values at best (consecutive slots), anywhere in the pool once
// pages are recycled. The hardware prefetchers keep too little of that in flight, so at contexts
// past the L3 the loops would wait on memory (docs/kernel-notes.md has the figures).
constexpr int64_t kPrefetchKeys = 32;

// Element kinds (decode_chunk.h ChunkKV::type): 3.. are quantized, their rows scaled per block.
template <int KT>
constexpr bool quantized() { return KT >= 3; }

template <int KT>
constexpr int64_t elem_bytes() { return KT == 0 ? 4 : KT <= 2 ? 2 : 1; }

template <int KT>
inline void prefetch_rows(const void* base, const int64_t* rows, int64_t j0, int64_t j1, int64_t D) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < D * elem_bytes<KT>(); b += 64)
      _mm_prefetch(static_cast<const char*>(base) + rows[j] * elem_bytes<KT>() + b, _MM_HINT_T0);
}

// V::W K/V elements at element offset `at` of a buffer of kind KT, as fp32 (exactly; a quantized
// kind's before its block scale).
template <class V, int KT>
inline typename V::F load_kv(const void* base, int64_t at) {
  if constexpr (KT == 0) return V::loadu(static_cast<const float*>(base) + at);
  else if constexpr (KT <= 2) return V::load_half(static_cast<const uint16_t*>(base) + at, KT);
  else if constexpr (KT == 3) return V::load_i8(static_cast<const int8_t*>(base) + at);
  else return V::load_fp8(static_cast<const uint8_t*>(base) + at, KT == 4);
}

// Query rows per register tile: the zmm file holds 6 rows x 4 keys of accumulators; in ymm, a half
// or quantized pool's keys cost a conversion per load, so 3-row tiles (GQA's 3 heads per KV head)
// load them once for 3 rows, which pays despite the 17th register, and float32 keys stay in 2-row
// tiles.
template <class V, int KT>
constexpr int tile_rows() { return V::W == 16 ? 6 : KT == 0 ? 2 : 3; }

// Scores of NR query rows against the four keys at element offsets k[0..4); a quantized kind's
// keys are scaled per block of qb values by ks[x][block] as they load (exact products, so the
// scores are a float32 pool's holding the dequantized values, bit for bit).
template <class V, int KT, int NR>
inline void qk_tile(const float* const* q, const void* kb, const int64_t* k, const float* const* ks, int64_t D,
                    int64_t qb, float* s, int64_t ss, int64_t nk) {
  using F = typename V::F;
  F a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < 4; ++x) a[r][x] = V::zero();
  auto step = [&](int64_t c, F k0, F k1, F k2, F k3) {
    for (int r = 0; r < NR; ++r) {
      const F qv = V::loadu(q[r] + c);
      a[r][0] = V::fmadd(qv, k0, a[r][0]);
      a[r][1] = V::fmadd(qv, k1, a[r][1]);
      a[r][2] = V::fmadd(qv, k2, a[r][2]);
      a[r][3] = V::fmadd(qv, k3, a[r][3]);
    }
  };
  if constexpr (!quantized<KT>()) {
    for (int64_t c = 0; c < D; c += V::W)
      step(c, load_kv<V, KT>(kb, k[0] + c), load_kv<V, KT>(kb, k[1] + c), load_kv<V, KT>(kb, k[2] + c),
           load_kv<V, KT>(kb, k[3] + c));
  } else {
    for (int64_t b = 0, c = 0; c < D; ++b)
      for (const int64_t e = c + qb; c < e; c += V::W)
        step(c, V::mul(load_kv<V, KT>(kb, k[0] + c), V::set1(ks[0][b])),
             V::mul(load_kv<V, KT>(kb, k[1] + c), V::set1(ks[1][b])),
             V::mul(load_kv<V, KT>(kb, k[2] + c), V::set1(ks[2][b])),
             V::mul(load_kv<V, KT>(kb, k[3] + c), V::set1(ks[3][b])));
  }
  for (int r = 0; r < NR; ++r) {
    const __m128 v = V::sum4(a[r][0], a[r][1], a[r][2], a[r][3]);
    if (nk == 4) {
      _mm_storeu_ps(s + r * ss, v);
    } else {
      alignas(16) float tmp[4];
      _mm_store_ps(tmp, v);
      for (int64_t x = 0; x < nk; ++x) s[r * ss + x] = tmp[x];
    }
  }
}

// Keys in groups of four (the last group padded with its last key, whose extra scores are
// dropped); the V rows are fetched with the K rows, for the P V pass after the softmax.
template <class V, int KT>
void scores(const float* const* q, int64_t R, const int64_t* rows, int64_t n, const ChunkKV& kv, int64_t D,
            float* s) {
  constexpr int T = tile_rows<V, KT>();
  const void* kb = kv.k;
  const int64_t qb = quantized<KT>() ? kv.qb : D, nb = D / qb;
  for (int64_t j = 0; j < n; j += 4) {
    prefetch_rows<KT>(kb, rows, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), D);
    prefetch_rows<KT>(kv.v, rows, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), D);
    const int64_t nk = std::min<int64_t>(4, n - j);
    int64_t k[4];
    const float* ks[4] = {};
    for (int64_t x = 0; x < 4; ++x) {
      k[x] = rows[j + std::min(x, nk - 1)];
      if constexpr (quantized<KT>()) ks[x] = kv.k_scale + (j + std::min(x, nk - 1)) * nb;
    }
    int64_t r = 0;
    for (; r + T <= R; r += T) qk_tile<V, KT, T>(q + r, kb, k, ks, D, qb, s + r * n + j, n, nk);
    if constexpr (T == 6)
      for (; r + 3 <= R; r += 3) qk_tile<V, KT, 3>(q + r, kb, k, ks, D, qb, s + r * n + j, n, nk);
    if constexpr (T > 2)
      for (; r + 2 <= R; r += 2) qk_tile<V, KT, 2>(q + r, kb, k, ks, D, qb, s + r * n + j, n, nk);
    for (; r < R; ++r) qk_tile<V, KT, 1>(q + r, kb, k, ks, D, qb, s + r * n + j, n, nk);
  }
}

template <class V>
float softmax_partial(float* row, int64_t n, int64_t lo, int64_t hi, float sc, float* sum_out) {
  using F = typename V::F;
  float* sg = row + lo;
  const int64_t m_n = hi - lo;
  float m = sg[0];
  int64_t i = 0;
  if (m_n >= V::W) {
    F mv = V::loadu(sg);
    for (i = V::W; i + V::W <= m_n; i += V::W) mv = V::max(mv, V::loadu(sg + i));
    alignas(64) float lanes[V::W];
    V::storeu(lanes, mv);
    m = *std::max_element(lanes, lanes + V::W);
  }
  for (; i < m_n; ++i) m = std::max(m, sg[i]);
  const F scv = V::set1(sc), ms = V::set1(m * sc);
  F sum_v = V::zero();
  for (i = 0; i + V::W <= m_n; i += V::W) {
    const F e = V::exp(V::sub(V::mul(V::loadu(sg + i), scv), ms));
    V::storeu(sg + i, e);
    sum_v = V::add(sum_v, e);
  }
  float sum = V::hsum(sum_v);
  if (i < m_n) {                      // the tail, one vector of which the first m_n - i lanes count
    alignas(64) float t[V::W] = {};
    for (int64_t x = i; x < m_n; ++x) t[x - i] = sg[x];
    V::storeu(t, V::exp(V::sub(V::mul(V::loadu(t), scv), ms)));
    for (int64_t x = i; x < m_n; ++x) sum += (sg[x] = t[x - i]);
  }
  std::fill(row, row + lo, 0.f);
  std::fill(row + hi, row + n, 0.f);
  *sum_out = sum;
  return m * sc;
}

// o_r[c0 .. c0 + W NV) = sum_j p[r][j] V[j][c0 ..] for NR rows sharing the V rows, the
// accumulators in registers; a quantized kind's V vectors scaled by their block's vs[j][block].
template <class V, int KT, int NR, int NV>
void pv_tile(const float* p, int64_t n, const void* vb, const float* vs, int64_t nb, int64_t qb,
             const int64_t* rows, int64_t c0, float* const* o) {
  using F = typename V::F;
  F acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = V::zero();
  int64_t blk[NV];
  for (int i = 0; i < NV; ++i) blk[i] = (c0 + V::W * i) / qb;
  for (int64_t j = 0; j < n; ++j) {
    F v[NV];
    for (int i = 0; i < NV; ++i) {
      v[i] = load_kv<V, KT>(vb, rows[j] + c0 + V::W * i);
      if constexpr (quantized<KT>()) v[i] = V::mul(v[i], V::set1(vs[j * nb + blk[i]]));
    }
    for (int r = 0; r < NR; ++r) {
      const F pr = V::set1(p[r * n + j]);
      for (int i = 0; i < NV; ++i) acc[r][i] = V::fmadd(pr, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) V::storeu(o[r] + c0 + V::W * i, acc[r][i]);
}

// Column tiles of NR rows: in ymm, 3 rows take 2 vectors (6 accumulators and 2 V vectors leave
// room), others 4; in zmm 4 vectors (a 64-wide head in one pass).
template <class V, int KT, int NR>
void pv_rows(const float* p, int64_t n, const ChunkKV& kv, const int64_t* rows, float* const* o, int64_t D) {
  constexpr int NV = V::W == 8 && NR == 3 ? 2 : 4;
  const int64_t qb = quantized<KT>() ? kv.qb : D, nb = D / qb;
  int64_t c = 0;
  for (; c + NV * V::W <= D; c += NV * V::W) pv_tile<V, KT, NR, NV>(p, n, kv.v, kv.v_scale, nb, qb, rows, c, o);
  for (; c < D; c += V::W) pv_tile<V, KT, NR, 1>(p, n, kv.v, kv.v_scale, nb, qb, rows, c, o);
}

template <class V, int KT>
void pv(const float* p, int64_t R, int64_t n, const ChunkKV& kv, const int64_t* rows, float* const* o, int64_t D) {
  constexpr int T = tile_rows<V, KT>();
  int64_t r = 0;
  for (; r + T <= R; r += T) pv_rows<V, KT, T>(p + r * n, n, kv, rows, o + r, D);
  if constexpr (T == 6)
    for (; r + 3 <= R; r += 3) pv_rows<V, KT, 3>(p + r * n, n, kv, rows, o + r, D);
  if constexpr (T > 2)
    for (; r + 2 <= R; r += 2) pv_rows<V, KT, 2>(p + r * n, n, kv, rows, o + r, D);
  for (; r < R; ++r) pv_rows<V, KT, 1>(p + r * n, n, kv, rows, o + r, D);
}

// scores for the chunk's element kind.
template <class V>
void scores_of(const float* const* q, int64_t R, const int64_t* rows, int64_t n, const ChunkKV& kv, int64_t D,
               float* s) {
  switch (kv.type) {
    case 0: return scores<V, 0>(q, R, rows, n, kv, D, s);
    case 1: return scores<V, 1>(q, R, rows, n, kv, D, s);
    case 2: return scores<V, 2>(q, R, rows, n, kv, D, s);
    case 3: return scores<V, 3>(q, R, rows, n, kv, D, s);
    case 4: return scores<V, 4>(q, R, rows, n, kv, D, s);
    default: return scores<V, 5>(q, R, rows, n, kv, D, s);
  }
}

// The unit's ChunkKernels: the element kind picked once per call.
template <class V>
ChunkKernels chunk_kernels() {
  ChunkKernels k{};
  k.scores = &scores_of<V>;
  k.softmax = &softmax_partial<V>;
  k.pv = [](const float* p, int64_t R, int64_t n, const ChunkKV& kv, const int64_t* rows, float* const* o,
            int64_t D) {
    switch (kv.type) {
      case 0: return pv<V, 0>(p, R, n, kv, rows, o, D);
      case 1: return pv<V, 1>(p, R, n, kv, rows, o, D);
      case 2: return pv<V, 2>(p, R, n, kv, rows, o, D);
      case 3: return pv<V, 3>(p, R, n, kv, rows, o, D);
      case 4: return pv<V, 4>(p, R, n, kv, rows, o, D);
      default: return pv<V, 5>(p, R, n, kv, rows, o, D);
    }
  };
  k.width = V::W;
  return k;
}

}  // namespace sparkserve::decode
