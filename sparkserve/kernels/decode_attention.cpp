// Paged attention of few query tokens per request (decode: one; VERIFY blocks and small
// extends: a handful, causal), K/V read in place from the pool through the request's slot ids.
// The torch path gathers a padded [B, L, Hkv, D] copy of K and V every layer (aten::index) before
// SDPA; here each K/V row is fetched once, straight from its slot, for all the query rows that
// share it: the H/Hkv query heads of GQA and, in a block, every query token. Keys are taken in
// fixed chunks of 256: within one the softmax is exact (every score kept, then max, exp, sum);
// a row with several merges their partials (flash-decoding), so one long context spreads over
// the threads. Work items are (request, kv head, chunks, queries), split over the kernels'
// thread pool (thread_pool.h), cut finer when few requests would leave threads idle. fp32
// throughout: results differ from SDPA only by summation order and exp rounding (~1e-7
// relative). A row's result depends only on its query and keys, not on the block or the threads
// it runs with: a VERIFY row equals the decode step at its position bit for bit.
//
// Built with -mavx2 -mfma by sparkserve/kernels/build.py, which checks the CPU first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "paged_attention.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

using sparkserve::exp256;
using sparkserve::hsum;

// Eight K/V elements as fp32 (exactly: every float16 and bfloat16 value is a float32 one).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// How far ahead of the key in use its K and V rows are fetched. An item's keys are one KV head's
// D values per slot: every Hkv * D values at best (consecutive slots), anywhere in the pool once
// pages are recycled. The hardware prefetchers keep too little of that in flight, so at contexts
// past the L3 the loops would wait on memory (docs/kernel-notes.md has the figures).
constexpr int64_t kPrefetchKeys = 32;

template <typename T>
inline void prefetch_rows(const T* base, const int64_t* rows, int64_t j0, int64_t j1, int64_t D) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + rows[j]) + b, _MM_HINT_T0);
}

// Scores of NR query rows against four keys: 2 x 4 accumulators fit the 16 ymm registers with the
// key vectors. Each (row, key) pair is reduced by the same lane order and hadd tree wherever it
// sits, so a score's bits depend only on its query and key, never on the tile or the block size.
template <int NR, typename T>
inline void qk_tile(const float* const* q, const T* const* k, int64_t D, float* s, int64_t ss, int64_t nk) {
  __m256 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int x = 0; x < 4; ++x) a[r][x] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 k0 = load8(k[0] + c), k1 = load8(k[1] + c), k2 = load8(k[2] + c), k3 = load8(k[3] + c);
    for (int r = 0; r < NR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q[r] + c);
      a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(qv, k2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(qv, k3, a[r][3]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
    const __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    if (nk == 4) {
      _mm_storeu_ps(s + r * ss, v);
    } else {
      alignas(16) float tmp[4];
      _mm_store_ps(tmp, v);
      for (int64_t x = 0; x < nk; ++x) s[r * ss + x] = tmp[x];
    }
  }
}

// s[r][j] = q_r . k_j for the R rows and the n keys at rows[0..n) (offsets into kp), keys in
// groups of four (the last group padded with its last key, whose extra scores are dropped). The
// V rows at the same offsets in vp are fetched too, for the P V pass after the softmax: it reads
// each V row once per column tile, and would otherwise wait on memory in the first.
template <typename T>
void scores(const float* const* q, int64_t R, const int64_t* rows, int64_t n, const T* kp, const T* vp, int64_t D,
            float* s) {
  for (int64_t j = 0; j < n; j += 4) {
    prefetch_rows(kp, rows, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), D);
    prefetch_rows(vp, rows, j + kPrefetchKeys, std::min(n, j + kPrefetchKeys + 4), D);
    const int64_t nk = std::min<int64_t>(4, n - j);
    const T* k[4];
    for (int64_t x = 0; x < 4; ++x) k[x] = kp + rows[j + std::min(x, nk - 1)];
    int64_t r = 0;
    // a half pool's keys cost a conversion per load: 3-row tiles load them once for 3 rows (GQA's
    // 3 heads per KV head), which pays despite the 17th register; float32 keys stay in 2-row tiles
    if (!std::is_same<T, float>::value)
      for (; r + 3 <= R; r += 3) qk_tile<3>(q + r, k, D, s + r * n + j, n, nk);
    for (; r + 2 <= R; r += 2) qk_tile<2>(q + r, k, D, s + r * n + j, n, nk);
    if (r < R) qk_tile<1>(q + r, k, D, s + r * n + j, n, nk);
  }
}

