// The prefill attention tile (prefill_tile.h) on ymm registers, for CPUs without AVX-512: 24 query
// rows, 4-key score tiles (12 accumulators, the 3 query vectors and a broadcast fill the 16
// registers), P V in 6-row x 16-column tiles. Built with the extension's baseline -mavx2 -mfma
// -mf16c.
#include "prefill_tile.h"
#include "vec_ymm.h"

namespace {

struct PrefillYmm : sparkserve::Ymm {
  static constexpr int kKeys = 4, kPvRows = 6, kPvVecs = 2;
};

}  // namespace

namespace sparkserve::prefill {

void tile_avx2(const Tile& t) { attend_tile<PrefillYmm>(t); }

}  // namespace sparkserve::prefill
