// The AMX int8 kernel body (int8_amx.cpp on the CPU's tiles, int8_amx_emulated.cpp on the software
// tiles of amx_tiles.h). Per block of 32 inputs and group of 16 output rows, one TDPBSUD takes up
// to 8 x rows (a kTile tile of QuantX: rows x 32 signed bytes) against the block's weights, whose
// packed chunks already are TDPBSUD's B layout (16 output rows x 4 inputs per 64-byte row; Q4_1's
// nibbles are split to bytes first). The int32 products go through memory to the scale rule of
// the zmm kernels (add_block), so every row's result equals the AVX-512 VNNI kernel's bit for bit:
// DSpark's verify rows agree with the decode rows whichever kernel ran them. One x row goes to
// the VNNI kernel, as in llama.cpp, since a tile of one row has nothing to share.
#pragma once
#include "amx_tiles.h"
#include "int8_packed_zmm.h"

namespace {

constexpr int64_t kAmxMinRows = 2;

// Tiles 0 and 1: one block of two x tiles (A, rows x 32 bytes); 2 and 3: a block's weights (B, 8
// rows of 64 bytes), 4 | 5 and 6 | 7: its products for the two x tiles (C, rows x 16 int32), one
// set each for even and odd blocks (the pipeline stages of amx_group). A second x tile of 0 rows
// is unused.
inline tiles::Config tile_config(int mt0, int mt1) {
  tiles::Config c;
  c.rows[0] = c.rows[4] = c.rows[6] = static_cast<uint8_t>(mt0);
  c.colsb[0] = 32;
  c.colsb[4] = c.colsb[6] = 64;
  if (mt1 > 0) {
    c.rows[1] = c.rows[5] = c.rows[7] = static_cast<uint8_t>(mt1);
    c.colsb[1] = 32;
    c.colsb[5] = c.colsb[7] = 64;
  }
  c.rows[2] = c.rows[3] = 8;
  c.colsb[2] = c.colsb[3] = 64;
  return c;
}

// acc[m] += the scaled products of C tile rows c[m] for x rows whose scales start at index i0.
template <int QT, int MT>
inline void add_products(const int32_t (*c)[16], const QuantX& q, int64_t i0, __m512 dw, __m512 mw,
                         __m512 acc[MT]) {
  for (int m = 0; m < MT; ++m) {
    const int64_t i = i0 + m;
    __m512i p = _mm512_load_si512(c[m]);
    if (QT != kQ4_1) p = _mm512_add_epi32(p, _mm512_set1_epi32(q.xn[i]));   // undo the weights' +128
    acc[m] = add_block<QT>(acc[m], p, dw, mw, q.d[i], q.s[i]);
  }
}

// Q4_1: a block's packed chunks with their nibbles split into bytes, as TDPBSUD's B operand takes
// them (chunk i: inputs 4i.. from the low nibbles, 16 + 4i.. from the high ones).
inline void split_nibbles(const uint8_t* quants, uint8_t* wb) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i raw = _mm512_loadu_si512(quants + 64 * i);
    _mm512_store_si512(wb + 64 * i, _mm512_and_si512(raw, lo4));
    _mm512_store_si512(wb + 64 * (i + 4), _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
  }
}

// One block's tile work in pipeline stage S (B tile 2 + S, C tiles 4 + 2S and 5 + 2S): the int32
// products of x tiles xa0 (and xa1) with the block's weights (wb: split Q4_1 bytes; Q8_0's are
// read in place from its record) go to c.
template <int QT, int MT1, int S>
inline void block_products(const uint8_t* quants, const uint8_t* wb, const int8_t* xa0, const int8_t* xa1,
                           int32_t (*c)[kTile][16]) {
  constexpr int B = 2 + S, C0 = 4 + 2 * S, C1 = 5 + 2 * S;
  tiles::load<B>(QT == kQ4_1 ? wb : quants, 64);
  tiles::zero<C0>();
  tiles::load<0>(xa0, 32);
  tiles::dot_su<C0, 0, B>();
  tiles::store<C0>(c[0], 64);
  if constexpr (MT1 > 0) {
    tiles::zero<C1>();
    tiles::load<1>(xa1, 32);
    tiles::dot_su<C1, 1, B>();
    tiles::store<C1>(c[1], 64);
  }
}

