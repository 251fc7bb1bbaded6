// RMSNorm of one row as a C++ entry point (the native forward step calls it without Python).
#pragma once
#include <cstdint>

namespace sparkserve {

// y = x * (1 / sqrt(mean(x^2) + eps)) * w over D floats (y may be x).
void rms_row(const float* x, const float* w, float* y, int64_t D, float eps);

}  // namespace sparkserve
