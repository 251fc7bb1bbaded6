// Routed experts of a MoE layer for a few rows in one call (decode and small batches): the rows are
// grouped per selected expert in C++ and each expert runs its gate|up and down block projections
// (block_linear / block_linear_int8) once over its rows, with the gated activation and the routing
// weights applied between them. The Python path (layers/moe.py grouped_experts) does the same with
// ~30 small torch calls per layer, which at batch 1 cost far more than the experts' arithmetic.
#include "moe_experts.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>

#include "block_linear.h"

namespace sparkserve {

namespace {

void check_blocks(const at::Tensor& w, int64_t rows, int64_t k, int64_t qtype, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == rows &&
                  k % 32 == 0 && w.size(1) == k / 32 * block_bytes_of(static_cast<int>(qtype)),
              "moe_experts: ", what, " blocks must be contiguous uint8 [", rows, ", ", k, " inputs of type ",
              qtype, "]");
}

void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// GPT-OSS / MiniMax: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
void swiglu_oai_mul(const float* g, const float* u, float* out, int64_t n, float alpha, float limit) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = std::min(g[i], limit), ui = std::min(std::max(u[i], -limit), limit);
    out[i] = (ui + 1.0f) * gi / (1.0f + std::exp(-alpha * gi));
  }
}

// y[n, N] = x[n, K] @ w.T (+ bias) for an fp32 matrix w [N, K]: the GEMM F.linear runs.
void dense_linear(const float* x, int64_t n, const at::Tensor& w, const float* bias, float* y) {
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::from_blob(y, {n, N}, at::kFloat);
  at::mm_out(out, at::from_blob(const_cast<float*>(x), {n, K}, at::kFloat), w.t());
  if (bias != nullptr)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < N; ++c) y[i * N + c] += bias[c];
}

}  // namespace

MoEExperts::MoEExperts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t qtype_gate_up,
                       int64_t qtype_down, std::optional<at::Tensor> gate_up_bias,
                       std::optional<at::Tensor> down_bias, int64_t activation, double alpha, double limit)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), qtype_gate_up_(qtype_gate_up),
      qtype_down_(qtype_down), activation_(activation), alpha_(static_cast<float>(alpha)),
      limit_(static_cast<float>(limit)) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "moe_experts: one gate|up and down per expert");
  TORCH_CHECK(activation == kSiluMul || activation == kSwigluOai, "moe_experts: unknown activation ", activation);
  const int64_t E = static_cast<int64_t>(gate_up_.size());
  hidden_ = down_[0].size(0);
  inter_ = gate_up_[0].size(0) / 2;
  for (int64_t e = 0; e < E; ++e) {
    check_blocks(gate_up_[e], 2 * inter_, hidden_, qtype_gate_up_, "gate|up");
    check_blocks(down_[e], hidden_, inter_, qtype_down_, "down");
  }
  set_biases(gate_up_bias, down_bias);
}

MoEExperts MoEExperts::dense(at::Tensor gate_up, at::Tensor down, std::optional<at::Tensor> gate_up_bias,
                             std::optional<at::Tensor> down_bias, int64_t activation, double alpha, double limit) {
  TORCH_CHECK(activation == kSiluMul || activation == kSwigluOai, "moe_experts: unknown activation ", activation);
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat && gate_up.dim() == 3 &&
                  down.dim() == 3 && gate_up.size(0) == down.size(0) && gate_up.size(0) > 0 &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(2) == down.size(1),
              "moe_experts: dense experts must be float32 gate|up [E, 2I, hidden] and down [E, hidden, I]");
  MoEExperts m;
  m.dense_ = true;
  m.activation_ = activation;
  m.alpha_ = static_cast<float>(alpha);
  m.limit_ = static_cast<float>(limit);
  m.hidden_ = down.size(1);
  m.inter_ = down.size(2);
  for (int64_t e = 0; e < gate_up.size(0); ++e) {
    m.gate_up_.push_back(gate_up[e].contiguous());
    m.down_.push_back(down[e].contiguous());
  }
  m.set_biases(gate_up_bias, down_bias);
  return m;
}

