// One tile of the prefill attention (prefill_attention.h) as flash attention with the score matrix
// transposed, so that every step is a vertical vector operation. The tile's 3 W query rows (its
// queries x the G heads of one kv head; W the vector width) lie across three registers; a block of
// keys gives scores S[key][row] as register tiles over the head dim (one broadcast key value times
// a row of transposed queries), the per-row max and sum are vector max / add down the keys, and
// P V adds each key's V row, times its row group's probabilities, to outputs kept in L1. Blocks
// past every row's last key are never visited and only the blocks across a row's edge are masked,
// so a causal prompt costs half of the full product. Written once over a vector type V (the zmm
// form in prefill_attention_avx512.cpp, the ymm form in prefill_attention_avx2.cpp); plain
// intrinsics only, since the zmm unit is compiled with its own ISA flags. The q . k scores are a
// policy (FloatScores here: fp32 on dequantized keys; prefill_attention_avx512vnni.cpp's int8 one
// for an int8 pool); the mask, the online softmax and P V are the same for both.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "prefill_attention.h"

namespace {

using sparkserve::prefill::kBlockKeys;
using sparkserve::prefill::Tile;

inline int64_t lo_of(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t hi_of(int64_t a, int64_t b) { return a > b ? a : b; }

// Keys j0 .. j0 + n - 1 of the tile's kv head as fp32 rows [kBlockKeys][D], zeros past n up to a
// multiple of 8 (the score tiles' width); a quantized pool's rows dequantized with their block
// scales `scale` (exactly: an fp16 scale times an int8 / fp8 element).
template <class V>
void load_block(const Tile& t, const void* base, const uint16_t* scale, int64_t j0, int64_t n, float* dst) {
  const int64_t D = t.D;
  for (int64_t x = 0; x < n; ++x) {
    const int64_t row = (t.slots[j0 + x] * t.Hkv + t.h) * D;
    float* d = dst + x * D;
    if (t.kv_type == 0) {
      const float* s = static_cast<const float*>(base) + row;
      for (int64_t c = 0; c < D; c += V::W) V::storeu(d + c, V::loadu(s + c));
    } else if (t.kv_type <= 2) {
      const uint16_t* s = static_cast<const uint16_t*>(base) + row;
      for (int64_t c = 0; c < D; c += V::W) V::storeu(d + c, V::load_half(s + c, t.kv_type));
    } else {
      // e4m3 elements load as value / 256 (vec_ymm.h load_fp8), so their scale carries the 256
      const float mul = t.kv_type == 4 ? 256.f : 1.f;
      for (int64_t c = 0; c < D; c += t.qb) {
        const typename V::F sc = V::set1(_cvtsh_ss(scale[(row + c) / t.qb]) * mul);
        for (int64_t e = c; e < c + t.qb; e += V::W) {
          const typename V::F x8 = t.kv_type == 3 ? V::load_i8(static_cast<const int8_t*>(base) + row + e)
                                                  : V::load_fp8(static_cast<const uint8_t*>(base) + row + e,
                                                                t.kv_type == 4);
          V::storeu(d + e, V::mul(x8, sc));
        }
      }
    }
  }
  for (int64_t x = n; x < ((n + 7) & ~int64_t{7}); ++x)
    for (int64_t c = 0; c < D; c += V::W) V::storeu(dst + x * D + c, V::zero());
}

// s[x][0 .. 3W) = sum_d kb[x][d] qt[d][0 .. 3W) for V::kKeys keys: 3 kKeys accumulators.
template <class V>
inline void score_tile(const float* qt, const float* kb, int64_t D, float* s) {
  constexpr int K = V::kKeys, R = 3 * V::W;
  typename V::F a[K][3];
  for (int x = 0; x < K; ++x)
    for (int v = 0; v < 3; ++v) a[x][v] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    const float* qd = qt + d * R;
    const typename V::F q0 = V::load(qd), q1 = V::load(qd + V::W), q2 = V::load(qd + 2 * V::W);
    for (int x = 0; x < K; ++x) {
      const typename V::F k = V::set1(kb[x * D + d]);
      a[x][0] = V::fmadd(k, q0, a[x][0]);
      a[x][1] = V::fmadd(k, q1, a[x][1]);
      a[x][2] = V::fmadd(k, q2, a[x][2]);
    }
  }
  for (int x = 0; x < K; ++x)
    for (int v = 0; v < 3; ++v) V::store(s + x * R + V::W * v, a[x][v]);
}

// o[r][c0 .. c0 + W NV) += sum_x p[x][r] vb[x][c0 ..] for the kPvRows rows from r0.
template <class V, int NV>
inline void pv_tile(const float* p, const float* vb, int64_t n, int64_t D, int64_t r0, int64_t c0, float* o) {
  constexpr int NR = V::kPvRows, R = 3 * V::W;
  typename V::F acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = V::loadu(o + (r0 + r) * D + c0 + V::W * i);
  for (int64_t x = 0; x < n; ++x) {
    typename V::F v[NV];
    for (int i = 0; i < NV; ++i) v[i] = V::loadu(vb + x * D + c0 + V::W * i);
    for (int r = 0; r < NR; ++r) {
      const typename V::F pr = V::set1(p[x * R + r0 + r]);
      for (int i = 0; i < NV; ++i) acc[r][i] = V::fmadd(pr, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) V::storeu(o + (r0 + r) * D + c0 + V::W * i, acc[r][i]);
}

template <class V>
void pv(const float* p, const float* vb, int64_t n, int64_t D, float* o) {
  constexpr int NV = V::kPvVecs;
  for (int64_t r0 = 0; r0 < 3 * V::W; r0 += V::kPvRows) {
    int64_t c = 0;
    for (; c + NV * V::W <= D; c += NV * V::W) pv_tile<V, NV>(p, vb, n, D, r0, c, o);
    for (; c < D; c += V::W) pv_tile<V, 1>(p, vb, n, D, r0, c, o);
  }
}

// The tile's scores in fp32: its queries transposed and scaled ([D][R] in `qt`), each block's keys
// dequantized to fp32 rows (`kb`, load_block) and multiplied in score tiles of kKeys keys.
template <class V>
struct FloatScores {
  static constexpr int64_t R = 3 * V::W;
  float* qt;
  float* kb;

  FloatScores(const Tile& t, float* qt_, float* kb_) : qt(qt_), kb(kb_) {
    const int64_t D = t.D, G = t.G, rows = t.nq * t.G;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = t.q + (r / G) * t.q_query + (r % G) * t.q_head;
      for (int64_t d = 0; d < D; ++d) qt[d * R + r] = r < rows ? qr[d] * t.scale : 0.f;
    }
  }

  // s[x][0 .. R) = scale * q . k for the block's keys j0 .. j0 + n - 1 (zero keys up to n8).
  void block(const Tile& t, int64_t j0, int64_t n, int64_t n8, float* s) {
    load_block<V>(t, t.k, t.k_scale, j0, n, kb);
    for (int64_t x = 0; x < n8; x += V::kKeys) score_tile<V>(qt, kb + x * t.D, t.D, s + x * R);
  }
};

template <class V, class Scores = FloatScores<V>>
void attend_tile(const Tile& t) {
  using F = typename V::F;
  constexpr int64_t R = 3 * V::W;
  const int64_t D = t.D, G = t.G, rows = t.nq * G;
  float* qt = t.scratch;                      // [D][R], scaled
  float* o = qt + D * R;                      // [R][D]
  float* s = o + R * D;                       // [kBlockKeys][R]: scores, then probabilities
  float* kb = s + kBlockKeys * R;             // [kBlockKeys][D]
  float* vb = kb + kBlockKeys * D;
  float* alpha = vb + kBlockKeys * D;         // [R]
  Scores scores(t, qt, kb);
  for (int64_t i = 0; i < R * D; i += V::W) V::storeu(o + i, V::zero());
  // each row's end (its keys are j < end, and j >= end - window; spare rows are never written)
  typename V::I end[3];
  for (int v = 0; v < 3; ++v) {
    alignas(64) int32_t e[V::W];
    for (int x = 0; x < V::W; ++x) e[x] = static_cast<int32_t>(t.end0 + (V::W * v + x) / G);
    end[v] = V::load_int(e);
  }
  const F neg_inf = V::set1(-__builtin_inff());
  F m[3] = {neg_inf, neg_inf, neg_inf}, l[3] = {V::zero(), V::zero(), V::zero()};
  const int64_t last_end = t.end0 + t.nq - 1;
  for (int64_t j0 = t.window > 0 ? hi_of(0, t.end0 - t.window) : 0; j0 < last_end; j0 += kBlockKeys) {
    const int64_t n = lo_of(kBlockKeys, last_end - j0), n8 = (n + 7) & ~int64_t{7};
    scores.block(t, j0, n, n8, s);
    load_block<V>(t, t.v, t.v_scale, j0, n, vb);
    // only blocks across some row's first or last key need the mask
    if (j0 + n8 > t.end0 || (t.window > 0 && j0 < last_end - t.window))
      for (int64_t x = 0; x < n8; ++x)
        for (int v = 0; v < 3; ++v) {
          float* sv = s + x * R + V::W * v;
          V::store(sv, x < n ? V::hide_unseen(V::load(sv), static_cast<int32_t>(j0 + x), end[v],
                                              static_cast<int32_t>(t.window))
                             : neg_inf);
        }
    // online softmax: new row maxima, the old sums and outputs rescaled to them
    bool moved = false;
    for (int v = 0; v < 3; ++v) {
      F mx = m[v];
      for (int64_t x = 0; x < n8; ++x) mx = V::max(mx, V::load(s + x * R + V::W * v));
      // a row with no key yet keeps -inf; it subtracts 0 instead, so exp gives 0, not NaN
      const F base = V::zero_if_neg_inf(mx);
      const F a = V::exp(V::sub(m[v], base));
      moved = moved || V::differ(mx, m[v]);
      F sum = V::zero();
      for (int64_t x = 0; x < n8; ++x) {
        float* sv = s + x * R + V::W * v;
        const F p = V::exp(V::sub(V::load(sv), base));
        V::store(sv, p);
        sum = V::add(sum, p);
      }
      l[v] = V::fmadd(l[v], a, sum);
      m[v] = mx;
      V::store(alpha + V::W * v, a);
    }
    if (moved)
      for (int64_t r = 0; r < R; ++r) {
        const F a = V::set1(alpha[r]);
        for (int64_t c = 0; c < D; c += V::W) V::storeu(o + r * D + c, V::mul(a, V::loadu(o + r * D + c)));
      }
    pv<V>(s, vb, n, D, o);
  }
  for (int v = 0; v < 3; ++v) V::store(alpha + V::W * v, V::div(V::set1(1.f), l[v]));
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = t.out + (r / G) * t.out_query + (r % G) * t.out_head;
    const F inv = V::set1(alpha[r]);
    for (int64_t c = 0; c < D; c += V::W) V::storeu(dst + c, V::mul(inv, V::loadu(o + r * D + c)));
  }
}

}  // namespace