// exp(scale * s - max) over the row's visible keys [lo, hi) of its chunk, zero elsewhere (so the
// P V sum may run over all the item's keys and still add the same terms in the same order as over
// the row's own); returns the scaled max and writes the sum of the exps.
float softmax_partial(float* row, int64_t n, int64_t lo, int64_t hi, float sc, float* sum_out) {
  float* sg = row + lo;
  const int64_t m_n = hi - lo;
  float m = sg[0];
  for (int64_t i = 1; i < m_n; ++i) m = std::max(m, sg[i]);
  const __m256 scv = _mm256_set1_ps(sc), ms = _mm256_set1_ps(m * sc);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= m_n; i += 8) {
    const __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(sg + i), scv, ms));
    _mm256_storeu_ps(sg + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; i < m_n; ++i) {
    alignas(32) float t[8] = {sg[i] * sc - m * sc};
    _mm256_store_ps(t, exp256(_mm256_load_ps(t)));
    sum += (sg[i] = t[0]);
  }
  std::fill(row, row + lo, 0.f);
  std::fill(row + hi, row + n, 0.f);
  *sum_out = sum;
  return m * sc;
}

// o_r[c0 .. c0 + 8 NV) = sum_j p[r][j] V[j][c0 ..] for NR rows sharing the V rows, the
// accumulators in registers.
template <int NR, int NV, typename T>
void pv_tile(const float* p, int64_t n, const T* vp, const int64_t* rows, int64_t c0, float* const* o) {
  __m256 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchKeys < n)       // this tile's columns of a row ahead
      for (int64_t b = 0; b < 8 * NV * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vp + rows[j + kPrefetchKeys] + c0) + b, _MM_HINT_T0);
    const T* vr = vp + rows[j] + c0;
    __m256 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load8(vr + 8 * i);
    for (int r = 0; r < NR; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * n + j);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm256_fmadd_ps(pr, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o[r] + c0 + 8 * i, acc[r][i]);
}

template <int NR, typename T>
void pv(const float* p, int64_t n, const T* vp, const int64_t* rows, float* const* o, int64_t D) {
  int64_t c = 0;
  if (NR == 3)
    for (; c + 16 <= D; c += 16) pv_tile<NR, 2>(p, n, vp, rows, c, o);
  for (; c + 32 <= D; c += 32) pv_tile<NR, 4>(p, n, vp, rows, c, o);
  for (; c < D; c += 8) pv_tile<NR, 1>(p, n, vp, rows, c, o);
}

// Keys are cut at fixed gathered indices, every kKeyChunk. Each chunk of a row's keys gives a
// partial result (max, sum of exps, unnormalized P V), and a row's partials merge in order. The
// cut depends on neither the block nor the threads, so neither do a row's bits; and a long
// context splits over the threads even for one request's decode step.
constexpr int64_t kKeyChunk = 256;

// One work item: key chunks c0 .. c1 - 1 of a request's queries i0 .. i1 - 1 for one kv head,
// all G query heads of each.
struct Item {
  int64_t b, h, i0, i1, c0, c1;
};

// Where a request's queries and keys lie, and where its partial results go.
struct Request {
  int64_t nq, end, chunk0, chunks, part;   // keys < end; key chunks chunk0 ..; first partial
};

using sparkserve::PagedKV;

