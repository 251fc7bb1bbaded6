// One key chunk of a decode-attention work item (decode_attention.cpp), in plain types: the
// AVX-512 unit that computes it (decode_attention_avx512.cpp) is compiled with its own ISA flags
// and must not share inline library code with the rest of the extension. decode_tile.h has the
// computation, once over a vector type.
#pragma once
#include <cstdint>

namespace sparkserve::decode {

// The chunk's K/V: rows at offsets rows[0..n) (elements) of the buffers k and v, of type 0
// float32, 1 float16, 2 bfloat16, 3 int8, 4 fp8 e4m3, 5 fp8 e5m2. The quantized types (3..5) give
// each key's block scales as fp32, [n][D / qb] in the chunk's key order (decode_attention.cpp
// converts the pool's float16 ones; for e4m3 times 256, see vec_ymm.h load_fp8).
struct ChunkKV {
  const void* k;
  const void* v;
  int type;
  const float* k_scale;
  const float* v_scale;
  int64_t qb;
};

// D is a multiple of the unit's vector width, and qb of it.
struct ChunkKernels {
  // s[r][j] = q_r . k_j for the R query rows q[0..R) and the n keys.
  void (*scores)(const float* const* q, int64_t R, const int64_t* rows, int64_t n, const ChunkKV& kv, int64_t D,
                 float* s);
  // exp(sc * s - max) over row[lo, hi), zero elsewhere in row[0, n); returns the scaled max and
  // writes the sum of the exps.
  float (*softmax)(float* row, int64_t n, int64_t lo, int64_t hi, float sc, float* sum);
  // o[r][0..D) = sum_j p[r][j] V[j] for the R rows of p (each n long).
  void (*pv)(const float* p, int64_t R, int64_t n, const ChunkKV& kv, const int64_t* rows, float* const* o,
             int64_t D);
  int64_t width;   // D must be a multiple of it
};

ChunkKernels kernels_avx2();
ChunkKernels kernels_avx512();
// kernels_avx512 with an int8 pool's scores as VNNI integer dot products (decode_attention_avx512vnni.cpp)
ChunkKernels kernels_avx512vnni();

}  // namespace sparkserve::decode
