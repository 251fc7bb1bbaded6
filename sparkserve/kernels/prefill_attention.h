// One work item of the prefill attention (prefill_attention.cpp), in plain types: the AVX-512 unit
// that computes it (prefill_attention_avx512.cpp) is compiled with its own ISA flags and must not
// share inline library code with the rest of the extension. prefill_tile.h has the computation.
#pragma once
#include <cstdint>

namespace sparkserve::prefill {

// Query rows per tile: three vector registers of one score column (48 in zmm, 24 in ymm).
constexpr int64_t kMaxTileRows = 48;
// Keys per block: one block's K, V and scores stay in L1 beside the tile's queries and outputs.
constexpr int64_t kBlockKeys = 32;

// nq consecutive queries of one request and one kv head, with all G query heads of each (nq * G
// <= the variant's tile rows, query-major). Query i (0 .. nq - 1) sees the gathered keys j with
// j < end0 + i and, when window > 0, j >= end0 + i - window. Key j of the request is pool row
// (slots[j] * Hkv + h) * D of k and v.
struct Tile {
  const float* q;            // query 0, head h * G
  int64_t q_query, q_head;   // strides to the next query, the next head
  float* out;                // where query 0, head h * G goes
  int64_t out_query, out_head;
  int64_t nq, G, D;
  const void* k;
  const void* v;
  int kv_type;               // 0 float32, 1 float16, 2 bfloat16, 3 int8, 4 fp8 e4m3, 5 fp8 e5m2
  const int64_t* slots;
  int64_t Hkv, h, end0, window;
  float scale;
  float* scratch;            // scratch_floats(D) floats, 64-byte aligned
  const uint16_t* k_scale = nullptr;   // kv_type 3..5: float16 scales [slots, Hkv, D / qb]
  const uint16_t* v_scale = nullptr;
  int64_t qb = 0;                      // values per scale
};

// Floats of scratch a tile needs: queries transposed [D][rows], outputs [rows][D], one block's
// scores [keys][rows], K and V [keys][D], and a row vector.
static inline int64_t scratch_floats(int64_t D) {
  return 2 * D * kMaxTileRows + kBlockKeys * kMaxTileRows + 2 * kBlockKeys * D + kMaxTileRows;
}

// The tile's attention, D a multiple of 16: 48 rows in zmm registers (avx512vnni: an int8 pool's
// scores as integer dot products), or 24 in ymm registers.
void tile_avx512vnni(const Tile& t);
void tile_avx512(const Tile& t);
void tile_avx2(const Tile& t);

}  // namespace sparkserve::prefill
