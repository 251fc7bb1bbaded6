// The native forward step of a Llama-family decoder (native_llama.h). Each piece is the kernel the
// Python layer path calls too (block_linear, rms_row, paged_attention), so the two differ only
// where the Python path uses torch's own elementwise ops (rotary, SiLU, GeGLU, soft-cap): by fp32 rounding.
// Rows are few (decode, VERIFY, small extends), so the elementwise work runs on the calling
// thread and only the projections and attention split over the thread pool.
#include "native_llama.h"

#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "block_linear.h"
#include "int8_common.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "simd.h"
#include "thread_pool.h"

namespace sparkserve {
namespace {

// A rotary table pair: float32 [positions, rd] with rd even and <= head_dim (partial rotary: less).
void check_rope_table(const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) <= head_dim && cos.size(1) % 2 == 0 &&
              sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat,
              "native step: rotary tables must be float32 [positions, rotary dim <= head_dim]");
}

// Rotary (neox layout) on the first `rd` channels of one head in place (partial rotary leaves the
// rest); `sin` has rotate_half's sign folded in (layers/rotary.py): x' = x * cos + roll(x, rd/2) * sin.
void rotate(float* x, const float* cos, const float* sin, int64_t rd, float* tmp) {
  std::memcpy(tmp, x, rd * sizeof(float));
  const int64_t half = rd / 2;   // two loops, not an index modulo rd: they vectorize
  for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
  for (int64_t i = half; i < rd; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

// n heads [n, D] of one row in place: RMS norm by `norm` (when the model has one: per head, or
// over all n heads together when `full_width`), then rotary (unless a NoPE layer's: rope.cos null).
template <class Rope>
void norm_rotate(float* heads, int64_t n, const at::Tensor& norm, bool full_width, const Rope& rope, int64_t D,
                 float eps, float* tmp) {
  if (norm.defined() && full_width) rms_row(heads, norm.data_ptr<float>(), heads, n * D, eps);
  for (int64_t hd = 0; hd < n; ++hd) {
    float* x = heads + hd * D;
    if (norm.defined() && !full_width) rms_row(x, norm.data_ptr<float>(), x, D, eps);
    if (rope.cos != nullptr) rotate(x, rope.cos, rope.sin, rope.dim, tmp);
  }
}

// out = silu(g) * u over n floats; sigmoid from exp(-|g|) so the exp argument stays <= 0.
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_or_ps(gv, sign));                       // exp(-|g|)
    const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), gv);       // g < 0: e / (1 + e)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void add_into(float* acc, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) acc[i] += x[i];
}

// out = gelu_tanh(g) * u over n floats (torch's approximate="tanh": 0.5 g (1 + tanh(sqrt(2/pi)
// (g + 0.044715 g^3)))); tanh(a) = sign(a) (1 - e) / (1 + e) with e = exp(-2|a|) <= 1.
void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  const __m256 beta = _mm256_set1_ps(kBeta), kappa = _mm256_set1_ps(kKappa), m2 = _mm256_set1_ps(-2.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 cube = _mm256_mul_ps(gv, _mm256_mul_ps(gv, gv));
    const __m256 a = _mm256_mul_ps(beta, _mm256_add_ps(gv, _mm256_mul_ps(kappa, cube)));
    const __m256 e = exp256(_mm256_mul_ps(m2, _mm256_andnot_ps(sign, a)));   // exp(-2|a|)
    const __m256 t = _mm256_or_ps(_mm256_and_ps(sign, a),
                                  _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, gv), _mm256_add_ps(one, t));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i)
    out[i] = 0.5f * g[i] * (1.0f + std::tanh(kBeta * (g[i] + kKappa * g[i] * g[i] * g[i]))) * u[i];
}

// acc += x * s over n floats (s == 1: a plain residual add).
void add_scaled(float* acc, const float* x, float s, int64_t n) {
  if (s == 1.0f) return add_into(acc, x, n);
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), sv)));
  for (; i < n; ++i) acc[i] += x[i] * s;
}

// Layer l's scale buffer of a quantized pool, null for a float pool.
void* scale_of(const std::vector<at::Tensor>& scales, size_t l) {
  return l < scales.size() ? scales[l].data_ptr() : nullptr;
}