// paged_attention over K/V buffers of element type T.
template <typename T>
void attend(const float* qp, int64_t qs0, int64_t qs1, int64_t H, int64_t D, const PagedKV& kv, const T* kp,
            const T* vp, const int64_t* seq_lens, const int64_t* q_off, int64_t B, float sc, float* op) {
  const int64_t Hkv = kv.Hkv, G = H / Hkv, window = kv.window, kv_start = kv.kv_start, C = kKeyChunk;
  TORCH_CHECK(kv.causal || window <= 0, "paged attention: a window needs causal attention");
  // first gathered index a query at relative position e - 1 (e keys up to it) sees
  auto first = [&](int64_t e) { return window > 0 ? std::max<int64_t>(0, e - window) : 0; };
  std::vector<Request> req(B);
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    Request& r = req[b];
    r.nq = q_off[b + 1] - q_off[b];
    r.end = seq_lens[b] - kv_start;
    const int64_t lo = first(kv.causal ? r.end - r.nq + 1 : r.end);
    r.chunk0 = lo / C;
    r.chunks = (r.end - 1) / C - r.chunk0 + 1;
    r.part = parts;
    parts += r.nq * H * r.chunks;
  }
  auto last_key = [&](const Request& r, int64_t i) { return kv.causal ? r.end - r.nq + 1 + i : r.end; };
  // A row whose keys lie in one chunk is finished by its item; the others merge afterwards.
  auto one_chunk = [&](const Request& r, int64_t i) {
    const int64_t e = last_key(r, i);
    return first(e) / C == (e - 1) / C;
  };
  bool split = false;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < req[b].nq; ++i) split = split || !one_chunk(req[b], i);
  // With fewer (request, kv head) pairs than twice the threads, each pair is cut into about
  // as many items as make up the difference: by its key chunks first (a long context), then by
  // its queries (a VERIFY block), so that every thread has work even for one request.
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t pieces = std::max<int64_t>(1, (2 * threads + B * Hkv - 1) / (B * Hkv));
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const Request& r = req[b];
    const int64_t kparts = std::min(r.chunks, pieces);
    const int64_t qparts = std::min(r.nq, (pieces + kparts - 1) / kparts), size = (r.nq + qparts - 1) / qparts;
    for (int64_t i0 = 0; i0 < r.nq; i0 += size) {
      const int64_t i1 = std::min(r.nq, i0 + size);
      const int64_t c0 = first(last_key(r, i0)) / C, n = (last_key(r, i1 - 1) - 1) / C + 1 - c0;
      const int64_t k = std::min(kparts, n);
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t x = 0; x < k; ++x) items.push_back({b, h, i0, i1, c0 + x * n / k, c0 + (x + 1) * n / k});
    }
  }
  // partial results: [D] P V, then the scaled max and the sum, per (query row, head, key chunk)
  thread_local std::vector<float> part_buf;
  const int64_t P = D + 2;
  if (static_cast<int64_t>(part_buf.size()) < parts * P) part_buf.resize(parts * P);
  float* part = part_buf.data();
  auto entry = [&](const Request& r, int64_t i, int64_t head, int64_t c) {
    return part + (r.part + (i * H + head) * r.chunks + (c - r.chunk0)) * P;
  };

  // An item's G * (i1 - i0) query rows share every K/V row it fetches: scores as small
  // register-tiled products, a softmax partial per row, then P V for all rows at once.
  sparkserve::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t w0, int64_t w1) {
    // per thread, kept between calls (a decode step calls this once per layer)
    thread_local std::vector<float> s;             // scores, then exps: [R, n]
    thread_local std::vector<int64_t> rows;        // row offset of each key in the K/V buffers
    thread_local std::vector<const float*> q;      // the item's query rows
    thread_local std::vector<float*> o;            // and their P V: the output, or a partial to merge
    thread_local std::vector<float> sum;           // each row's sum of exps
    thread_local std::vector<float> unused;        // P V of a row without keys in the chunk
    unused.resize(D);
    // One key chunk of an item: its rows' partials, or the outputs of rows with no other chunk.
    auto chunk = [&](const Item& it, int64_t c) {
      const Request& r = req[it.b];
      const int64_t h = it.h;
      const int64_t k0 = std::max(c * C, first(last_key(r, it.i0)));
      const int64_t k1 = std::min((c + 1) * C, last_key(r, it.i1 - 1)), n = k1 - k0;
      rows.resize(n);
      for (int64_t j = k0; j < k1; ++j) {
        const int64_t slot = kv.idx[it.b * kv.idx_stride + j];
        TORCH_CHECK(slot >= 0 && slot < kv.slots, "paged attention: slot id out of range");
        rows[j - k0] = (slot * Hkv + h) * D;
      }
      const int64_t R = (it.i1 - it.i0) * G;
      q.resize(R), o.resize(R), sum.resize(R), s.resize(R * n);
      for (int64_t i = it.i0; i < it.i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k = (i - it.i0) * G + g, t = q_off[it.b] + i, head = h * G + g;
          q[k] = qp + t * qs0 + head * qs1;
          o[k] = one_chunk(r, i) ? op + t * H * D + head * D : entry(r, i, head, c);
        }
      scores(q.data(), R, rows.data(), n, kp, vp, D, s.data());
      for (int64_t i = it.i0; i < it.i1; ++i) {
        const int64_t e = last_key(r, i), lo = std::max(first(e), k0) - k0, hi = std::min(e, k1) - k0;
        for (int64_t k = (i - it.i0) * G; k < (i - it.i0 + 1) * G; ++k) {
          float* row = s.data() + k * n;
          if (hi <= lo) {                  // none of this row's keys here: its P V goes nowhere
            std::fill(row, row + n, 0.f);
            o[k] = unused.data(), sum[k] = 0.f;
            continue;
          }
          const float m = softmax_partial(row, n, lo, hi, sc, &sum[k]);
          if (!one_chunk(r, i)) o[k][D] = m, o[k][D + 1] = sum[k];
        }
      }
      int64_t k = 0;
      if (!std::is_same<T, float>::value)        // as in scores()
        for (; k + 3 <= R; k += 3) pv<3>(s.data() + k * n, n, vp, rows.data(), o.data() + k, D);
      for (; k + 2 <= R; k += 2) pv<2>(s.data() + k * n, n, vp, rows.data(), o.data() + k, D);
      if (k < R) pv<1>(s.data() + k * n, n, vp, rows.data(), o.data() + k, D);
      for (int64_t i = it.i0; i < it.i1; ++i) {
        if (!one_chunk(r, i)) continue;
        for (int64_t x = (i - it.i0) * G; x < (i - it.i0 + 1) * G; ++x) {
          if (o[x] == unused.data()) continue;
          const __m256 inv = _mm256_set1_ps(1.f / sum[x]);
          for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o[x] + d, _mm256_mul_ps(inv, _mm256_loadu_ps(o[x] + d)));
        }
      }
    };
    for (int64_t w = w0; w < w1; ++w) {
      const Item& it = items[w];
      for (int64_t c = it.c0; c < it.c1; ++c) chunk(it, c);
    }
  });

  // Merge the other rows' chunks in order: out = sum_c exp(m_c - M) pv_c / sum_c exp(m_c - M) l_c.
  if (!split) return;
  std::vector<int64_t> req_of(q_off[B]);
  for (int64_t b = 0; b < B; ++b) std::fill(req_of.begin() + q_off[b], req_of.begin() + q_off[b + 1], b);
  sparkserve::parallel_for(0, q_off[B] * H, 16, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / H, head = w % H, b = req_of[t], i = t - q_off[b];
      const Request& r = req[b];
      if (one_chunk(r, i)) continue;
      const int64_t e = last_key(r, i), c0 = first(e) / C, c1 = (e - 1) / C;
      float m = -INFINITY;
      for (int64_t c = c0; c <= c1; ++c) m = std::max(m, entry(r, i, head, c)[D]);
      float* out = op + t * H * D + head * D;
      float sum = 0.f;
      for (int64_t c = c0; c <= c1; ++c) {
        const float* pc = entry(r, i, head, c);
        const float wgt = std::exp(pc[D] - m);
        sum += wgt * pc[D + 1];
        const __m256 wv = _mm256_set1_ps(wgt);
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 acc = c == c0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + d);
          _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(pc + d), acc));
        }
      }
      const __m256 inv = _mm256_set1_ps(1.f / sum);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(inv, _mm256_loadu_ps(out + d)));
    }
  });
}

}  // namespace

