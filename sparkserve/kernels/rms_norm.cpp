// RMSNorm over the last dim of a contiguous fp32 tensor, alone or fused with the residual add
// before it: at batch-1 decode torch's rms_norm is ~15 us of small ops per call, 61 calls a token.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "rms_norm.h"
#include "simd.h"
#include "thread_pool.h"

namespace sparkserve {

// One row: y = x * (1 / sqrt(mean(x^2) + eps)) * w, in the order torch's rms_norm multiplies.
void rms_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= D; k += 16) {
    const __m256 a = _mm256_loadu_ps(x + k), b = _mm256_loadu_ps(x + k + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  float ss = hsum(_mm256_add_ps(acc0, acc1));
  for (; k < D; ++k) ss += x[k] * x[k];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  k = 0;
  for (; k + 8 <= D; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), rv), _mm256_loadu_ps(w + k)));
  for (; k < D; ++k) y[k] = x[k] * r * w[k];
}

}  // namespace sparkserve

namespace {

using sparkserve::rms_row;

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "rms_norm: x must be a contiguous float32 tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 &&
              w.size(0) == x.size(-1), "rms_norm: weight must be float32 [", x.size(-1), "]");
}

}  // namespace

// RMSNorm over the last dim of a contiguous float32 tensor.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_norm_args(x, w);
  auto y = at::empty_like(x);
  const int64_t D = x.size(-1), T = D ? x.numel() / D : 0;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  sparkserve::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_row(xp + t * D, wp, yp + t * D, D, static_cast<float>(eps));
  });
  return y;
}

// The residual add fused with the RMSNorm that follows it: s = x + r, returns (s, rms_norm(s) * w).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor r, at::Tensor w, double eps) {
  check_norm_args(x, w);
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == at::kFloat && r.is_contiguous(),
              "add_rms_norm: residual must be a contiguous float32 tensor shaped like x");
  auto s = at::empty_like(x);
  auto y = at::empty_like(x);
  const int64_t D = x.size(-1), T = D ? x.numel() / D : 0;
  const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  sparkserve::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t * D;
      int64_t k = 0;
      for (; k + 8 <= D; k += 8)
        _mm256_storeu_ps(sp + o + k, _mm256_add_ps(_mm256_loadu_ps(xp + o + k), _mm256_loadu_ps(rp + o + k)));
      for (; k < D; ++k) sp[o + k] = xp[o + k] + rp[o + k];
      rms_row(sp + o, wp, yp + o, D, static_cast<float>(eps));
    }
  });
  return {s, y};
}

