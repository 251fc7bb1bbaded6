// One call per forward for a Llama-family decoder (or a DSpark draft's backbone) on one rank: every
// layer's norms, q|k|v projection, optional q/k norm, rotary, K/V store, paged attention, o
// projection, gate|up, SiLU / GeGLU, down projection and the residual adds, in C++ over the
// block-weight kernels; a layer's departures from Llama (Gemma 3's sandwich norms and local rope,
// SmolLM3's NoPE layers, GPT-OSS's sinks and o bias, ...) are its NativeLayerOptions; MoE layers
// (Mixtral, Qwen3-MoE, GPT-OSS) route in C++ and run a MoEExperts. For decode,
// VERIFY and small extends, where the Python layer path spends most of its time between ~15
// small torch calls per layer rather than in them. The Python path stays the reference
// (sparkserve/models/llama_native.py and dspark_native.py decide when this one applies).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moe_experts.h"
#include "paged_attention.h"

namespace sparkserve {

// A projection's weight as N rows of GGUF blocks of `qtype` (and an optional fp32 bias).
struct BlockProj {
  at::Tensor blocks;
  int qtype;
  at::Tensor bias;        // undefined when none
  int64_t n, k;
};

// The pieces the native draft (native_draft.cpp) shares with the step (native_llama.cpp).
BlockProj block_proj(at::Tensor blocks, int64_t qtype, std::optional<at::Tensor> bias, int64_t k);
void run_proj(const BlockProj& p, const float* x, int64_t rows, float* y, bool int8);
at::Tensor norm_weight(const at::Tensor& w, int64_t dim);
const int64_t* long_ptr(const at::Tensor& t, int64_t n, const char* what);
// n fp32 values into a pool buffer of element `type` at element offset `at`, rounded as the layer
// path's store rounds them; a quantized type's float16 block scales (qb values each) into `scales`.
void store_kv(void* buf, void* scales, int64_t at, const float* x, int64_t n, KVType type, int64_t qb);

// What a layer computes beyond a Llama layer (the defaults are Llama's), set by the Python side
// from ModelConfig (models/llama_native.py build).
struct NativeLayerOptions {
  // Norms of a branch's output before its residual add: Gemma's sandwich (post_attention_ and
  // post_feedforward_layernorm) and OLMo2's post norms. Both or neither.
  std::optional<at::Tensor> attn_out_norm, mlp_out_norm;
  std::optional<at::Tensor> o_bias;   // the o projection's bias (GPT-OSS)
  std::optional<at::Tensor> sinks;    // float32 [heads]: GPT-OSS's attention sinks (PagedKV.sinks)
  bool qk_norm_full_width = false;   // q/k norms over the whole q and k rows, before the heads (OLMo2)
  bool gelu = false;          // GeGLU (tanh approximation) instead of SwiGLU
  bool rope = true;           // false: a NoPE layer (SmolLM3) leaves q and k unrotated
  bool local_rope = false;    // rotates by the local table (Gemma 3's sliding layers)
  int64_t window = 0;         // <= 0: full attention
};

struct NativeLayer {
  BlockProj qkv, o, gate_up, down;
  // undefined when the layer has none: the input norms of attention and of the MLP (OLMo2 has
  // neither), the branch output norms, q/k norms
  at::Tensor input_norm, mlp_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm, sinks;
  bool qk_full_width, gelu, rope, local_rope;
  int64_t window;
  // A MoE layer's MLP (set_layer_moe; null: the dense gate_up / down): its routed experts, the
  // router's fp32 weight [experts, hidden] and optional bias [experts] (softmax over every expert,
  // the top_k best, renormalized to sum 1 when `renormalize`: Mixtral / Qwen3-MoE; or with
  // `softmax_of_topk` the top_k logits, then a softmax over those: GPT-OSS; or with `sigmoid_scores`
  // sigmoid scores, the top_k by score + router_bias (the score-correction bias, for the choice only),
  // weighted by their scores: MiniMax-M2), and the per-expert (token, slot) counts it adds to.
  std::shared_ptr<const MoEExperts> moe = nullptr;
  at::Tensor router = {}, router_bias = {}, routed_counts = {};
  int64_t top_k = 0;
  bool renormalize = false, softmax_of_topk = false, sigmoid_scores = false;
};

class NativeLlama {
 public:
  NativeLlama(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
              double eps, at::Tensor cos, at::Tensor sin, at::Tensor final_norm);

