// The native forward step of a DeepSeek-V2 decoder (native_mla.h). The pieces are the kernels the
// Python layer path calls too (block_linear, rms_row, paged_attention, the MoE experts kernel),
// so the two differ by fp32 rounding only: the absorbed q / o products (einsum there, loops here),
// rotary, the router's dot products. fp32 weights (a width that is not whole blocks, an fp32
// checkpoint) run through ATen's mm and silu as the layers do.
#include "native_mla.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "block_linear.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "simd.h"
#include "thread_pool.h"

namespace sparkserve {
namespace {

constexpr int64_t kDenseType = -1;   // a projection given as an fp32 weight [n, k]

MLAProj make_proj(const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias, int64_t n,
                  int64_t k, const char* what) {
  MLAProj p;
  if (qtype == kDenseType) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == n && w.size(1) == k,
                "native MLA step: ", what, " must be float32 [", n, ", ", k, "]");
    p.dense = w.contiguous();
    if (bias.has_value() && bias->defined()) p.bias = bias->contiguous();
  } else {
    p.blocks = block_proj(w, qtype, bias, k);
    p.bias = p.blocks.bias;
    TORCH_CHECK(p.blocks.n == n, "native MLA step: ", what, " has ", p.blocks.n, " rows, not ", n);
  }
  TORCH_CHECK(!p.bias.defined() || (p.bias.scalar_type() == at::kFloat && p.bias.numel() == n),
              "native MLA step: ", what, "'s bias must be float32 [", n, "]");
  p.n = n, p.k = k;
  return p;
}

// y[rows, n] = x[rows, k] @ W.T (+ bias)
void run(const MLAProj& p, const float* x, int64_t rows, float* y, bool int8) {
  if (!p.dense.defined()) return run_proj(p.blocks, x, rows, y, int8);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor out = at::from_blob(y, {rows, p.n}, f32);
  at::mm_out(out, at::from_blob(const_cast<float*>(x), {rows, p.k}, f32), p.dense.t());
  if (p.bias.defined()) {
    const float* b = p.bias.data_ptr<float>();
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = 0; i < p.n; ++i) y[t * p.n + i] += b[i];
  }
}

