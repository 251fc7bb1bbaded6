// One call per forward for a Llama-family decoder (or a DSpark draft's backbone) on one rank: every
// layer's norms, q|k|v projection, optional q/k norm, rotary, K/V store, paged attention, o
// projection, gate|up, SiLU, down projection and the residual adds, in C++ over the block-weight
// kernels. For decode,
// VERIFY and small extends, where the Python layer path spends most of its time between ~15
// small torch calls per layer rather than in them. The Python path stays the reference
// (sparkserve/models/llama_native.py and dspark_native.py decide when this one applies).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

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

struct NativeLayer {
  BlockProj qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm, q_norm, k_norm;   // q/k norm undefined unless the model has them
  int64_t window;          // <= 0: full attention
};

class NativeLlama {
 public:
  NativeLlama(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
              double eps, at::Tensor cos, at::Tensor sin, at::Tensor final_norm);

  void add_layer(at::Tensor qkv, int64_t qkv_type, std::optional<at::Tensor> qkv_bias, at::Tensor o,
                 int64_t o_type, at::Tensor gate_up, int64_t gate_up_type, at::Tensor down, int64_t down_type,
                 at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, int64_t window);

  // The pool's per-layer K and V buffers [slots, kv_heads, head_dim], fp32, contiguous, and the
  // layers that index a split pool's windowed slot space.
  void set_pool(std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<int64_t> swa_layers);

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
  float eps_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<NativeLayer> layers_;
  std::vector<at::Tensor> k_, v_;
  KVType kv_type_ = KVType::kFloat;   // what the pool buffers hold
  std::vector<bool> own_slots_;   // per layer: reads and writes the windowed slot space
  std::vector<BlockProj> kv_;     // per layer: the k|v rows of q|k|v (store_kv_of; made on first use)
};

}  // namespace sparkserve