// n fp32 values (whole blocks of qb) into a quantized pool buffer at element offset `at`, their
// float16 block scales into `scales`: mem/kv_quant.py quantize's rounding step for step (scale
// amax / qmax rounded to float16, values divided by it, int8 rounded half to even and clamped,
// fp8 clamped then rounded by c10's conversion), so the native step and the layers store the same bytes.
template <class E>
void store_quantized(E* buf, c10::Half* scales, int64_t at, const float* x, int64_t n, int64_t qb, float qmax) {
  for (int64_t b0 = 0; b0 < n; b0 += qb) {
    float amax = 0.f;
    for (int64_t i = b0; i < b0 + qb; ++i) amax = std::max(amax, std::fabs(x[i]));
    const c10::Half d(amax / qmax);
    scales[(at + b0) / qb] = d;
    const float df = d;
    for (int64_t i = b0; i < b0 + qb; ++i) {
      const float y = df > 0.f ? x[i] / df : 0.f;
      if constexpr (std::is_same_v<E, int8_t>)
        buf[at + i] = static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.f, 127.f));
      else
        buf[at + i] = E(std::clamp(y, -qmax, qmax));
    }
  }
}

}  // namespace

// n fp32 values into a pool buffer of element type `type` at element offset `at`, rounded to
// nearest even as torch's .to() rounds them (the layer path's store), so both paths hold the same
// K/V; a quantized type's block scales (qb values each) go to `scales`.
void store_kv(void* buf, void* scales, int64_t at, const float* x, int64_t n, KVType type, int64_t qb) {
  auto* sc = static_cast<c10::Half*>(scales);
  switch (type) {
    case KVType::kInt8:
      return store_quantized(static_cast<int8_t*>(buf), sc, at, x, n, qb, 127.f);
    case KVType::kFp8E4M3:
      return store_quantized(static_cast<c10::Float8_e4m3fn*>(buf), sc, at, x, n, qb, 448.f);
    case KVType::kFp8E5M2:
      return store_quantized(static_cast<c10::Float8_e5m2*>(buf), sc, at, x, n, qb, 448.f);   // kv_quant.py
    case KVType::kFloat:
      std::memcpy(static_cast<float*>(buf) + at, x, n * sizeof(float));
      break;
    case KVType::kHalf:
      for (int64_t i = 0; i < n; ++i) static_cast<c10::Half*>(buf)[at + i] = c10::Half(x[i]);
      break;
    case KVType::kBFloat16:
      for (int64_t i = 0; i < n; ++i) static_cast<c10::BFloat16*>(buf)[at + i] = c10::BFloat16(x[i]);
      break;
  }
}

BlockProj block_proj(at::Tensor blocks, int64_t qtype, std::optional<at::Tensor> bias, int64_t k) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "native step: weight blocks must be contiguous 2-D uint8");
  TORCH_CHECK(k % 32 == 0 && blocks.size(1) == k / 32 * block_bytes_of(static_cast<int>(qtype)),
              "native step: weight blocks do not hold ", k, " inputs of type ", qtype);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == blocks.size(0), "native step: bad bias");
  }
  return {blocks, static_cast<int>(qtype), b, blocks.size(0), k};
}

void run_proj(const BlockProj& p, const float* x, int64_t rows, float* y, bool int8) {
  const float* bias = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  if (int8) block_linear_int8(x, rows, p.k, p.blocks, p.n, p.qtype, bias, y);
  else block_linear(x, rows, p.k, p.blocks.data_ptr<uint8_t>(), p.n, p.qtype, bias, y);
}

at::Tensor norm_weight(const at::Tensor& w, int64_t dim) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == dim && w.is_contiguous(),
              "native step: norm weight must be float32 [", dim, "]");
  return w;
}

const int64_t* long_ptr(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == n, "native step: ", what,
              " must be a contiguous int64 tensor of ", n, " values");
  return t.data_ptr<int64_t>();
}

NativeLlama::NativeLlama(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t intermediate, double eps, at::Tensor cos, at::Tensor sin, at::Tensor final_norm)
    : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
      eps_(static_cast<float>(eps)), attn_scale_(static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)))),
      cos_(cos.contiguous()), sin_(sin.contiguous()), final_norm_(norm_weight(final_norm, hidden)) {
  TORCH_CHECK(head_dim % 8 == 0 && kv_heads > 0 && heads % kv_heads == 0 && hidden % 32 == 0,
              "native step: head_dim must be a multiple of 8, heads of kv_heads, hidden of 32");
  check_rope_table(cos_, sin_, head_dim);
}