void MoEExperts::set_biases(std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias) {
  const int64_t E = static_cast<int64_t>(gate_up_.size());
  if (gate_up_bias.has_value()) {
    gate_up_bias_ = gate_up_bias->contiguous();
    TORCH_CHECK(gate_up_bias_.scalar_type() == at::kFloat && gate_up_bias_.dim() == 2 &&
                    gate_up_bias_.size(0) == E && gate_up_bias_.size(1) == 2 * inter_,
                "moe_experts: gate|up bias must be float32 [experts, 2 * intermediate]");
  }
  if (down_bias.has_value()) {
    down_bias_ = down_bias->contiguous();
    TORCH_CHECK(down_bias_.scalar_type() == at::kFloat && down_bias_.dim() == 2 && down_bias_.size(0) == E &&
                    down_bias_.size(1) == hidden_,
                "moe_experts: down bias must be float32 [experts, hidden]");
  }
}

at::Tensor MoEExperts::forward(at::Tensor x, at::Tensor weights, at::Tensor ids, bool int8) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_,
              "moe_experts: x must be float32 [T, hidden]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == x.size(0),
              "moe_experts: ids must be int64 [T, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes(),
              "moe_experts: weights must be float32 [T, k] like ids");
  x = x.contiguous();
  weights = weights.contiguous();
  ids = ids.contiguous();
  at::Tensor out = at::empty({x.size(0), hidden_}, x.options());
  run(x.data_ptr<float>(), x.size(0), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), ids.size(1), int8,
      out.data_ptr<float>());
  return out;
}

void MoEExperts::run(const float* xp, int64_t T, const float* wp, const int64_t* ip, int64_t k, bool int8,
                     float* op) const {
  const int64_t E = static_cast<int64_t>(gate_up_.size()), d = hidden_, I = inter_;
  std::fill_n(op, T * d, 0.0f);
  // (token, slot) pairs by expert, in token order within an expert (as the stable argsort)
  std::vector<std::vector<int64_t>> rows(E);
  for (int64_t r = 0; r < T * k; ++r)
    if (ip[r] >= 0 && ip[r] < E) rows[ip[r]].push_back(r);
  std::vector<float> xs, gu, act, ys;
  for (int64_t e = 0; e < E; ++e) {
    const auto& pairs = rows[e];
    const int64_t n = static_cast<int64_t>(pairs.size());
    if (n == 0) continue;
    xs.resize(n * d);
    gu.resize(n * 2 * I);
    act.resize(n * I);
    ys.resize(n * d);
    for (int64_t i = 0; i < n; ++i) std::copy_n(xp + pairs[i] / k * d, d, xs.data() + i * d);
    const float* gb = gate_up_bias_.defined() ? gate_up_bias_.data_ptr<float>() + e * 2 * I : nullptr;
    const float* db = down_bias_.defined() ? down_bias_.data_ptr<float>() + e * d : nullptr;
    const int qg = static_cast<int>(qtype_gate_up_), qd = static_cast<int>(qtype_down_);
    if (dense_) dense_linear(xs.data(), n, gate_up_[e], gb, gu.data());
    else if (int8) block_linear_int8(xs.data(), n, d, gate_up_[e], 2 * I, qg, gb, gu.data());
    else block_linear(xs.data(), n, d, gate_up_[e].data_ptr<uint8_t>(), 2 * I, qg, gb, gu.data());
    for (int64_t i = 0; i < n; ++i) {
      const float* g = gu.data() + i * 2 * I;
      if (activation_ == kSiluMul) silu_mul(g, g + I, act.data() + i * I, I);
      else swiglu_oai_mul(g, g + I, act.data() + i * I, I, alpha_, limit_);
    }
    if (dense_) dense_linear(act.data(), n, down_[e], db, ys.data());
    else if (int8) block_linear_int8(act.data(), n, I, down_[e], d, qd, db, ys.data());
    else block_linear(act.data(), n, I, down_[e].data_ptr<uint8_t>(), d, qd, db, ys.data());
    for (int64_t i = 0; i < n; ++i) {
      const float w = wp[pairs[i]];
      float* o = op + pairs[i] / k * d;
      const float* y = ys.data() + i * d;
      for (int64_t c = 0; c < d; ++c) o[c] += w * y[c];
    }
  }
}

}  // namespace sparkserve
