// Int8 kernel, AMX-INT8 variant (Sapphire Rapids and later), on packed weights (int8_amx_body.h).
// Built with the AVX-512 VNNI flags plus -mamx-tile -mamx-int8 (build.py); run only where the CPU
// has them and Linux granted this process the tile state (int8_dispatch.cpp).
#include "int8_amx_body.h"

namespace sparkserve::int8 {

void rows_amx_packed(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                     float* y, int64_t N) {
  amx_rows(q, wp, qtype, n0, n1, bias, y, N);
}

}  // namespace sparkserve::int8
