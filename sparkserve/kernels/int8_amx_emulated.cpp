// The AMX kernel on software tiles (amx_tiles.h), for tests on CPUs without AMX: the same body
// as int8_amx.cpp, built with the AVX-512 VNNI flags only. Never chosen by the dispatcher.
#define SPARKSERVE_AMX_EMULATED
#include "int8_amx_body.h"

namespace sparkserve::int8 {

void rows_amx_emulated_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1,
                              const float* bias, float* y, int64_t N) {
  amx_rows(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