void NativeLlama::set_model_options(double attn_scale, double attn_softcap, double residual_scale,
                                    std::optional<at::Tensor> local_cos, std::optional<at::Tensor> local_sin) {
  if (attn_scale > 0) attn_scale_ = static_cast<float>(attn_scale);
  attn_softcap_ = static_cast<float>(std::max(attn_softcap, 0.0));
  residual_scale_ = static_cast<float>(residual_scale);
  TORCH_CHECK(local_cos.has_value() == local_sin.has_value(), "native step: local cos and sin come together");
  if (local_cos.has_value()) {
    local_cos_ = local_cos->contiguous();
    local_sin_ = local_sin->contiguous();
    check_rope_table(local_cos_, local_sin_, head_dim_);
    TORCH_CHECK(local_cos_.size(0) >= cos_.size(0), "native step: the local rope table is shorter than the global");
  }
}

NativeLlama::Rope NativeLlama::rope_at(const NativeLayer& L, int64_t p) const {
  if (!L.rope) return {nullptr, nullptr, 0};
  const at::Tensor& c = L.local_rope ? local_cos_ : cos_;
  const at::Tensor& s = L.local_rope ? local_sin_ : sin_;
  const int64_t rd = c.size(1);
  return {c.data_ptr<float>() + p * rd, s.data_ptr<float>() + p * rd, rd};
}

void NativeLlama::add_layer(at::Tensor qkv, int64_t qkv_type, std::optional<at::Tensor> qkv_bias, at::Tensor o,
                            int64_t o_type, at::Tensor gate_up, int64_t gate_up_type, at::Tensor down,
                            int64_t down_type, at::Tensor input_norm, at::Tensor post_norm,
                            std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, int64_t window) {
  NativeLayerOptions options;
  options.window = window;
  add_layer_with(qkv, qkv_type, qkv_bias, o, o_type, gate_up, gate_up_type, down, down_type, input_norm, post_norm,
                 q_norm, k_norm, options);
}

namespace {
at::Tensor optional_norm(const std::optional<at::Tensor>& w, int64_t dim) {
  return w.has_value() ? norm_weight(*w, dim) : at::Tensor();
}
}  // namespace

void NativeLlama::add_layer_with(at::Tensor qkv, int64_t qkv_type, std::optional<at::Tensor> qkv_bias,
                                 at::Tensor o, int64_t o_type, at::Tensor gate_up, int64_t gate_up_type,
                                 at::Tensor down, int64_t down_type, std::optional<at::Tensor> input_norm,
                                 std::optional<at::Tensor> mlp_norm, std::optional<at::Tensor> q_norm,
                                 std::optional<at::Tensor> k_norm, const NativeLayerOptions& options) {
  const int64_t D = head_dim_, I = intermediate_;
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "native step: q_norm and k_norm come together");
  TORCH_CHECK(options.attn_out_norm.has_value() == options.mlp_out_norm.has_value(),
              "native step: attn_out_norm and mlp_out_norm come together");
  const bool wide = options.qk_norm_full_width;
  const bool dense = gate_up.numel() > 0;     // else a MoE layer (set_layer_moe)
  at::Tensor sinks;
  if (options.sinks.has_value()) {
    sinks = options.sinks->contiguous();
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == heads_,
                "native step: sinks must be float32 [heads]");
  }
  NativeLayer l{block_proj(qkv, qkv_type, qkv_bias, hidden_), block_proj(o, o_type, options.o_bias, heads_ * D),
                dense ? block_proj(gate_up, gate_up_type, std::nullopt, hidden_) : BlockProj{},
                dense ? block_proj(down, down_type, std::nullopt, I) : BlockProj{},
                optional_norm(input_norm, hidden_), optional_norm(mlp_norm, hidden_),
                optional_norm(options.attn_out_norm, hidden_), optional_norm(options.mlp_out_norm, hidden_),
                optional_norm(q_norm, wide ? heads_ * D : D), optional_norm(k_norm, wide ? kv_heads_ * D : D),
                sinks, wide, options.gelu, options.rope, options.local_rope, options.window};
  TORCH_CHECK(l.qkv.n == (heads_ + 2 * kv_heads_) * D && l.o.n == hidden_ &&
                  (!dense || (l.gate_up.n == 2 * I && l.down.n == hidden_)),
              "native step: projection shapes do not match the config");
  TORCH_CHECK(!l.local_rope || local_cos_.defined(), "native step: set_model_options(local rope table) first");
  layers_.push_back(std::move(l));
}

