// The AMX tile operations the AMX int8 kernel uses (int8_amx_body.h), on the CPU's tiles or, with
// SPARKSERVE_AMX_EMULATED defined, in software after the instructions' definitions in Intel's SDM
// (TILELOADD, TILESTORED, TILEZERO, TDPBSUD, LDTILECFG). The emulation lets a CPU without AMX run
// the kernel's tiling, its layouts and its tails in tests; it checks the shape rules on which the
// hardware faults, so a kernel that passes under it issues only legal tile instructions.
// Internal linkage: each translation unit gets the form its macro asks for.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {
namespace tiles {

// LDTILECFG's 64-byte operand, palette 1: 8 tiles of up to 16 rows x 64 bytes.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(Config) == 64, "LDTILECFG reads 64 bytes");

#ifndef SPARKSERVE_AMX_EMULATED

// The instructions as asm, as GCC's intrinsics have them, with two differences: the tile number is
// a template argument (the intrinsics paste it in with the preprocessor), and the asm tells the
// compiler that it reads or writes memory (the intrinsics do not, so a buffer written just before
// a tile load could be optimized away). GCC 12's _tile_loadconfig also declares an 8-byte operand.
inline void configure(const Config& c) { asm volatile("ldtilecfg %0" ::"m"(c)); }
inline void release() { asm volatile("tilerelease" ::); }
template <int T>
inline void load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void store(void* p, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void zero() { asm volatile("tilezero %%tmm%c0" ::"i"(T)); }
// C += A (signed bytes) . B (unsigned bytes, 4 per int32 lane: the VNNI layout).
template <int C, int A, int B>
inline void dot_su() { asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }

#else

struct State {
  Config cfg;
  bool configured = false;
  alignas(64) uint8_t t[8][16][64];
};
inline thread_local State st;

inline void fault(const char* what) {
  std::fprintf(stderr, "emulated AMX: %s (the CPU would raise #UD)\n", what);
  std::abort();
}
inline void check_tile(int t) {
  if (!st.configured) fault("tile instruction without a tile configuration");
  if (st.cfg.rows[t] == 0 || st.cfg.colsb[t] == 0) fault("tile not configured");
}

inline void configure(const Config& c) {
  if (c.palette != 1) fault("palette other than 1");
  for (int t = 0; t < 8; ++t)
    if (c.rows[t] > 16 || c.colsb[t] > 64) fault("tile larger than 16 rows x 64 bytes");
  st.cfg = c;
  st.configured = true;
  std::memset(st.t, 0, sizeof st.t);   // LDTILECFG zeroes every tile
}
inline void release() {
  st.configured = false;
  std::memset(st.t, 0, sizeof st.t);
}
// Rows and bytes past the configured shape read as zero.
template <int T>
inline void load(const void* p, int64_t stride) {
  check_tile(T);
  std::memset(st.t[T], 0, sizeof st.t[T]);
  for (int r = 0; r < st.cfg.rows[T]; ++r)
    std::memcpy(st.t[T][r], static_cast<const uint8_t*>(p) + r * stride, st.cfg.colsb[T]);
}
template <int T>
inline void store(void* p, int64_t stride) {
  check_tile(T);
  for (int r = 0; r < st.cfg.rows[T]; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * stride, st.t[T][r], st.cfg.colsb[T]);
}
template <int T>
inline void zero() {
  check_tile(T);
  std::memset(st.t[T], 0, sizeof st.t[T]);
}
// TDPBSUD: C[m][n] += sum over k < colsb(A)/4, j < 4 of int8(A[m][4k+j]) * uint8(B[k][4n+j]),
// in int32 that wraps. Shapes: rows(A) = rows(C), colsb(A) = 4 rows(B), colsb(B) = colsb(C).
template <int C, int A, int B>
inline void dot_su() {
  check_tile(C);
  check_tile(A);
  check_tile(B);
  const Config& c = st.cfg;
  if (c.rows[A] != c.rows[C] || c.colsb[A] != 4 * c.rows[B] || c.colsb[B] != c.colsb[C] || c.colsb[C] % 4)
    fault("TDPBSUD tile shapes do not match");
  for (int m = 0; m < c.rows[C]; ++m)
    for (int n = 0; n < c.colsb[C] / 4; ++n) {
      uint32_t acc;
      std::memcpy(&acc, &st.t[C][m][4 * n], 4);
      for (int k = 0; k < c.colsb[A] / 4; ++k)
        for (int j = 0; j < 4; ++j)
          acc += static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(st.t[A][m][4 * k + j])) *
                                       static_cast<int32_t>(st.t[B][k][4 * n + j]));
      std::memcpy(&st.t[C][m][4 * n], &acc, 4);
    }
}

#endif

}  // namespace tiles
}  // namespace