// Rotary (neox halves) over rd channels in place; sin has rotate_half's sign folded in.
void rotate(float* x, const float* cos, const float* sin, int64_t rd, float* tmp) {
  std::memcpy(tmp, x, rd * sizeof(float));
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
  for (int64_t i = half; i < rd; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// A split kv_b half as blocks: `blocks` [heads * rows, k / 32 * block bytes] of `qtype`.
AbsorbedRows absorbed_blocks(const at::Tensor& blocks, int64_t qtype, int64_t heads, int64_t rows, int64_t k,
                             const char* what) {
  TORCH_CHECK(qtype >= 0 && k % 32 == 0 && blocks.dim() == 2 && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous() && blocks.size(0) == heads * rows &&
                  blocks.size(1) == k / 32 * block_bytes_of(static_cast<int>(qtype)),
              "native MLA step: ", what, " must be contiguous uint8 blocks [", heads * rows, ", ", k,
              " / 32 * block bytes]");
  AbsorbedRows a;
  a.blocks = blocks, a.qtype = static_cast<int>(qtype);
  a.rows = rows, a.k = k, a.row_bytes = blocks.size(1);
  return a;
}

// A half of the fp32 kv_b [heads, nope + v, r], read in place: the key half (offset 0) as
// W_uk^T's r rows over nope, the value half (offset nope) as its v rows over r.
AbsorbedRows absorbed_f32(const at::Tensor& kv_b, int64_t offset, int64_t rows, int64_t k) {
  AbsorbedRows a;
  a.f32 = kv_b, a.offset = offset, a.rows = rows, a.k = k;
  return a;
}

// y[i] = row i of head h . x, for the `rows` rows of head h
void head_rows_dot(const AbsorbedRows& a, int64_t h, const float* x, float* y) {
  if (a.blocks.defined()) {   // one x row: block_linear's single-row path, inline inside a job
    const uint8_t* w = a.blocks.data_ptr<uint8_t>() + h * a.rows * a.row_bytes;
    return block_linear(x, 1, a.k, w, a.rows, a.qtype, nullptr, y);
  }
  const int64_t width = a.f32.size(2), per_head = a.f32.size(1) * width;
  const float* w = a.f32.data_ptr<float>() + h * per_head + a.offset * width;
  if (a.offset > 0) {
    for (int64_t i = 0; i < a.rows; ++i) y[i] = dot(w + i * width, x, a.k);
    return;
  }
  // W_uk^T q = sum over the nope rows n of W_uk of q[n] * row n (rows of r: contiguous)
  std::fill_n(y, a.rows, 0.0f);
  for (int64_t n = 0; n < a.k; ++n) {
    const __m256 s = _mm256_set1_ps(x[n]);
    const float* wr = w + n * width;
    int64_t i = 0;
    for (; i + 8 <= a.rows; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(s, _mm256_loadu_ps(wr + i), _mm256_loadu_ps(y + i)));
    for (; i < a.rows; ++i) y[i] += x[n] * wr[i];
  }
}

void add_into(float* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

at::Tensor norm_of(const at::Tensor& w, int64_t dim) { return norm_weight(w.contiguous(), dim); }

}  // namespace

NativeExperts::NativeExperts(const MoEExperts* kernel, std::optional<at::Tensor> gate_up,
                             std::optional<at::Tensor> down) {
  TORCH_CHECK((kernel != nullptr) != (gate_up.has_value() && down.has_value()),
              "native MLA step: experts are either the MoE kernel's or fp32 gate_up and down");
  if (kernel != nullptr) {
    kernel_ = std::make_shared<const MoEExperts>(*kernel);
    hidden_ = kernel->hidden(), experts_ = kernel->num_experts();
    return;
  }
  gate_up_ = gate_up->contiguous(), down_ = down->contiguous();
  TORCH_CHECK(gate_up_.scalar_type() == at::kFloat && down_.scalar_type() == at::kFloat && gate_up_.dim() == 3 &&
                  down_.dim() == 3 && down_.size(0) == gate_up_.size(0) && down_.size(1) == gate_up_.size(2) &&
                  gate_up_.size(1) == 2 * down_.size(2),
              "native MLA step: fp32 experts must be gate_up [E, 2I, hidden] and down [E, hidden, I]");
  hidden_ = down_.size(1), experts_ = down_.size(0);
}

void NativeExperts::run(const float* x, int64_t T, const float* weights, const int64_t* ids, int64_t k,
                        bool int8, float* out) const {
  if (kernel_) return kernel_->run(x, T, weights, ids, k, int8, out);
  const int64_t d = hidden_, I = down_.size(2);
  std::fill_n(out, T * d, 0.0f);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (int64_t e = 0; e < experts_; ++e) {
    std::vector<int64_t> pairs;     // (token, slot) rows of expert e, in token order
    for (int64_t r = 0; r < T * k; ++r)
      if (ids[r] == e) pairs.push_back(r);
    if (pairs.empty()) continue;
    const int64_t n = static_cast<int64_t>(pairs.size());
    at::Tensor xs = at::empty({n, d}, f32);
    for (int64_t i = 0; i < n; ++i) std::copy_n(x + pairs[i] / k * d, d, xs.data_ptr<float>() + i * d);
    at::Tensor gu = at::mm(xs, gate_up_[e].t());
    at::Tensor y = at::mm(at::mul(at::silu(gu.narrow(1, 0, I)), gu.narrow(1, I, I)), down_[e].t()).contiguous();
    for (int64_t i = 0; i < n; ++i) {
      const float w = weights[pairs[i]];
      float* o = out + pairs[i] / k * d;
      const float* yr = y.data_ptr<float>() + i * d;
      for (int64_t c = 0; c < d; ++c) o[c] += w * yr[c];
    }
  }
}

NativeMLA::NativeMLA(int64_t hidden, int64_t heads, int64_t q_lora_rank, int64_t kv_lora_rank, int64_t nope,
                     int64_t rope, int64_t v_dim, double eps, double scale, at::Tensor cos, at::Tensor sin,
                     at::Tensor final_norm)
    : hidden_(hidden), heads_(heads), q_lora_(q_lora_rank), r_(kv_lora_rank), nope_(nope), rope_(rope),
      vd_(v_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)), cos_(cos.contiguous()),
      sin_(sin.contiguous()), final_norm_(norm_of(final_norm, hidden)) {
  TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.dim() == 2 && cos_.size(1) == rope && rope % 2 == 0 &&
                  sin_.sizes() == cos_.sizes() && sin_.scalar_type() == at::kFloat,
              "native MLA step: rotary tables must be float32 [positions, rope]");
  TORCH_CHECK((kv_lora_rank + rope) % 8 == 0, "native MLA step: kv_lora_rank + rope must be a multiple of 8");
}