void NativeLlama::set_layer_moe(int64_t layer, const MoEExperts& experts, at::Tensor router,
                                std::optional<at::Tensor> router_bias, int64_t top_k, bool renormalize,
                                bool softmax_of_topk, at::Tensor routed_counts, bool sigmoid_scores) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "native step: bad MoE layer ", layer);
  const int64_t E = experts.num_experts();
  TORCH_CHECK(experts.hidden() == hidden_ && top_k > 0 && top_k <= E, "native step: MoE shapes do not match");
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(0) == E &&
                  router.size(1) == hidden_,
              "native step: router weight must be float32 [experts, hidden]");
  TORCH_CHECK(routed_counts.scalar_type() == at::kLong && routed_counts.is_contiguous() &&
                  routed_counts.numel() == E,
              "native step: routed_counts must be a contiguous int64 [experts]");
  NativeLayer& L = layers_[layer];
  if (router_bias.has_value()) {
    L.router_bias = router_bias->contiguous();
    TORCH_CHECK(L.router_bias.scalar_type() == at::kFloat && L.router_bias.numel() == E,
                "native step: router bias must be float32 [experts]");
  }
  L.moe = std::make_shared<const MoEExperts>(experts);
  L.router = router.contiguous();
  L.routed_counts = routed_counts;
  L.top_k = top_k;
  L.renormalize = renormalize;
  L.softmax_of_topk = softmax_of_topk;
  L.sigmoid_scores = sigmoid_scores;
  TORCH_CHECK(!(sigmoid_scores && softmax_of_topk), "native step: one routing rule per MoE layer");
}

namespace {
// sum_c a[c] * b[c] in fp32, eight lanes then across them.
float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = 0.0f;
  for (float v : lanes) s += v;
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// MoE routing of rows x [T, d] (moe.py Router): the router's logits (+ its bias); Mixtral /
// Qwen3-MoE (softmax_topk): softmax over every expert, the top_k best, weights renormalized to sum
// 1 when asked; GPT-OSS (topk_softmax, softmax_of_topk): the top_k logits, softmaxed among
// themselves; MiniMax-M2 (sigmoid_grouped, one group; sigmoid_scores): sigmoid scores, the top_k by
// score + the correction bias, their plain scores renormalized when asked. Ties: the lower index.
void route(const NativeLayer& L, const float* x, int64_t T, int64_t d, float* weights, int64_t* ids) {
  const int64_t E = L.router.size(0), k = L.top_k;
  const float* w = L.router.data_ptr<float>();
  const float* bias = L.router_bias.defined() ? L.router_bias.data_ptr<float>() : nullptr;
  int64_t* counts = L.routed_counts.data_ptr<int64_t>();
  std::vector<float> p(E), choice(E);
  std::vector<int64_t> order(E);
  const float* logit_bias = L.sigmoid_scores ? nullptr : bias;     // sigmoid: the bias is the choice's
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * d;
    for (int64_t e = 0; e < E; ++e)
      p[e] = dot(row, w + e * d, d) + (logit_bias ? logit_bias[e] : 0.0f), order[e] = e;
    if (L.sigmoid_scores) {
      for (int64_t e = 0; e < E; ++e)
        p[e] = 1.0f / (1.0f + std::exp(-p[e])), choice[e] = p[e] + (bias ? bias[e] : 0.0f);
    } else if (!L.softmax_of_topk) {
      const float mx = *std::max_element(p.begin(), p.end());
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    }
    const std::vector<float>& rank = L.sigmoid_scores ? choice : p;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return rank[a] > rank[b] || (rank[a] == rank[b] && a < b);
    });
    float* wt = weights + t * k;
    for (int64_t j = 0; j < k; ++j) wt[j] = p[order[j]];
    if (L.softmax_of_topk) {      // the best logit is wt[0]
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += (wt[j] = std::exp(wt[j] - p[order[0]]));
      for (int64_t j = 0; j < k; ++j) wt[j] /= sum;
    } else if (L.renormalize) {
      float picked = 0.0f;
      for (int64_t j = 0; j < k; ++j) picked += wt[j];
      for (int64_t j = 0; j < k; ++j) wt[j] /= picked;
    }
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      ++counts[order[j]];
    }
  }
}
}  // namespace

