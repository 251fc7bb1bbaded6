// The AVX-VNNI kernel with AVX-512 VNNI's dpbusd (int8_avxvnni_body.h), for tests on CPUs without
// AVX-VNNI. Never chosen by the dispatcher.
#define SPARKSERVE_AVXVNNI_EVEX
#include "int8_avxvnni_body.h"

namespace sparkserve::int8 {

void rows_avxvnni_evex_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1,
                              const float* bias, float* y, int64_t N) {
  packed_rows<PackedIsa>(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
