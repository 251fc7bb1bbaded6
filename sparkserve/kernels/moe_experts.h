// A MoE layer's routed experts held as their block weights (or, on the exact path, as fp32
// matrices), run for a few rows in one call (moe_experts.cpp; layers/moe_decode.py decides when).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace sparkserve {

class MoEExperts {
 public:
  static constexpr int64_t kSiluMul = 0;     // silu(gate) * up
  static constexpr int64_t kSwigluOai = 1;   // the clamped SwiGLU of GPT-OSS (alpha, limit)

  // Per local expert: gate|up blocks [2I, hidden] (gate rows first) and down blocks [hidden, I],
  // of one block type each (GGUF or the int8 kernels' packed form); optional fp32 biases
  // [experts, 2I] and [experts, hidden].
  MoEExperts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t qtype_gate_up,
             int64_t qtype_down, std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias,
             int64_t activation, double alpha, double limit);

  // The same experts as fp32 matrices: gate|up [experts, 2I, hidden] (gate rows first) and down
  // [experts, hidden, I], read in place (the MoE layer's parameters), each expert one fp32 GEMM as
  // the Python path's F.linear.
  static MoEExperts dense(at::Tensor gate_up, at::Tensor down, std::optional<at::Tensor> gate_up_bias,
                          std::optional<at::Tensor> down_bias, int64_t activation, double alpha, double limit);

  // sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, hidden]; ids outside [0, experts)
  // (another rank's) contribute nothing. int8: activations quantized as block_linear_int8 does.
  at::Tensor forward(at::Tensor x, at::Tensor weights, at::Tensor ids, bool int8) const;
  // The same on raw rows (the native step's MoE layers): x [T, hidden], weights / ids [T, k],
  // out [T, hidden] overwritten.
  void run(const float* x, int64_t T, const float* weights, const int64_t* ids, int64_t k, bool int8,
           float* out) const;
  int64_t hidden() const { return hidden_; }
  int64_t num_experts() const { return static_cast<int64_t>(gate_up_.size()); }

 private:
  MoEExperts() = default;
  void set_biases(std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias);
  std::vector<at::Tensor> gate_up_, down_;   // blocks per expert, or (dense_) fp32 [2I, d] / [d, I]
  bool dense_ = false;
  int64_t qtype_gate_up_, qtype_down_, activation_;
  float alpha_, limit_;
  at::Tensor gate_up_bias_, down_bias_;
  int64_t hidden_ = 0, inter_ = 0;
};

}  // namespace sparkserve