void NativeLlama::set_pool(std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<int64_t> swa_layers) {
  TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "native step: one K and V per layer");
  for (size_t i = 0; i < k.size(); ++i)
    TORCH_CHECK(k[i].is_contiguous() && k[i].dim() == 3 && k[i].size(1) == kv_heads_ &&
                    k[i].size(2) == head_dim_ && v[i].sizes() == k[i].sizes() &&
                    v[i].scalar_type() == k[i].scalar_type() && v[i].is_contiguous(),
                "native step: pool buffers must be contiguous [slots, kv_heads, head_dim], K and V of one dtype");
  kv_type_ = k.empty() ? KVType::kFloat : kv_type_of(k[0]);
  for (const at::Tensor& t : k) TORCH_CHECK(kv_type_of(t) == kv_type_, "native step: one K/V dtype for all layers");
  own_slots_.assign(layers_.size(), false);
  for (int64_t l : swa_layers) {
    TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()), "native step: bad windowed layer ", l);
    own_slots_[l] = true;
  }
  k_ = std::move(k);
  v_ = std::move(v);
  k_scale_.clear(), v_scale_.clear();
}

void NativeLlama::set_pool_scales(std::vector<at::Tensor> k_scale, std::vector<at::Tensor> v_scale) {
  TORCH_CHECK(is_quantized(kv_type_), "native step: scales for a pool that is not quantized");
  TORCH_CHECK(k_scale.size() == k_.size() && v_scale.size() == k_.size(), "native step: one K and V scale per layer");
  const int64_t nb = head_dim_ / quant_block(head_dim_);
  for (size_t i = 0; i < k_.size(); ++i)
    for (const at::Tensor* t : {&k_scale[i], &v_scale[i]})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == k_[i].size(0) &&
                      t->size(1) == kv_heads_ && t->size(2) == nb,
                  "native step: scales must be contiguous float16 [slots, kv_heads, ", nb, "]");
  k_scale_ = std::move(k_scale);
  v_scale_ = std::move(v_scale);
}

void NativeLlama::check_positions(const int64_t* pos, int64_t T) const {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "native step: position ", pos[t], " beyond the rotary table");
}

void NativeLlama::store_kv_of(const float* x, int64_t T, const int64_t* pos, const int64_t* slots, bool int8) {
  TORCH_CHECK(k_.size() == layers_.size(), "native step: set_pool first");
  check_positions(pos, T);
  const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, KV = 2 * Hkv * D;
  if (kv_.size() != layers_.size()) {
    // The k|v rows of q|k|v as a projection of their own: a slice of the blocks' rows, which
    // keeps a packed type's groups whole when the q rows fill whole groups.
    for (const NativeLayer& L : layers_) {
      TORCH_CHECK(!int8::is_packed_type(L.qkv.qtype) || H * D % int8::kGroupRows == 0,
                  "native step: the q rows of a packed q|k|v must fill whole groups of ", int8::kGroupRows);
      std::optional<at::Tensor> bias;
      if (L.qkv.bias.defined()) bias = L.qkv.bias.narrow(0, H * D, KV);
      kv_.push_back(block_proj(L.qkv.blocks.narrow(0, H * D, KV), L.qkv.qtype, bias, hidden_));
    }
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    TORCH_CHECK(!own_slots_[l], "native step: context rows go to a pool without windowed layers");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < k_[l].size(0), "native step: slot ", slots[t], " out of range");
  }
  const SpinScope spinning;
  const int64_t qb = quant_block(D);
  TORCH_CHECK(!is_quantized(kv_type_) || k_scale_.size() == k_.size(), "native step: set_pool_scales first");
  at::Tensor kv = at::empty({T, KV}, at::kFloat);
  float* kvp = kv.data_ptr<float>();
  std::vector<float> rot(D);
  for (size_t l = 0; l < layers_.size(); ++l) {
    run_proj(kv_[l], x, T, kvp, int8);
    for (int64_t t = 0; t < T; ++t) {
      float* row = kvp + t * KV;
      const NativeLayer& L = layers_[l];
      norm_rotate(row, Hkv, L.k_norm, L.qk_full_width, rope_at(L, pos[t]), D, eps_, rot.data());
      store_kv(k_[l].data_ptr(), scale_of(k_scale_, l), slots[t] * Hkv * D, row, Hkv * D, kv_type_, qb);
      store_kv(v_[l].data_ptr(), scale_of(v_scale_, l), slots[t] * Hkv * D, row + Hkv * D, Hkv * D, kv_type_, qb);
    }
  }
}

