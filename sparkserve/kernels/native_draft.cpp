// The DSpark draft's context injection in C++ (native_draft.h): the Python path's ops
// (DSparkDraft.inject) on the same kernels, so the two differ by fp32 rounding only.
#include "native_draft.h"

#include <ATen/ops/empty.h>

#include "block_linear.h"
#include "rms_norm.h"
#include "thread_pool.h"

namespace sparkserve {

NativeDraft::NativeDraft(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                         double eps, at::Tensor cos, at::Tensor sin, at::Tensor final_norm, at::Tensor fc,
                         int64_t fc_type, std::optional<at::Tensor> fc_bias, at::Tensor hidden_norm)
    : NativeLlama(hidden, heads, kv_heads, head_dim, intermediate, eps, cos, sin, final_norm),
      hidden_norm_(norm_weight(hidden_norm, hidden)) {
  const int64_t bytes = fc.dim() == 2 ? fc.size(1) : 0, per32 = block_bytes_of(static_cast<int>(fc_type));
  TORCH_CHECK(per32 > 0 && bytes % per32 == 0 && fc.size(0) == hidden,
              "native draft: fc must be [hidden, taps * hidden / 32 blocks]");
  fc_ = block_proj(fc, fc_type, fc_bias, bytes / per32 * 32);
}

void NativeDraft::inject(at::Tensor taps, at::Tensor positions, at::Tensor slots, bool int8) {
  TORCH_CHECK(taps.scalar_type() == at::kFloat && taps.dim() == 2 && taps.size(1) == fc_.k && taps.is_contiguous(),
              "native draft: taps must be contiguous float32 [T, ", fc_.k, "]");
  const int64_t T = taps.size(0);
  const int64_t* pos = long_ptr(positions, T, "positions");
  const int64_t* loc = long_ptr(slots, T, "slots");
  const SpinScope spinning;
  at::Tensor ctx = at::empty({T, hidden_}, taps.options());
  float* cp = ctx.data_ptr<float>();
  run_proj(fc_, taps.data_ptr<float>(), T, cp, int8);
  for (int64_t t = 0; t < T; ++t) rms_row(cp + t * hidden_, hidden_norm_.data_ptr<float>(), cp + t * hidden_, hidden_, eps_);
  store_kv_of(cp, T, pos, loc, int8);
}

}  // namespace sparkserve
