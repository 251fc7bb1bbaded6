// The prefill attention tile (prefill_tile.h) on zmm registers: 48 query rows, 8-key score tiles
// (24 accumulators), P V in 6-row x 64-column tiles. Built with -mavx512f -mavx512bw -mavx512vl
// (build.py ISA_UNITS); run only where the CPU has them (prefill_attention.cpp).
#include "prefill_tile.h"
#include "vec_zmm.h"

namespace {

struct PrefillZmm : sparkserve::Zmm {
  static constexpr int kKeys = 8, kPvRows = 6, kPvVecs = 4;
};

}  // namespace

namespace sparkserve::prefill {

void tile_avx512(const Tile& t) { attend_tile<PrefillZmm>(t); }

}  // namespace sparkserve::prefill