void NativeMLA::add_layer(const MLALayerWeights& w) {
  const int64_t H = heads_, d = hidden_, qk = nope_ + rope_;
  Layer L;
  L.input_norm = norm_of(w.input_norm, d);
  L.mlp_norm = norm_of(w.mlp_norm, d);
  L.q_lora = q_lora_ > 0;
  TORCH_CHECK(L.q_lora == w.q_a.has_value() && L.q_lora == w.q_a_norm.has_value(),
              "native MLA step: q_a and its norm come with q_lora_rank > 0 only");
  if (L.q_lora) {
    L.q_a = make_proj(*w.q_a, w.q_a_type, w.q_a_bias, q_lora_, d, "q_a_proj");
    L.q_a_norm = norm_of(*w.q_a_norm, q_lora_);
  }
  L.q = make_proj(w.q, w.q_type, std::nullopt, H * qk, L.q_lora ? q_lora_ : d, "q_proj");
  L.kv_a = make_proj(w.kv_a, w.kv_a_type, w.kv_a_bias, r_ + rope_, d, "kv_a_proj_with_mqa");
  L.kv_a_norm = norm_of(w.kv_a_norm, r_);
  TORCH_CHECK(w.kv_b.has_value() != (w.k_b.has_value() && w.v_b.has_value()) &&
                  w.k_b.has_value() == w.v_b.has_value(),
              "native MLA step: kv_b is either fp32 or its k_b and v_b halves' blocks");
  if (w.kv_b.has_value()) {
    const at::Tensor& kv_b = *w.kv_b;
    TORCH_CHECK(kv_b.scalar_type() == at::kFloat && kv_b.is_contiguous() && kv_b.dim() == 2 &&
                    kv_b.size(0) == H * (nope_ + vd_) && kv_b.size(1) == r_,
                "native MLA step: kv_b must be contiguous float32 [heads * (nope + v), kv_lora_rank]");
    const at::Tensor heads = kv_b.view({H, nope_ + vd_, r_});
    L.w_uk = absorbed_f32(heads, 0, r_, nope_);
    L.w_uv = absorbed_f32(heads, nope_, vd_, r_);
  } else {
    L.w_uk = absorbed_blocks(*w.k_b, w.k_b_type, H, r_, nope_, "k_b");
    L.w_uv = absorbed_blocks(*w.v_b, w.v_b_type, H, vd_, r_, "v_b");
  }
  L.o = make_proj(w.o, w.o_type, w.o_bias, d, H * vd_, "o_proj");
  L.q_a_eps = static_cast<float>(w.q_a_eps), L.kv_a_eps = static_cast<float>(w.kv_a_eps);
  layers_.push_back(std::move(L));
}

void NativeMLA::set_dense_mlp(int64_t layer, const NativeExperts& mlp) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "native MLA step: bad layer ", layer);
  TORCH_CHECK(mlp.hidden() == hidden_ && mlp.num_experts() == 1, "native MLA step: a dense MLP is one expert");
  layers_[layer].mlp = std::make_shared<const NativeExperts>(mlp);
}

