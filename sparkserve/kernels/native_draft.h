// A DSpark draft's backbone as one native step (NativeLlama, non-causal block passes) plus its
// context injection: committed target rows' taps -> fc -> hidden norm -> each layer's K/V in the
// draft pool; and, with its heads set, a whole greedy draft pass: block pass, LM head, Markov
// loop, confidence. Each runs once per verify cycle, and from Python each is a run of small torch
// calls over a few rows.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "native_llama.h"

namespace sparkserve {

class NativeDraft : public NativeLlama {
 public:
  NativeDraft(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              at::Tensor cos, at::Tensor sin, at::Tensor final_norm, at::Tensor fc, int64_t fc_type,
              std::optional<at::Tensor> fc_bias, at::Tensor hidden_norm);

  // taps: [T, taps * hidden] fp32, the tapped target rows side by side (DSparkDraft.inject's
  // concatenation); their K/V go to the pool at `slots` for positions `positions`.
  void inject(at::Tensor taps, at::Tensor positions, at::Tensor slots, bool int8);

  // The heads propose() runs after the backbone: the mask token's embedding [hidden]; the LM
  // head's blocks (draft vocab V); the Markov head's W1 [vocab, r] and W2 as markov_pack lays it
  // out, d2t [V] (None: draft ids are target ids); the confidence head's weight ([hidden], or
  // [hidden + r] when it reads the Markov code too; None: no head) and bias; `block` rows per
  // block, the first `shift` of which lead the drafts.
  void set_heads(at::Tensor mask_emb, at::Tensor lm_head, int64_t lm_type, std::optional<at::Tensor> lm_bias,
                 at::Tensor w1, at::Tensor w2p, std::optional<at::Tensor> d2t, std::optional<at::Tensor> conf_w,
                 double conf_b, int64_t block, int64_t shift);

  // One greedy draft pass for B requests: anchors [B] target ids, anchor_emb [B, hidden] their
  // embeddings, each at position anchor_pos[b] (empty: ctx_lens[b]) after its injected context
  // kv_indices[b, :ctx_lens[b]] (rows left out of a context make anchor_pos[b] > ctx_lens[b]);
  // request b's mask rows are mask_rows[b] ([B, hidden]; None: the mask token's embedding for all,
  // a fused draft's differ per request); the blocks' own K/V go to block_slots[b * block ..].
  // Returns (tokens [B, block - shift] target ids, confidence [B, block - shift], empty without a
  // head); both empty, having run nothing, when a context holds slot 0 (a gap a sliding-window
  // target left, which only the Python path masks).
  std::tuple<at::Tensor, at::Tensor> propose(at::Tensor anchors, at::Tensor anchor_emb, at::Tensor kv_indices,
                                             std::vector<int64_t> ctx_lens, at::Tensor block_slots, bool int8,
                                             std::optional<at::Tensor> mask_rows, std::vector<int64_t> anchor_pos);

 private:
  BlockProj fc_;
  at::Tensor hidden_norm_;
  // the heads (set_heads)
  at::Tensor mask_emb_, w1_, w2p_, d2t_, conf_w_;
  BlockProj lm_;
  float conf_b_ = 0.0f;
  int64_t block_ = 0, shift_ = 0;
};

}  // namespace sparkserve
