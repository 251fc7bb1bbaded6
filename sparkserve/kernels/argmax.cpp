// Greedy decoding's argmax over each row of the logits, on the kernels' threads.
//
// torch's CPU argmax walks a row with an index beside every compare, and for a batch it opens an
// OpenMP region, whose threads then stay awake beside the next native step. Here a row is two
// vector passes: its maximum (and whether it holds a NaN), then the first place it is reached.
#include <torch/extension.h>

#include <immintrin.h>

#include <cmath>
#include <limits>

#include "thread_pool.h"

namespace {

// The first index of the row's largest value; the first NaN's when there is one (torch.argmax).
int64_t row_argmax(const float* x, int64_t n) {
  __m256 top8[4], nan8 = _mm256_setzero_ps();
  for (auto& t : top8) t = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      top8[j] = _mm256_max_ps(top8[j], v);
    }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(top8[0], top8[1]), _mm256_max_ps(top8[2], top8[3])));
  float top = lanes[0];
  for (float v : lanes) top = std::max(top, v);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int64_t k = i; k < n; ++k) {
    nan = nan || std::isnan(x[k]);
    top = std::max(top, x[k]);
  }
  if (nan) {
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  }
  const __m256 t = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return 0;
}

}  // namespace

// logits [N, V] float32 with contiguous rows -> [N] int64.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "argmax_rows takes float32 [N, V] with contiguous rows, V > 0");
  const int64_t N = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({N}, at::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  sparkserve::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) ids[r] = row_argmax(x + r * stride, V);
  });
  return out;
}
