// The decode attention's chunk kernels (decode_tile.h) on zmm registers: 6-row x 4-key score
// tiles, P V of a 64-wide head in one pass over the V rows. Built with -mavx512f -mavx512bw
// -mavx512vl (build.py ISA_UNITS); run only where the CPU has them (decode_attention.cpp).
#include "decode_tile.h"
#include "vec_zmm.h"

namespace sparkserve::decode {

ChunkKernels kernels_avx512() { return chunk_kernels<Zmm>(); }

}  // namespace sparkserve::decode