void NativeMLA::set_moe(int64_t layer, const NativeExperts& routed, const NativeExperts* shared, at::Tensor router,
                        int64_t top_k, int64_t groups, int64_t topk_groups, double scaling,
                        at::Tensor routed_counts) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "native MLA step: bad layer ", layer);
  const int64_t E = routed.num_experts();
  TORCH_CHECK(routed.hidden() == hidden_ && (shared == nullptr || (shared->hidden() == hidden_ &&
                                                                   shared->num_experts() == 1)),
              "native MLA step: MoE shapes do not match");
  TORCH_CHECK(top_k > 0 && top_k <= E && groups > 0 && E % groups == 0 && topk_groups > 0 && topk_groups <= groups,
              "native MLA step: bad routing (top_k ", top_k, ", groups ", groups, ", topk_groups ", topk_groups, ")");
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(0) == E &&
                  router.size(1) == hidden_,
              "native MLA step: router weight must be float32 [experts, hidden]");
  TORCH_CHECK(routed_counts.scalar_type() == at::kLong && routed_counts.is_contiguous() &&
                  routed_counts.numel() == E,
              "native MLA step: routed_counts must be a contiguous int64 [experts]");
  Layer& L = layers_[layer];
  L.mlp = std::make_shared<const NativeExperts>(routed);
  L.shared = shared == nullptr ? nullptr : std::make_shared<const NativeExperts>(*shared);
  L.router = router.contiguous();
  L.routed_counts = routed_counts;
  L.top_k = top_k, L.groups = groups, L.topk_groups = topk_groups;
  L.scaling = static_cast<float>(scaling);
}

void NativeMLA::set_pool(std::vector<at::Tensor> latent, std::optional<std::vector<at::Tensor>> scales) {
  TORCH_CHECK(latent.size() == layers_.size(), "native MLA step: one latent buffer per layer");
  const int64_t W = r_ + rope_;
  const KVType type = latent.empty() ? KVType::kFloat : kv_type_of(latent[0]);
  for (const at::Tensor& t : latent)
    TORCH_CHECK(kv_type_of(t) == type && t.is_contiguous() && t.dim() == 2 && t.size(1) == W,
                "native MLA step: latent buffers must be contiguous [slots, kv_lora_rank + rope] of one dtype");
  TORCH_CHECK(is_quantized(type) == scales.has_value(),
              "native MLA step: a quantized latent comes with its scales, a float one without");
  latent_scale_.clear();
  if (scales.has_value()) {
    TORCH_CHECK(scales->size() == latent.size(), "native MLA step: one scale buffer per layer");
    const int64_t nb = W / quant_block(W);
    for (size_t i = 0; i < latent.size(); ++i) {
      const at::Tensor& s = (*scales)[i];
      TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 2 &&
                      s.size(0) == latent[i].size(0) && s.size(1) == nb,
                  "native MLA step: latent scales must be contiguous float16 [slots, ", nb, "]");
    }
    latent_scale_ = std::move(*scales);
  }
  kv_type_ = type;
  latent_ = std::move(latent);
}

// DeepSeek-V2 routing of rows x [T, d] (moe.py softmax_greedy): softmax over every expert; with
// groups, the experts outside the topk_groups groups of best single score count 0; the top_k
// best (ties: the lower index), times scaling, never renormalized.
void NativeMLA::route(const Layer& L, const float* x, int64_t T, float* weights, int64_t* ids) const {
  const int64_t E = L.router.size(0), k = L.top_k, d = hidden_, G = L.groups, per = E / G;
  const float* w = L.router.data_ptr<float>();
  int64_t* counts = L.routed_counts.data_ptr<int64_t>();
  std::vector<float> p(E), best(G);
  std::vector<int64_t> order(E), group_order(G);
  const auto before = [](const std::vector<float>& s) {
    return [&s](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
  };
  for (int64_t t = 0; t < T; ++t) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, p[e] = dot(x + t * d, w + e * d, d));
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum, order[e] = e;
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {
        best[g] = *std::max_element(p.begin() + g * per, p.begin() + (g + 1) * per);
        group_order[g] = g;
      }
      std::partial_sort(group_order.begin(), group_order.begin() + L.topk_groups, group_order.end(), before(best));
      std::vector<bool> keep(G, false);
      for (int64_t j = 0; j < L.topk_groups; ++j) keep[group_order[j]] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) p[e] = 0.0f;
    }
    std::partial_sort(order.begin(), order.begin() + k, order.end(), before(p));
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      weights[t * k + j] = p[order[j]] * L.scaling;
      ++counts[order[j]];
    }
  }
}

