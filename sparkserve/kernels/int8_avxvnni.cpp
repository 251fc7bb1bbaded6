// Int8 kernel, AVX-VNNI variant (int8_avxvnni_body.h). Built with -mavx2 -mfma -mf16c -mavxvnni
// (build.py); run only where the CPU has avx_vnni (int8_dispatch.cpp).
#include "int8_avxvnni_body.h"

namespace sparkserve::int8 {

void rows_avxvnni_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                         float* y, int64_t N) {
  packed_rows<PackedIsa>(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
