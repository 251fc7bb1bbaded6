// The decode attention's chunk kernels (decode_tile.h) on ymm registers: the baseline, and the
// form for head dims that are not a multiple of 16. Built with the extension's -mavx2 -mfma -mf16c.
#include "decode_tile.h"
#include "vec_ymm.h"

namespace sparkserve::decode {

ChunkKernels kernels_avx2() { return chunk_kernels<Ymm>(); }

}  // namespace sparkserve::decode