namespace sparkserve {

void paged_attention(const float* qp, int64_t qs0, int64_t qs1, int64_t H, int64_t D, const PagedKV& kv,
                     const int64_t* seq_lens, const int64_t* q_off, int64_t B, float sc, float* op) {
  switch (kv.type) {
    case KVType::kFloat:
      attend(qp, qs0, qs1, H, D, kv, static_cast<const float*>(kv.k), static_cast<const float*>(kv.v), seq_lens,
             q_off, B, sc, op);
      break;
    case KVType::kHalf:
      attend(qp, qs0, qs1, H, D, kv, static_cast<const c10::Half*>(kv.k), static_cast<const c10::Half*>(kv.v),
             seq_lens, q_off, B, sc, op);
      break;
    case KVType::kBFloat16:
      attend(qp, qs0, qs1, H, D, kv, static_cast<const c10::BFloat16*>(kv.k),
             static_cast<const c10::BFloat16*>(kv.v), seq_lens, q_off, B, sc, op);
      break;
  }
}

KVType kv_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KVType::kFloat;
    case at::kHalf: return KVType::kHalf;
    case at::kBFloat16: return KVType::kBFloat16;
    default: TORCH_CHECK(false, "paged attention: K/V buffers must be float32, float16 or bfloat16, not ",
                         t.scalar_type());
  }
}