  void add_layer(at::Tensor qkv, int64_t qkv_type, std::optional<at::Tensor> qkv_bias, at::Tensor o,
                 int64_t o_type, at::Tensor gate_up, int64_t gate_up_type, at::Tensor down, int64_t down_type,
                 at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, int64_t window);
  // Any layer: the attention's and the MLP's input norms (Llama's input_ and
  // post_attention_layernorm, Gemma's input_ and pre_feedforward_layernorm; None: the branch reads
  // the residual stream itself) and its departures from a Llama layer.
  void add_layer_with(at::Tensor qkv, int64_t qkv_type, std::optional<at::Tensor> qkv_bias, at::Tensor o,
                      int64_t o_type, at::Tensor gate_up, int64_t gate_up_type, at::Tensor down,
                      int64_t down_type, std::optional<at::Tensor> input_norm, std::optional<at::Tensor> mlp_norm,
                      std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                      const NativeLayerOptions& options);

  // Layer `layer` (added with empty gate_up / down blocks) computes its MLP as a mixture of experts,
  // routed as NativeLayer describes. routed_counts: int64 [experts], incremented in place per
  // (token, slot) routed (the MoE block's routed_tokens, which /metrics reads).
  void set_layer_moe(int64_t layer, const MoEExperts& experts, at::Tensor router,
                     std::optional<at::Tensor> router_bias, int64_t top_k, bool renormalize, bool softmax_of_topk,
                     at::Tensor routed_counts, bool sigmoid_scores);

  // Model-wide departures: the attention scale (<= 0: 1/sqrt(head_dim)), the attention scores'
  // soft-cap (<= 0: none; Gemma 2), the factor both branches' outputs take before their residual
  // add (Granite), and the local rope table (cos, sin as the global ones; needed by layers with
  // local_rope).
  void set_model_options(double attn_scale, double attn_softcap, double residual_scale,
                         std::optional<at::Tensor> local_cos, std::optional<at::Tensor> local_sin);

  // The pool's per-layer K and V buffers [slots, kv_heads, head_dim], fp32, contiguous, and the
  // layers that index a split pool's windowed slot space.
  void set_pool(std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<int64_t> swa_layers);
  // A quantized pool's (int8 / float8 K/V buffers) per-layer float16 block scales [slots, kv_heads,
  // head_dim / block], after set_pool: the step stores its K/V quantized as mem/kv_quant.py does.
  void set_pool_scales(std::vector<at::Tensor> k_scale, std::vector<at::Tensor> v_scale);

  // x: [T, hidden] embeddings of the batch's tokens (request after request, q_lens[b] each, at
  // positions seq_lens[b] - q_lens[b] ..). Writes the new K/V at out_loc (a windowed layer of a
  // split pool: swa_out_loc) and attends through kv_indices / swa_kv_indices as
  // ForwardBatch.kv_view describes. Returns [final normed hidden, then the residual stream after
  // each layer listed in aux_layers, in layer order]. int8: the projections quantize their
  // inputs to int8 blocks (block_linear_int8), as the layers do under --activation-quant int8.
  // causal false: each request's rows all see each other (a DSpark draft's block pass).
  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor positions, at::Tensor out_loc, at::Tensor kv_indices,
                                  int64_t kv_start, std::optional<at::Tensor> swa_out_loc,
                                  std::optional<at::Tensor> swa_kv_indices, int64_t swa_kv_start,
                                  std::vector<int64_t> seq_lens, std::vector<int64_t> q_lens,
                                  std::vector<int64_t> aux_layers, bool int8, bool causal);

 protected:
  // Every layer's K and V of the hidden rows x [T, hidden] (already the layers' input: no input
  // norm) at positions `pos`, stored at `slots`: the k|v part of the q|k|v projection, k norm, rotary.
  void store_kv_of(const float* x, int64_t T, const int64_t* pos, const int64_t* slots, bool int8);
  void check_positions(const int64_t* pos, int64_t T) const;

  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  // Layer L's rope rows at position p and how many leading channels of a head they turn (partial
  // rotary: fewer than head_dim); cos null on a NoPE layer.
  struct Rope {
    const float *cos, *sin;
    int64_t dim;
  };
  Rope rope_at(const NativeLayer& L, int64_t p) const;

  float eps_;
  float attn_scale_, attn_softcap_ = 0.0f, residual_scale_ = 1.0f;
  at::Tensor cos_, sin_, final_norm_, local_cos_, local_sin_;
  std::vector<NativeLayer> layers_;
  std::vector<at::Tensor> k_, v_;
  std::vector<at::Tensor> k_scale_, v_scale_;   // a quantized pool's block scales (set_pool_scales)
  KVType kv_type_ = KVType::kFloat;   // what the pool buffers hold
  std::vector<bool> own_slots_;   // per layer: reads and writes the windowed slot space
  std::vector<BlockProj> kv_;     // per layer: the k|v rows of q|k|v (store_kv_of; made on first use)
};

}  // namespace sparkserve
