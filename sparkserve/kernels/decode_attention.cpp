// Paged attention of few query tokens per request (decode: one; VERIFY blocks and small
// extends: a handful, causal), K/V read in place from the pool through the request's slot ids.
// The torch path gathers a padded [B, L, Hkv, D] copy of K and V every layer (aten::index) before
// SDPA; here each K/V row is fetched once, straight from its slot, for all H/Hkv query heads that
// share it (GQA). Work items are (request, kv head), split over the kernels' thread pool (thread_pool.h). fp32
// throughout; the softmax is exact (scores of all keys kept, then max, exp, sum) rather than
// online, so results differ from SDPA only by summation order and exp rounding (~1e-7 relative).
//
// Built with -mavx2 -mfma by sparkserve/kernels/build.py, which checks the CPU first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_attention.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

using sparkserve::exp256;
using sparkserve::hsum;

// q . k for one key (D a multiple of 8).
inline float dot1(const float* q, const float* k, int64_t D) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), s);
  return hsum(s);
}

// q . k for four keys at once: one q load per four FMAs, one shuffle-reduction for all four.
inline __m128 dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3,
                   int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + c), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + c), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + c), a3);
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// o[g][c0 .. c0 + 8 NV) = sum_j p[g][j] V[j][c0 ..] for NG heads sharing the V rows, the
// accumulators in registers (NG * NV <= 12).
template <int NG, int NV>
void pv_block(const float* p, int64_t n, const float* vp, const int64_t* rows, int64_t c0, float* o,
              int64_t D) {
  __m256 acc[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = vp + rows[j] + c0;
    __m256 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = _mm256_loadu_ps(vr + 8 * i);
    for (int g = 0; g < NG; ++g) {
      const __m256 pg = _mm256_broadcast_ss(p + g * n + j);
      for (int i = 0; i < NV; ++i) acc[g][i] = _mm256_fmadd_ps(pg, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o + g * D + c0 + 8 * i, acc[g][i]);
}

template <int NG>
void pv(const float* p, int64_t n, const float* vp, const int64_t* rows, float* o, int64_t D) {
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) pv_block<NG, 4>(p, n, vp, rows, c, o, D);
  for (; c < D; c += 8) pv_block<NG, 1>(p, n, vp, rows, c, o, D);
}

// Attention of the G query heads at qh (head stride qs1) over the n keys whose K/V rows start
// at rows[0..n) (offsets into the buffers): exact softmax in s [G, n], then o [G, D].
void attend(const float* qh, int64_t qs1, int64_t G, const int64_t* rows, int64_t n, const float* kp,
            const float* vp, float sc, float* s, float* o, int64_t D) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = kp + rows[j], *k1 = kp + rows[j + 1], *k2 = kp + rows[j + 2], *k3 = kp + rows[j + 3];
    for (int64_t g = 0; g < G; ++g) _mm_storeu_ps(&s[g * n + j], dot4(qh + g * qs1, k0, k1, k2, k3, D));
  }
  for (; j < n; ++j)
    for (int64_t g = 0; g < G; ++g) s[g * n + j] = dot1(qh + g * qs1, kp + rows[j], D);
  // softmax(scale * s) per head: max, exp and sum, then normalize (all in s)
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * n;
    float m = sg[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
    const __m256 scv = _mm256_set1_ps(sc), ms = _mm256_set1_ps(m * sc);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(sg + i), scv, ms));
      _mm256_storeu_ps(sg + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    for (; i < n; ++i) {
      alignas(32) float t[8] = {sg[i] * sc - m * sc};
      _mm256_store_ps(t, exp256(_mm256_load_ps(t)));
      sum += (sg[i] = t[0]);
    }
    const float inv = 1.f / sum;
    for (i = 0; i < n; ++i) sg[i] *= inv;
  }
  for (int64_t g = 0; g < G; g += 3) {
    const float* pg = s + g * n;
    if (G - g >= 3) pv<3>(pg, n, vp, rows, o + g * D, D);
    else if (G - g == 2) pv<2>(pg, n, vp, rows, o + g * D, D);
    else pv<1>(pg, n, vp, rows, o + g * D, D);
  }
}

}  // namespace

namespace sparkserve {

void paged_attention(const float* qp, int64_t qs0, int64_t qs1, int64_t H, int64_t D, const PagedKV& kv,
                     const int64_t* seq_lens, const int64_t* q_off, int64_t B, float sc, float* op) {
  const int64_t Hkv = kv.Hkv, G = H / Hkv, window = kv.window, kv_start = kv.kv_start;
  TORCH_CHECK(kv.causal || window <= 0, "paged attention: a window needs causal attention");
  // first gathered index a query at relative position e - 1 (e keys up to it) sees
  auto first = [&](int64_t e) { return window > 0 ? std::max<int64_t>(0, e - window) : 0; };
  // Work items (request, kv head): the K/V rows of a request's queries are fetched once, shared
  // by its G query heads and, from cache, by its later queries.
  sparkserve::parallel_for(0, B * Hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> s;        // scores, then probabilities: [G, n]
    std::vector<int64_t> rows;   // row offset of each visible key in the K/V buffers
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv, nq = q_off[b + 1] - q_off[b];
      const int64_t end = seq_lens[b] - kv_start, begin = first(end - nq + 1);
      rows.resize(end - begin);
      for (int64_t j = begin; j < end; ++j) {
        const int64_t slot = kv.idx[b * kv.idx_stride + j];
        TORCH_CHECK(slot >= 0 && slot < kv.slots, "paged attention: slot id out of range");
        rows[j - begin] = (slot * Hkv + h) * D;
      }
      s.resize(G * (end - begin));
      for (int64_t i = 0; i < nq; ++i) {       // query i: keys first(e) .. e - 1
        const int64_t e = kv.causal ? end - nq + 1 + i : end, f = first(e), t = q_off[b] + i;
        attend(qp + t * qs0 + h * G * qs1, qs1, G, rows.data() + (f - begin), e - f, kv.k, kv.v, sc,
               s.data(), op + t * H * D + h * G * D, D);
      }
    }
  });
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
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_buf.scalar_type() == at::kFloat &&
              v_buf.scalar_type() == at::kFloat, "decode_attention: float32 only");
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
  const sparkserve::PagedKV kv{k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), k_buf.size(0), Hkv,
                               kv_indices.data_ptr<int64_t>(), kv_indices.stride(0), kv_start, window};
  sparkserve::paged_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), H, D, kv, seq_lens.data(),
                              q_off.data(), B, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