std::vector<int64_t> query_offsets(const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& q_lens,
                                   int64_t kv_start, int64_t gathered) {
  const int64_t B = static_cast<int64_t>(seq_lens.size());
  TORCH_CHECK(static_cast<int64_t>(q_lens.size()) == B, "paged attention: one seq_len and one q_len per request");
  std::vector<int64_t> q_off(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(q_lens[b] >= 1 && seq_lens[b] - q_lens[b] >= kv_start && seq_lens[b] - kv_start <= gathered,
                "paged attention: query positions out of the gathered range");
    q_off[b + 1] = q_off[b] + q_lens[b];
  }
  return q_off;
}

}  // namespace sparkserve

// q [T, H, D] (last dim contiguous), k_buf / v_buf [slots, Hkv, D] contiguous, kv_indices [B, >= L]
// int64 slot of positions kv_start.. . Request b owns q_lens[b] consecutive query rows (all 1 when
// q_lens is empty: decode), at positions seq_len - q_lens[b] .. seq_len - 1; the query at position p
// sees positions max(kv_start, p - window + 1) .. p (causal; window <= 0: no window). The new K/V
// of all of them are already in the pool, so VERIFY blocks and small extends need no gather either.
// Returns [T, H * D].
at::Tensor decode_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_indices,
                            std::vector<int64_t> seq_lens, int64_t kv_start, int64_t window, double scale,
                            std::vector<int64_t> q_lens) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: q must be float32");
  TORCH_CHECK(v_buf.scalar_type() == k_buf.scalar_type(), "decode_attention: K and V buffers of one dtype");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "decode_attention: q must be [T, H, D], last dim contiguous");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.sizes() == k_buf.sizes() &&
              v_buf.is_contiguous(), "decode_attention: K/V buffers must be contiguous [slots, Hkv, D]");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.dim() == 2 && kv_indices.stride(1) == 1,
              "decode_attention: kv_indices must be int64 [B, L], rows contiguous");
  const int64_t B = kv_indices.size(0), H = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D && D % 8 == 0 && Hkv > 0 && H % Hkv == 0,
              "decode_attention: head_dim must match and be a multiple of 8, H a multiple of Hkv");
  if (q_lens.empty()) q_lens.assign(B, 1);
  TORCH_CHECK(static_cast<int64_t>(seq_lens.size()) == B, "decode_attention: one seq_len per kv_indices row");
  const auto q_off = sparkserve::query_offsets(seq_lens, q_lens, kv_start, kv_indices.size(1));
  TORCH_CHECK(q.size(0) == q_off[B], "decode_attention: q must have sum(q_lens) rows");
  auto out = at::empty({q_off[B], H * D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const sparkserve::PagedKV kv{k_buf.data_ptr(), v_buf.data_ptr(), k_buf.size(0), Hkv,
                               kv_indices.data_ptr<int64_t>(), kv_indices.stride(0), kv_start, window,
                               true, sparkserve::kv_type_of(k_buf)};
  sparkserve::paged_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), H, D, kv, seq_lens.data(),
                              q_off.data(), B, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
