// One call per forward for a DeepSeek-V2 decoder on one rank (native_mla.cpp): every layer's MLA
// attention the absorbed way (q through q_a / q_a_layernorm / q_b or one q_proj; kv_a, its
// layernorm and the decoupled rope of k_pe into the latent pool; q_nope folded into the latent
// through kv_b's key half; the paged decode kernel over the latent read in place as one shared
// K = V head; the value half back per head; o_proj), then the dense SwiGLU MLP of the first layers
// or the MoE of the rest (softmax routing, greedy or group-limited, times routed_scaling_factor;
// routed experts plus the shared ones). For decode, VERIFY and small extends, where the Python
// layer path (models/deepseek_v2.py, layers/mla.py) spends its time between ~40 small torch calls
// per layer. The Python path stays the reference (models/deepseek_v2_native.py decides when
// this one applies).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "native_llama.h"

namespace sparkserve {

// A projection: GGUF / packed blocks (BlockProj), or an fp32 weight [n, k] where the layer holds
// no blocks (a width that is not whole blocks, an fp32 checkpoint).
struct MLAProj {
  BlockProj blocks;
  at::Tensor dense, bias;   // dense undefined: the blocks; bias undefined: none
  int64_t n = 0, k = 0;
};

// A set of gated SiLU MLPs run by (row, slot) routing: the MoE kernel's block experts, or fp32
// gate|up [E, 2I, hidden] and down [E, hidden, I] (a dense MLP or the shared experts: E = 1).
class NativeExperts {
 public:
  NativeExperts(const MoEExperts* kernel, std::optional<at::Tensor> gate_up, std::optional<at::Tensor> down);
  // out [T, hidden] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]).
  void run(const float* x, int64_t T, const float* weights, const int64_t* ids, int64_t k, bool int8,
           float* out) const;
  int64_t hidden() const { return hidden_; }
  int64_t num_experts() const { return experts_; }

 private:
  std::shared_ptr<const MoEExperts> kernel_;
  at::Tensor gate_up_, down_;
  int64_t hidden_ = 0, experts_ = 0;
};

// A layer's attention weights as the Python side hands them over (models/deepseek_v2_native.py):
// each projection as (weight, type, bias) with type -1 for an fp32 weight [n, k], else blocks.
struct MLALayerWeights {
  at::Tensor input_norm, mlp_norm;
  std::optional<at::Tensor> q_a, q_a_bias, q_a_norm;   // q_lora_rank > 0 only
  int64_t q_a_type = -1;
  at::Tensor q;                      // q_proj, or q_b_proj after q_a
  int64_t q_type = -1;
  at::Tensor kv_a, kv_a_norm;
  std::optional<at::Tensor> kv_a_bias, o_bias;
  int64_t kv_a_type = -1;
  // kv_b as the Python layer holds it (layers/mla.py AbsorbedKvB), read in place, never copied:
  // fp32 [heads * (nope + v), kv_lora_rank], or (a GGUF's split attn_k_b / attn_v_b) the halves'
  // blocks, rows per head: k_b [heads * kv_lora_rank, nope] (W_uk^T) and v_b [heads * v,
  // kv_lora_rank] (W_uv), each read with fp32 activations.
  std::optional<at::Tensor> kv_b, k_b, v_b;
  int64_t k_b_type = -1, v_b_type = -1;
  at::Tensor o;
  int64_t o_type = -1;
  double q_a_eps = 1e-6, kv_a_eps = 1e-6;
};

// One of kv_b's halves per head as rows to dot with a per-head vector: the key half transposed
// (W_uk^T [heads, r, nope]: latent query row j = W_uk^T[j] . q_nope) or the value half ([heads, v, r]).
// Either the whole fp32 kv_b [heads, nope + v, r] (the key half then summed over its nope rows,
// so no transposed copy is made) or the half's blocks [heads * rows, k / 32 * block bytes].
struct AbsorbedRows {
  at::Tensor f32;          // fp32 kv_b, or undefined
  int64_t offset = 0;      // the half's first row of a head in kv_b: 0 (key, transposed) or nope
  at::Tensor blocks;       // the half's blocks, or undefined
  int qtype = 0;
  int64_t rows = 0, k = 0, row_bytes = 0;
};

// y [T, H, rows] = per (token, head) the rows of head h of a split kv_b half in `blocks` ([H * rows,
// k / 32 * block bytes] of `qtype`) . x [T, H, k], fp32 activations: the Python layer path's
// absorbed products (layers/mla.py) on the same code the native step runs.
at::Tensor absorbed_head_rows(at::Tensor x, at::Tensor blocks, int64_t qtype);

class NativeMLA {
 public:
  // rope tables: the decoupled rope's cos / sin [positions, rope] (halves layout, sin's sign
  // folded as layers/rotary.py builds them); scale: the softmax scale (YaRN's mscale in it).
  NativeMLA(int64_t hidden, int64_t heads, int64_t q_lora_rank, int64_t kv_lora_rank, int64_t nope,
            int64_t rope, int64_t v_dim, double eps, double scale, at::Tensor cos, at::Tensor sin,
            at::Tensor final_norm);