// Output rows [n, n + 16) for x rows [m0, m0 + MT0 + MT1), the tiles configured for them.
// A block's bytes travel through memory twice (split weights into a B tile, C tiles out to the
// scale rule), and a load right behind the stores it reads waits for them. So the loop runs as a
// two-stage pipeline: block b's tile products go out while block b + 1's weights are split and
// block b - 1's products are scaled, each stage with its own buffers and tiles. The scale rule
// still sees the blocks in order, so the results stay bit-equal to the VNNI kernel's.
template <int QT, int MT0, int MT1>
void amx_group(const QuantX& q, int64_t m0, const uint8_t* wp, int64_t n, const float* bias, float* y,
               int64_t N) {
  constexpr int64_t GB = packed_record_bytes(QT);
  constexpr int QOFF = packed_quants_at(QT);
  const int64_t nb = q.K / 32;
  const uint8_t* wg = wp + n / kGroupRows * nb * GB;
  const int8_t* x0 = q.qs + m0 * q.K;           // x tiles: [K/32][rows][32] each
  const int8_t* x1 = x0 + kTile * q.K;
  alignas(64) uint8_t wb[2][8 * 64];
  alignas(64) int32_t c[2][2][kTile][16];       // [stage][x tile]
  __m512 acc[MT0 + MT1];
  for (int m = 0; m < MT0 + MT1; ++m) acc[m] = _mm512_setzero_ps();
  auto scale = [&](int64_t blk) {               // block blk's products into acc, in block order
    const uint8_t* rec = wg + blk * GB;
    const __m512 dw = halves(rec);
    const __m512 mw = QT == kQ4_1 ? halves(rec + packed_m_at) : _mm512_setzero_ps();
    add_products<QT, MT0>(c[blk & 1][0], q, m0 * nb + blk * kTile, dw, mw, acc);   // scales: [K/32][kTile]
    if constexpr (MT1 > 0)
      add_products<QT, MT1>(c[blk & 1][1], q, (m0 + kTile) * nb + blk * kTile, dw, mw, acc + MT0);
  };
  if (QT == kQ4_1) split_nibbles(wg + QOFF, wb[0]);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* rec = wg + blk * GB;
    for (int o = 0; o < GB; o += 64)     // the same block of the next group
      _mm_prefetch(reinterpret_cast<const char*>(rec + nb * GB + o), _MM_HINT_T0);
    const int8_t *xa0 = x0 + blk * MT0 * 32, *xa1 = x1 + blk * MT1 * 32;
    if (blk & 1) block_products<QT, MT1, 1>(rec + QOFF, wb[1], xa0, xa1, c[1]);
    else block_products<QT, MT1, 0>(rec + QOFF, wb[0], xa0, xa1, c[0]);
    if (QT == kQ4_1 && blk + 1 < nb) split_nibbles(rec + GB + QOFF, wb[(blk + 1) & 1]);
    if (blk > 0) scale(blk - 1);
  }
  scale(nb - 1);
  store_tile<MT0>(acc, m0, n, bias, y, N);
  if constexpr (MT1 > 0) store_tile<MT1>(acc + MT0, m0 + kTile, n, bias, y, N);
}

using GroupFn = void (*)(const QuantX&, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t);

// The group kernel for x tiles of mt0 and mt1 rows (mt1 > 0 only after a whole tile).
template <int QT>
GroupFn group_fn(int64_t mt0, int64_t mt1) {
  static constexpr GroupFn one[kTile] = {amx_group<QT, 1, 0>, amx_group<QT, 2, 0>, amx_group<QT, 3, 0>,
                                         amx_group<QT, 4, 0>, amx_group<QT, 5, 0>, amx_group<QT, 6, 0>,
                                         amx_group<QT, 7, 0>, amx_group<QT, 8, 0>};
  static constexpr GroupFn two[kTile] = {amx_group<QT, 8, 1>, amx_group<QT, 8, 2>, amx_group<QT, 8, 3>,
                                         amx_group<QT, 8, 4>, amx_group<QT, 8, 5>, amx_group<QT, 8, 6>,
                                         amx_group<QT, 8, 7>, amx_group<QT, 8, 8>};
  return mt1 > 0 ? two[mt1 - 1] : one[mt0 - 1];
}

// y[:, n0:n1] (+ bias) for every x row, 16 x rows (two x tiles) at a time.
template <int QT>
void amx_rows_typed(const QuantX& q, const uint8_t* wp, int64_t n0, int64_t n1, const float* bias, float* y,
                    int64_t N) {
  static_assert(kTile == 8, "two x tiles fill the 16 rows of a tile");
  for (int64_t m0 = 0; m0 < q.M; m0 += 2 * kTile) {
    const int64_t mt0 = q.M - m0 < kTile ? q.M - m0 : kTile;
    const int64_t rest = q.M - m0 - kTile, mt1 = rest <= 0 ? 0 : rest < kTile ? rest : kTile;
    tiles::configure(tile_config(static_cast<int>(mt0), static_cast<int>(mt1)));
    const GroupFn group = group_fn<QT>(mt0, mt1);
    for (int64_t n = n0; n < n1; n += kGroupRows) group(q, m0, wp, n, bias, y, N);
  }
  tiles::release();
}

// The variant's entry (PackedRowsFn): one x row, and Q4_0 / Q6_S weights, go to the VNNI kernel.
inline void amx_rows(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1, const float* bias,
                     float* y, int64_t N) {
  if (q.M < kAmxMinRows || qtype == sparkserve::int8::kQ6_S || qtype == sparkserve::int8::kQ4_0)   // no tile form
    sparkserve::int8::rows_avx512vnni_packed(q, wp, qtype, n0, n1, bias, y, N);
  else if (qtype == kQ4_1) amx_rows_typed<3>(q, wp, n0, n1, bias, y, N);
  else amx_rows_typed<8>(q, wp, n0, n1, bias, y, N);
}

}  // namespace
