// A DSpark draft's backbone as one native step (NativeLlama, non-causal block passes) plus its
// context injection: committed target rows' taps -> fc -> hidden norm -> each layer's K/V in the
// draft pool. Injection runs once per verify cycle beside the block pass, and from Python it is
// ~10 small torch calls over a row or two.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

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

 private:
  BlockProj fc_;
  at::Tensor hidden_norm_;
};

}  // namespace sparkserve