  void add_layer(const MLALayerWeights& w);
  // Layer `layer`'s MLP: a dense one (one expert), or routed experts with optional shared ones
  // (always on, weight 1) and the router: fp32 [experts, hidden], softmax over every expert, only
  // the `topk_groups` of `groups` groups with the best single score kept (groups > 1), the top_k
  // best, times `scaling`; routed_counts int64 [experts] counts each (token, slot) (/metrics).
  void set_dense_mlp(int64_t layer, const NativeExperts& mlp);
  void set_moe(int64_t layer, const NativeExperts& routed, const NativeExperts* shared, at::Tensor router,
               int64_t top_k, int64_t groups, int64_t topk_groups, double scaling, at::Tensor routed_counts);

  // The pool's per-layer latent buffers [slots, kv_lora_rank + rope], contiguous: float32, or a
  // quantized type (--kv-cache-dtype int8 / fp8) with its float16 block scales [slots, blocks].
  void set_pool(std::vector<at::Tensor> latent, std::optional<std::vector<at::Tensor>> scales);

  // x: [T, hidden] embeddings (request after request, q_lens[b] each, at positions seq_lens[b] -
  // q_lens[b] ..); the new latents go to out_loc, attention reads kv_indices from kv_start
  // (ForwardBatch.kv_view). Returns [final normed hidden, then the residual stream after each of
  // aux_layers]. int8: projections quantize their inputs (--activation-quant int8).
  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor positions, at::Tensor out_loc, at::Tensor kv_indices,
                                  int64_t kv_start, std::vector<int64_t> seq_lens, std::vector<int64_t> q_lens,
                                  std::vector<int64_t> aux_layers, bool int8);

 private:
  struct Layer {
    at::Tensor input_norm, mlp_norm, q_a_norm, kv_a_norm;
    bool q_lora;
    MLAProj q_a, q, kv_a, o;
    AbsorbedRows w_uk, w_uv;   // kv_b's halves: W_uk^T [heads, r, nope] and W_uv [heads, v, r]
    float q_a_eps, kv_a_eps;
    std::shared_ptr<const NativeExperts> mlp, shared;   // mlp: dense, or the routed experts
    at::Tensor router, routed_counts;
    int64_t top_k = 0, groups = 1, topk_groups = 1;
    float scaling = 1.0f;
  };
  void route(const Layer& L, const float* x, int64_t T, float* weights, int64_t* ids) const;

  int64_t hidden_, heads_, q_lora_, r_, nope_, rope_, vd_;
  float eps_, scale_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> latent_, latent_scale_;
  KVType kv_type_ = KVType::kFloat;
};

}  // namespace sparkserve
