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
// it runs with: a VERIFY row equals the decode step at its position bit for bit. A quantized pool
// (int8 / fp8 with float16 block scales) is dequantized as each chunk reads its rows: the chunk's
// scales converted first, the elements scaled in registers (decode_tile.h).
// The arithmetic of a chunk is decode_tile.h's, on zmm registers where the CPU has AVX-512 and
// the head dim is a multiple of 16 (decode_attention_avx512.cpp), else on ymm; where it also has
// AVX-512 VNNI an int8 pool's q . k scores are integer dot products of the keys with each query
// quantized to int8 (decode_attention_avx512vnni.cpp). One variant per head dim, so decode and
// VERIFY rows stay equal.
//
// Built with -mavx2 -mfma by sparkserve/kernels/build.py, which checks the CPU first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "block_linear.h"
#include "decode_chunk.h"
#include "paged_attention.h"
#include "thread_pool.h"

namespace {

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

// paged_attention with the chunk kernels K (decode_tile.h) over K/V buffers of kind kv_type.
void attend(const sparkserve::decode::ChunkKernels& K, const float* qp, int64_t qs0, int64_t qs1, int64_t H,
            int64_t D, const PagedKV& kv, int kv_type, const int64_t* seq_lens, const int64_t* q_off, int64_t B,
            float sc, float* op) {
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
    thread_local std::vector<float> k_sc, v_sc;    // a quantized pool's block scales of the chunk's keys
    unused.resize(D);
    const bool quant = kv_type >= 3;
    const int64_t qb = quant ? sparkserve::quant_block(D) : D, nb = D / qb;
    // e4m3 elements load as value / 256 (vec_ymm.h load_fp8): their scales carry the 256
    const float sc_mul = kv_type == 4 ? 256.f : 1.f;
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
      if (quant) {
        k_sc.resize(n * nb), v_sc.resize(n * nb);
        const auto* ks = static_cast<const uint16_t*>(kv.k_scale);
        const auto* vs = static_cast<const uint16_t*>(kv.v_scale);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t b = 0, at = rows[j] / qb; b < nb; ++b) {
            k_sc[j * nb + b] = _cvtsh_ss(ks[at + b]) * sc_mul;
            v_sc[j * nb + b] = _cvtsh_ss(vs[at + b]) * sc_mul;
          }
      }
      const sparkserve::decode::ChunkKV ckv{kv.k, kv.v, kv_type, k_sc.data(), v_sc.data(), qb};
      const int64_t R = (it.i1 - it.i0) * G;
      q.resize(R), o.resize(R), sum.resize(R), s.resize(R * n);
      for (int64_t i = it.i0; i < it.i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k = (i - it.i0) * G + g, t = q_off[it.b] + i, head = h * G + g;
          q[k] = qp + t * qs0 + head * qs1;
          o[k] = one_chunk(r, i) ? op + t * H * D + head * D : entry(r, i, head, c);
        }
      K.scores(q.data(), R, rows.data(), n, ckv, D, s.data());
      for (int64_t i = it.i0; i < it.i1; ++i) {
        const int64_t e = last_key(r, i), lo = std::max(first(e), k0) - k0, hi = std::min(e, k1) - k0;
        for (int64_t k = (i - it.i0) * G; k < (i - it.i0 + 1) * G; ++k) {
          float* row = s.data() + k * n;
          if (hi <= lo) {                  // none of this row's keys here: its P V goes nowhere
            std::fill(row, row + n, 0.f);
            o[k] = unused.data(), sum[k] = 0.f;
            continue;
          }
          float row_sc = sc;
          if (kv.softcap > 0.f) {         // Gemma 2: the scaled scores soft-capped, then the softmax
            const float cap = kv.softcap, in = sc / cap;
            for (int64_t j = lo; j < hi; ++j) row[j] = cap * std::tanh(row[j] * in);
            row_sc = 1.f;
          }
          const float m = K.softmax(row, n, lo, hi, row_sc, &sum[k]);
          if (!one_chunk(r, i)) o[k][D] = m, o[k][D + 1] = sum[k];
          else if (kv.sinks != nullptr)   // the sink's exp joins the sum the output is divided by
            sum[k] += std::exp(kv.sinks[h * G + k - (i - it.i0) * G] - m);
        }
      }
      K.pv(s.data(), R, n, ckv, rows.data(), o.data(), D);
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
      if (kv.sinks != nullptr) sum += std::exp(kv.sinks[head] - m);
      const __m256 inv = _mm256_set1_ps(1.f / sum);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(inv, _mm256_loadu_ps(out + d)));
    }
  });
}

struct Variant {
  const char* name;
  sparkserve::decode::ChunkKernels kernels;
};

// The chunk kernels this CPU runs, best first ("avx2" is always built); read once.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = [] {
    std::vector<Variant> out;