std::vector<at::Tensor> NativeLlama::forward(at::Tensor x, at::Tensor positions, at::Tensor out_loc,
                                             at::Tensor kv_indices, int64_t kv_start,
                                             std::optional<at::Tensor> swa_out_loc,
                                             std::optional<at::Tensor> swa_kv_indices, int64_t swa_kv_start,
                                             std::vector<int64_t> seq_lens, std::vector<int64_t> q_lens,
                                             std::vector<int64_t> aux_layers, bool int8, bool causal) {
  TORCH_CHECK(k_.size() == layers_.size(), "native step: set_pool first");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_,
              "native step: x must be float32 [T, hidden]");
  const int64_t T = x.size(0), B = static_cast<int64_t>(seq_lens.size());
  const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, I = intermediate_, W = (H + 2 * Hkv) * D;
  const int64_t qb = quant_block(D);
  TORCH_CHECK(!is_quantized(kv_type_) || k_scale_.size() == k_.size(), "native step: set_pool_scales first");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.dim() == 2 && kv_indices.size(0) == B &&
              kv_indices.stride(1) == 1, "native step: kv_indices must be int64 [B, L], rows contiguous");
  const auto q_off = query_offsets(seq_lens, q_lens, kv_start, kv_indices.size(1));
  TORCH_CHECK(q_off[B] == T, "native step: x must have sum(q_lens) rows");
  const int64_t* pos = long_ptr(positions, T, "positions");
  check_positions(pos, T);

  // The two slot spaces (all layers', and a split pool's windowed layers'): where the new rows go
  // and how attention finds the keys.
  struct Slots {
    const int64_t* loc;
    at::Tensor idx;
    int64_t start;
    std::vector<int64_t> q_off;
  };
  Slots full{long_ptr(out_loc, T, "out_cache_loc"), kv_indices, kv_start, q_off}, swa{};
  if (swa_out_loc.has_value()) {
    TORCH_CHECK(swa_kv_indices.has_value() && swa_kv_indices->scalar_type() == at::kLong &&
                swa_kv_indices->dim() == 2 && swa_kv_indices->size(0) == B && swa_kv_indices->stride(1) == 1,
                "native step: swa_kv_indices must be int64 [B, L], rows contiguous");
    swa = {long_ptr(*swa_out_loc, T, "swa_out_cache_loc"), *swa_kv_indices, swa_kv_start,
           query_offsets(seq_lens, q_lens, swa_kv_start, swa_kv_indices->size(1))};
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Slots& s = own_slots_[l] ? swa : full;
    TORCH_CHECK(s.loc != nullptr, "native step: layer ", l, " needs the split pool's windowed slots");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(s.loc[t] >= 0 && s.loc[t] < k_[l].size(0), "native step: slot ", s.loc[t], " out of range");
  }

  const SpinScope spinning;   // ~150 jobs back to back: keep the workers awake between them
  auto opts = x.options();
  at::Tensor res = x.contiguous().clone();
  at::Tensor h = at::empty({T, hidden_}, opts), qkv = at::empty({T, W}, opts), attn = at::empty({T, H * D}, opts);
  at::Tensor gu = at::empty({T, 2 * I}, opts), act = at::empty({T, I}, opts), tmp = at::empty({T, hidden_}, opts);
  float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *qp = qkv.data_ptr<float>();
  float *ap = attn.data_ptr<float>(), *gp = gu.data_ptr<float>(), *cp = act.data_ptr<float>();
  float* tp = tmp.data_ptr<float>();
  std::vector<float> rot(D);
  int64_t max_k = 0;
  for (const NativeLayer& L : layers_) max_k = std::max(max_k, L.top_k);
  std::vector<float> route_w(T * max_k);
  std::vector<int64_t> route_ids(T * max_k);
  const float rs = residual_scale_;
  std::vector<at::Tensor> out(1);

  for (size_t l = 0; l < layers_.size(); ++l) {
    const NativeLayer& L = layers_[l];
    const Slots& s = own_slots_[l] ? swa : full;
    // a branch without an input norm (OLMo2) reads the residual stream itself
    if (L.input_norm.defined())
      for (int64_t t = 0; t < T; ++t)
        rms_row(rp + t * hidden_, L.input_norm.data_ptr<float>(), hp + t * hidden_, hidden_, eps_);
    run_proj(L.qkv, L.input_norm.defined() ? hp : rp, T, qp, int8);
    void* kb = k_[l].data_ptr();
    void* vb = v_[l].data_ptr();
    void *ksb = scale_of(k_scale_, l), *vsb = scale_of(v_scale_, l);
    for (int64_t t = 0; t < T; ++t) {
      float* row = qp + t * W;
      const Rope rope = rope_at(L, pos[t]);
      norm_rotate(row, H, L.q_norm, L.qk_full_width, rope, D, eps_, rot.data());
      norm_rotate(row + H * D, Hkv, L.k_norm, L.qk_full_width, rope, D, eps_, rot.data());
      store_kv(kb, ksb, s.loc[t] * Hkv * D, row + H * D, Hkv * D, kv_type_, qb);
      store_kv(vb, vsb, s.loc[t] * Hkv * D, row + (H + Hkv) * D, Hkv * D, kv_type_, qb);
    }
    const PagedKV kv{kb, vb, k_[l].size(0), Hkv, s.idx.data_ptr<int64_t>(), s.idx.stride(0), s.start, L.window,
                     causal, kv_type_, attn_softcap_, ksb, vsb,
                     L.sinks.defined() ? L.sinks.data_ptr<float>() : nullptr};
    paged_attention(qp, W, D, H, D, kv, seq_lens.data(), s.q_off.data(), B, attn_scale_, ap);
    run_proj(L.o, ap, T, tp, int8);
    for (int64_t t = 0; t < T; ++t) {
      float *r = rp + t * hidden_, *a = tp + t * hidden_;
      if (L.attn_out_norm.defined()) rms_row(a, L.attn_out_norm.data_ptr<float>(), a, hidden_, eps_);
      add_scaled(r, a, rs, hidden_);
      if (L.mlp_norm.defined()) rms_row(r, L.mlp_norm.data_ptr<float>(), hp + t * hidden_, hidden_, eps_);
    }
    const float* mlp_in = L.mlp_norm.defined() ? hp : rp;
    if (L.moe) {
      route(L, mlp_in, T, hidden_, route_w.data(), route_ids.data());
      L.moe->run(mlp_in, T, route_w.data(), route_ids.data(), L.top_k, int8, tp);
    } else {
      TORCH_CHECK(L.gate_up.blocks.defined(), "native step: layer ", l, " has neither an MLP nor experts");
      run_proj(L.gate_up, mlp_in, T, gp, int8);
      for (int64_t t = 0; t < T; ++t) {
        const float* g = gp + t * 2 * I;
        (L.gelu ? gelu_tanh_mul : silu_mul)(g, g + I, cp + t * I, I);
      }
      run_proj(L.down, cp, T, tp, int8);
    }
    if (L.mlp_out_norm.defined())
      for (int64_t t = 0; t < T; ++t)
        rms_row(tp + t * hidden_, L.mlp_out_norm.data_ptr<float>(), tp + t * hidden_, hidden_, eps_);
    add_scaled(rp, tp, rs, T * hidden_);
    if (std::find(aux_layers.begin(), aux_layers.end(), static_cast<int64_t>(l)) != aux_layers.end())
      out.push_back(res.clone());
  }
  const float* fw = final_norm_.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) rms_row(rp + t * hidden_, fw, hp + t * hidden_, hidden_, eps_);
  out[0] = h;
  return out;
}

}  // namespace sparkserve
