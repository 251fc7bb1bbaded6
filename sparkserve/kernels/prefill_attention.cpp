// Paged attention of prefill chunks (more queries per request than decode_attention.cpp keeps
// scores for), K/V read in place from the pool through the request's slot ids. The torch path
// gathers a padded copy of every request's K/V each layer and hands SDPA a mask, under which it
// computes the whole rectangle, masked half included, and pads short requests to the longest.
// Here each request's queries are cut into tiles of 48 rows on AVX-512, 24 on AVX2 (queries x the
// G heads of one kv head; prefill_tile.h), and a tile reads only the keys its rows see. Work items
// are tiles, the costliest (last) first, over the kernels' thread pool. Where the CPU has AVX-512
// VNNI an int8 pool's q . k scores are integer dot products, each query row rounded to int8 as the
// decode kernel rounds it (prefill_attention_avx512vnni.cpp). "avx512vnni" in
// SPARKSERVE_KERNEL_VARIANTS_OFF keeps the float scores, "avx512" leaves the ymm tiles; "avx2" too
// leaves none, and the caller keeps SDPA. fp32 otherwise: results differ from SDPA by summation
// order and exp rounding.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "block_linear.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "thread_pool.h"

namespace {

// A tile computation and its rows.
struct Variant {
  const char* name;
  void (*tile)(const sparkserve::prefill::Tile&);
  int64_t rows;
};

// The variants this CPU runs, best first ("avx2" is always built).
std::vector<Variant> runnable() {
  std::vector<Variant> v;
#ifdef SPARKSERVE_HAS_PREFILL_AVX512VNNI
  if (sparkserve::isa_usable("avx512") && sparkserve::isa_usable("avx512vnni"))
    v.push_back({"avx512vnni", sparkserve::prefill::tile_avx512vnni, 48});
#endif
#ifdef SPARKSERVE_HAS_PREFILL_AVX512
  if (sparkserve::isa_usable("avx512")) v.push_back({"avx512", sparkserve::prefill::tile_avx512, 48});
#endif
  if (sparkserve::isa_usable("avx2")) v.push_back({"avx2", sparkserve::prefill::tile_avx2, 24});
  return v;
}

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = runnable();   // the environment is read once
  return v;
}

// Whether v's tiles take heads of this shape: whole vectors of head dim, the query heads of one kv
// head within a tile.
bool takes(const Variant& v, int64_t H, int64_t Hkv, int64_t D) {
  return D > 0 && D % 16 == 0 && Hkv > 0 && H % Hkv == 0 && H / Hkv <= v.rows;
}

struct Item {
  int64_t b, h, i0, nq, keys;
};

}  // namespace

// The variant prefill_attention runs ("avx512vnni", "avx512", "avx2"), or "" where none can.
std::string prefill_attention_variant() { return variants().empty() ? "" : variants()[0].name; }

// The variants this CPU runs, best first.
std::vector<std::string> prefill_attention_variants() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) names.push_back(v.name);
  return names;
}

// Whether prefill_attention runs here for H query heads over Hkv kv heads of head dim D.
bool prefill_attention_takes(int64_t H, int64_t Hkv, int64_t D) {
  return !variants().empty() && takes(variants()[0], H, Hkv, D);
}

// decode_attention's arguments and result (q [T, H, D], pool buffers [slots, Hkv, D], kv_indices
// [B, >= L], request b's q_lens[b] queries at positions seq_len - q_lens[b] .. seq_len - 1, causal,
// window <= 0: none; a quantized pool's float16 block scales k_scale / v_scale), for heads the
// variant takes (prefill_attention_takes). `variant` names one to
// use instead of the best (it must run on this CPU).
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_indices,
                             std::vector<int64_t> seq_lens, int64_t kv_start, int64_t window, double scale,
                             std::vector<int64_t> q_lens, const std::string& variant,
                             std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
  const Variant* use = nullptr;
  for (const Variant& v : variants())
    if (use == nullptr && (variant.empty() || variant == v.name)) use = &v;
  TORCH_CHECK(use != nullptr, "prefill_attention: no variant ", variant.empty() ? "" : variant + " ",
              "runs here (prefill_attention_variant())");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1,
              "prefill_attention: q must be float32 [T, H, D], last dim contiguous");
  TORCH_CHECK(v_buf.scalar_type() == k_buf.scalar_type() && k_buf.dim() == 3 && k_buf.is_contiguous() &&
              v_buf.sizes() == k_buf.sizes() && v_buf.is_contiguous(),
              "prefill_attention: K/V buffers must be contiguous [slots, Hkv, D] of one dtype");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.dim() == 2 && kv_indices.stride(1) == 1,
              "prefill_attention: kv_indices must be int64 [B, L], rows contiguous");
  const int64_t B = kv_indices.size(0), H = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D && takes(*use, H, Hkv, D),
              "prefill_attention: head_dim must match and be a multiple of 16, H a multiple of Hkv, at most ",
              use->rows, " query heads per kv head");
  TORCH_CHECK(static_cast<int64_t>(seq_lens.size()) == B, "prefill_attention: one seq_len per kv_indices row");
  const auto q_off = sparkserve::query_offsets(seq_lens, q_lens, kv_start, kv_indices.size(1));
  TORCH_CHECK(q.size(0) == q_off[B], "prefill_attention: q must have sum(q_lens) rows");
  const int kv_type = static_cast<int>(sparkserve::kv_type_of(k_buf));
  const auto [k_sc, v_sc] = sparkserve::kv_scales(k_buf, k_scale, v_scale, "prefill_attention");
  const int64_t G = H / Hkv, per_tile = use->rows / G, slots = k_buf.size(0);
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = seq_lens[b] - kv_start;      // gathered keys of the request's last query
    for (int64_t j = std::max<int64_t>(0, window > 0 ? end - q_lens[b] + 1 - window : 0); j < end; ++j) {
      const int64_t slot = idx[b * kv_indices.stride(0) + j];
      TORCH_CHECK(slot >= 0 && slot < slots, "prefill_attention: slot id out of range");
    }
    for (int64_t i0 = 0; i0 < q_lens[b]; i0 += per_tile) {
      const int64_t nq = std::min(per_tile, q_lens[b] - i0), last = end - q_lens[b] + i0 + nq;
      const int64_t keys = last - (window > 0 ? std::max<int64_t>(0, last - nq + 1 - window) : 0);
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({b, h, i0, nq, keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  auto out = at::empty({q_off[B], H * D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  sparkserve::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> scratch;
    const int64_t need = sparkserve::prefill::scratch_floats(D) + 16;
    if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
    float* aligned = scratch.data() + (16 - reinterpret_cast<uintptr_t>(scratch.data()) / sizeof(float) % 16) % 16;
    for (int64_t w = w0; w < w1; ++w) {
      const Item& it = items[w];
      const int64_t t0 = q_off[it.b] + it.i0;
      sparkserve::prefill::Tile t{qp + t0 * q.stride(0) + it.h * G * q.stride(1), q.stride(0), q.stride(1),
                                  op + t0 * H * D + it.h * G * D, H * D, D,
                                  it.nq, G, D, k_buf.data_ptr(), v_buf.data_ptr(), kv_type,
                                  idx + it.b * kv_indices.stride(0), Hkv, it.h,
                                  seq_lens[it.b] - kv_start - q_lens[it.b] + it.i0 + 1, window, sc, aligned,
                                  static_cast<const uint16_t*>(k_sc), static_cast<const uint16_t*>(v_sc),
                                  sparkserve::quant_block(D)};
      use->tile(t);
    }
  });
  return out;
}
