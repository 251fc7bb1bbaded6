// The paged attention kernel of decode_attention.cpp as a C++ entry point (the native forward
// step calls it once per layer without going through Python).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace sparkserve {

// What the pool's K/V buffers hold (--kv-cache-dtype); the kernel computes in fp32 either way. The
// last three are quantized (mem/kv_quant.py): int8 or fp8 elements with a float16 scale per block
// of `qb` values of a head's row, in buffers of their own ([slots, Hkv, D / qb]).
enum class KVType { kFloat, kHalf, kBFloat16, kInt8, kFp8E4M3, kFp8E5M2 };

inline bool is_quantized(KVType t) { return t >= KVType::kInt8; }

// Values per scale of a quantized pool (mem/kv_quant.py block_size): 32, or the whole row.
inline int64_t quant_block(int64_t D) { return D % 32 == 0 ? 32 : D; }

// The KVType of a pool buffer (an error for other dtypes).
KVType kv_type_of(const at::Tensor& t);

// One layer's K/V pool buffers [slots, Hkv, D] of element `type` and the batch's slot table:
// request b's key at position kv_start + j lives in slot idx[b * idx_stride + j]; window <= 0:
// none. Not causal: every query of a request sees all its keys (a DSpark draft's block, whose
// rows are stored last).
struct PagedKV {
  const void* k;
  const void* v;
  int64_t slots, Hkv;
  const int64_t* idx;
  int64_t idx_stride, kv_start, window;
  bool causal = true;
  KVType type = KVType::kFloat;
  float softcap = 0.f;   // > 0: scores pass through softcap * tanh(score / softcap) (Gemma 2)
  const void* k_scale = nullptr;   // a quantized type's float16 block scales [slots, Hkv, D / qb]
  const void* v_scale = nullptr;
  // [H] per query head, or null: a logit that joins each softmax's denominator and attends to
  // nothing (GPT-OSS's attention sinks). The decode kernel takes it; the prefill kernel does not.
  const float* sinks = nullptr;
};

// The scale buffers of a quantized pool as the kernels read them, after checking that they fit
// the element buffers k_buf / v_buf (undefined tensors for other types; `who` names the caller).
std::pair<const void*, const void*> kv_scales(const at::Tensor& k_buf, const std::optional<at::Tensor>& k_scale,
                                               const std::optional<at::Tensor>& v_scale, const char* who);

// Request b's queries are rows q_off[b] .. q_off[b+1] - 1 of q (row stride qs0, head stride qs1),
// at positions seq_lens[b] - their count .. seq_lens[b] - 1. out: [T, H * D].
void paged_attention(const float* q, int64_t qs0, int64_t qs1, int64_t H, int64_t D, const PagedKV& kv,
                     const int64_t* seq_lens, const int64_t* q_off, int64_t B, float scale, float* out);

// Row offsets of each request's queries (B + 1 entries), after checking that every query
// position lies in the gathered range [kv_start, kv_start + gathered).
std::vector<int64_t> query_offsets(const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& q_lens,
                                   int64_t kv_start, int64_t gathered);

}  // namespace sparkserve