std::vector<at::Tensor> NativeMLA::forward(at::Tensor x, at::Tensor positions, at::Tensor out_loc,
                                           at::Tensor kv_indices, int64_t kv_start, std::vector<int64_t> seq_lens,
                                           std::vector<int64_t> q_lens, std::vector<int64_t> aux_layers,
                                           bool int8) {
  TORCH_CHECK(latent_.size() == layers_.size(), "native MLA step: set_pool first");
  for (const Layer& L : layers_) TORCH_CHECK(L.mlp, "native MLA step: a layer without its MLP");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_,
              "native MLA step: x must be float32 [T, hidden]");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.dim() == 2 &&
                  kv_indices.size(0) == static_cast<int64_t>(seq_lens.size()) && kv_indices.stride(1) == 1,
              "native MLA step: kv_indices must be int64 [B, L], rows contiguous");
  const int64_t T = x.size(0), B = static_cast<int64_t>(seq_lens.size()), d = hidden_, H = heads_;
  const int64_t r = r_, R = rope_, W = r_ + rope_, qk = nope_ + rope_, nope = nope_, vd = vd_;
  const auto q_off = query_offsets(seq_lens, q_lens, kv_start, kv_indices.size(1));
  TORCH_CHECK(q_off[B] == T, "native MLA step: x must have sum(q_lens) rows");
  const int64_t* pos = long_ptr(positions, T, "positions");
  const int64_t* loc = long_ptr(out_loc, T, "out_cache_loc");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "native MLA step: position ", pos[t], " beyond the rotary table");
    for (const at::Tensor& buf : latent_)
      TORCH_CHECK(loc[t] >= 0 && loc[t] < buf.size(0), "native MLA step: slot ", loc[t], " out of range");
  }

  const SpinScope spinning;
  auto opts = x.options();
  at::Tensor res = x.contiguous().clone(), h = at::empty({T, d}, opts), tmp = at::empty({T, d}, opts);
  at::Tensor shared_out = at::empty({T, d}, opts), qa = at::empty({T, std::max<int64_t>(q_lora_, 1)}, opts);
  at::Tensor q = at::empty({T, H * qk}, opts), kv = at::empty({T, W}, opts), qf = at::empty({T, H * W}, opts);
  at::Tensor att = at::empty({T, H * W}, opts), ov = at::empty({T, H * vd}, opts);
  float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *tp = tmp.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kvp = kv.data_ptr<float>(), *qfp = qf.data_ptr<float>();
  float *ap = att.data_ptr<float>(), *ovp = ov.data_ptr<float>(), *sp = shared_out.data_ptr<float>();
  int64_t max_k = 1;
  for (const Layer& L : layers_) max_k = std::max(max_k, L.top_k);
  std::vector<float> route_w(T * max_k), ones(T, 1.0f), rot(R);
  std::vector<int64_t> route_ids(T * max_k), zeros(T, 0);
  std::vector<at::Tensor> out(1);

  const float *cosp = cos_.data_ptr<float>(), *sinp = sin_.data_ptr<float>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const float* in_norm = L.input_norm.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) rms_row(rp + t * d, in_norm, hp + t * d, d, eps_);
    if (L.q_lora) {
      float* qap = qa.data_ptr<float>();
      const float* q_a_norm = L.q_a_norm.data_ptr<float>();
      run(L.q_a, hp, T, qap, int8);
      for (int64_t t = 0; t < T; ++t) rms_row(qap + t * q_lora_, q_a_norm, qap + t * q_lora_, q_lora_, L.q_a_eps);
      run(L.q, qap, T, qp, int8);
    } else {
      run(L.q, hp, T, qp, int8);
    }
    // the new tokens' latents: kv_a_layernorm(c_kv) | rotated k_pe
    run(L.kv_a, hp, T, kvp, int8);
    void* lat = latent_[l].data_ptr();
    void* lat_scale = latent_scale_.empty() ? nullptr : latent_scale_[l].data_ptr();
    const float* kv_a_norm = L.kv_a_norm.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      float* row = kvp + t * W;
      rms_row(row, kv_a_norm, row, r, L.kv_a_eps);
      rotate(row + r, cosp + pos[t] * R, sinp + pos[t] * R, R, rot.data());
      store_kv(lat, lat_scale, loc[t] * W, row, W, kv_type_, quant_block(W));
    }
    // per (token, head): the latent query [W_uk^T q_nope | rotated q_pe]
    parallel_for(0, T * H, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch(R);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t t = i / H;
        float* qrow = qp + i * qk;
        float* dst = qfp + i * W;
        rotate(qrow + nope, cosp + pos[t] * R, sinp + pos[t] * R, R, scratch.data());
        head_rows_dot(L.w_uk, i % H, qrow, dst);
        std::memcpy(dst + r, qrow + nope, R * sizeof(float));
      }
    });
    const PagedKV pkv{lat, lat, latent_[l].size(0), 1, idx, kv_indices.stride(0), kv_start, 0, true,
                      kv_type_, 0.0f, lat_scale, lat_scale};
    paged_attention(qfp, H * W, W, H, W, pkv, seq_lens.data(), q_off.data(), B, scale_, ap);
    // per (token, head): the attended latent's first r channels back through W_uv
    parallel_for(0, T * H, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) head_rows_dot(L.w_uv, i % H, ap + i * W, ovp + i * vd);
    });
    run(L.o, ovp, T, tp, int8);
    add_into(rp, tp, T * d);
    const float* mlp_norm = L.mlp_norm.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) rms_row(rp + t * d, mlp_norm, hp + t * d, d, eps_);
    if (L.router.defined()) {
      route(L, hp, T, route_w.data(), route_ids.data());
      L.mlp->run(hp, T, route_w.data(), route_ids.data(), L.top_k, int8, tp);
      if (L.shared) {
        L.shared->run(hp, T, ones.data(), zeros.data(), 1, int8, sp);
        add_into(tp, sp, T * d);
      }
    } else {
      L.mlp->run(hp, T, ones.data(), zeros.data(), 1, int8, tp);
    }
    add_into(rp, tp, T * d);
    if (std::find(aux_layers.begin(), aux_layers.end(), static_cast<int64_t>(l)) != aux_layers.end())
      out.push_back(res.clone());
  }
  for (int64_t t = 0; t < T; ++t) rms_row(rp + t * d, final_norm_.data_ptr<float>(), hp + t * d, d, eps_);
  out[0] = h;
  return out;
}

at::Tensor absorbed_head_rows(at::Tensor x, at::Tensor blocks, int64_t qtype) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.device().is_cpu(),
              "absorbed_head_rows: x must be float32 [T, heads, k]");
  const int64_t T = x.size(0), H = x.size(1), k = x.size(2);
  TORCH_CHECK(H > 0 && blocks.dim() == 2 && blocks.size(0) % H == 0, "absorbed_head_rows: blocks must hold ",
              "the same rows for each of the ", H, " heads");
  const AbsorbedRows a = absorbed_blocks(blocks, qtype, H, blocks.size(0) / H, k, "blocks");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({T, H, a.rows}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_for(0, T * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) head_rows_dot(a, i % H, xp + i * k, yp + i * a.rows);
  });
  return y;
}

}  // namespace sparkserve