#ifdef SPARKSERVE_HAS_DECODE_AVX512VNNI
    if (sparkserve::isa_usable("avx512") && sparkserve::isa_usable("avx512vnni"))
      out.push_back({"avx512vnni", sparkserve::decode::kernels_avx512vnni()});
#endif
#ifdef SPARKSERVE_HAS_DECODE_AVX512
    if (sparkserve::isa_usable("avx512")) out.push_back({"avx512", sparkserve::decode::kernels_avx512()});
#endif
    out.push_back({"avx2", sparkserve::decode::kernels_avx2()});
    return out;
  }();
  return v;
}

// The best variant for head dim D (its vector width must divide D), or the one named.
const Variant& variant_for(int64_t D, const std::string& name = "") {
  for (const Variant& v : variants())
    if ((name.empty() || name == v.name) && D % v.kernels.width == 0) return v;
  TORCH_CHECK(false, "decode attention: no variant ", name, " for head dim ", D, " runs here");
}

int kv_kind(sparkserve::KVType t) { return static_cast<int>(t); }

}  // namespace

namespace sparkserve {

void paged_attention(const float* qp, int64_t qs0, int64_t qs1, int64_t H, int64_t D, const PagedKV& kv,
                     const int64_t* seq_lens, const int64_t* q_off, int64_t B, float sc, float* op) {
  TORCH_CHECK(!is_quantized(kv.type) || (kv.k_scale != nullptr && kv.v_scale != nullptr),
              "paged attention: a quantized pool needs its scale buffers");
  attend(variant_for(D).kernels, qp, qs0, qs1, H, D, kv, kv_kind(kv.type), seq_lens, q_off, B, sc, op);
}

KVType kv_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KVType::kFloat;
    case at::kHalf: return KVType::kHalf;
    case at::kBFloat16: return KVType::kBFloat16;
    case at::kChar: return KVType::kInt8;
    case at::kFloat8_e4m3fn: return KVType::kFp8E4M3;
    case at::kFloat8_e5m2: return KVType::kFp8E5M2;
    default: TORCH_CHECK(false, "paged attention: K/V buffers must be float32, float16, bfloat16, int8, "
                         "float8_e4m3fn or float8_e5m2, not ", t.scalar_type());
  }
}

std::pair<const void*, const void*> kv_scales(const at::Tensor& k_buf, const std::optional<at::Tensor>& k_scale,
                                               const std::optional<at::Tensor>& v_scale, const char* who) {
  if (!is_quantized(kv_type_of(k_buf))) {
    TORCH_CHECK(!k_scale && !v_scale, who, ": scales given for a ", k_buf.scalar_type(), " pool");
    return {nullptr, nullptr};
  }
  TORCH_CHECK(k_scale && v_scale, who, ": a ", k_buf.scalar_type(), " pool needs k_scale and v_scale");
  const int64_t D = k_buf.size(2), nb = D / quant_block(D);
  for (const at::Tensor* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == k_buf.size(0) &&
                    t->size(1) == k_buf.size(1) && t->size(2) == nb,
                who, ": scales must be contiguous float16 [slots, Hkv, ", nb, "]");
  return {k_scale->data_ptr(), v_scale->data_ptr()};
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
// A quantized pool (int8 / float8 buffers) comes with its float16 block scales k_scale / v_scale
// [slots, Hkv, D / block]. Returns [T, H * D]. `variant`: "" for the best one this CPU runs at this head dim, or one by name
// (decode_attention_variants()), for tests and benchmarks.
at::Tensor decode_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_indices,
                            std::vector<int64_t> seq_lens, int64_t kv_start, int64_t window, double scale,
                            std::vector<int64_t> q_lens, const std::string& variant,
                            std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale,
                            std::optional<at::Tensor> sinks) {
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
  const auto [ks, vs] = sparkserve::kv_scales(k_buf, k_scale, v_scale, "decode_attention");
  at::Tensor sink;
  if (sinks.has_value()) {
    sink = sinks->contiguous();
    TORCH_CHECK(sink.scalar_type() == at::kFloat && sink.dim() == 1 && sink.size(0) == H,
                "decode_attention: sinks must be float32 [H]");
  }
  const sparkserve::PagedKV kv{k_buf.data_ptr(), v_buf.data_ptr(), k_buf.size(0), Hkv,
                               kv_indices.data_ptr<int64_t>(), kv_indices.stride(0), kv_start, window,
                               true, sparkserve::kv_type_of(k_buf), 0.f, ks, vs,
                               sink.defined() ? sink.data_ptr<float>() : nullptr};
  attend(variant_for(D, variant).kernels, q.data_ptr<float>(), q.stride(0), q.stride(1), H, D, kv,
         kv_kind(kv.type), seq_lens.data(), q_off.data(), B, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// The decode attention variants this CPU runs, best first.
std::vector<std::string> decode_attention_variants() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) names.push_back(v.name);
  return names;
}
