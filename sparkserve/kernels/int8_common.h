// Int8 activations (llama.cpp's Q8_0/Q8_1 scheme): the layout of the quantized x shared by the
// quantizer and the integer-dot kernels, and the entry points of each CPU variant. Each variant is
// its own translation unit built with its own ISA flags (build.py) and includes no torch or std
// templates, so no inline function compiled for a wider ISA can be picked by the linker for the
// baseline code. int8_dispatch.cpp picks one at run time.
#pragma once
#include <xmmintrin.h>

#include <cstdint>

namespace sparkserve::int8 {

// x [M, K] quantized in blocks of 32 per row: q = round(x * 127/amax), d = amax/127,
// s = d * sum(q) (for Q4_1's m term), and for Q6_S's +32 offset -32 times the sum of each half of
// the block (ha: inputs 0..15, hb: 16..31). Rows go in tiles of kTile (the last may be shorter); tile
// rows [m0, m0 + mt) keep q at qs + m0*K as [K/32][mt][32] and d, s at d + m0/kTile*nb*kTile as
// [K/32][kTile] (zero-padded), so a block's values for the whole tile are contiguous.
constexpr int64_t kTile = 8;

struct QuantX {
  int8_t* qs;      // M * K
  float* d;        // ceil(M / kTile) * kTile * K/32
  float* s;        // same
  int32_t* xn;     // same layout: -128 * sum(q), the offset of the packed kernel's Q8_0 weights
  int32_t* ha;     // same layout: -32 * sum(q[0..15])
  int32_t* hb;     // same layout: -32 * sum(q[16..31])
  int64_t M, K;
};

inline int64_t quantx_scales(int64_t M, int64_t K) { return (M + kTile - 1) / kTile * kTile * (K / 32); }

// Quantize rows [m0, m1) of x (m0 a multiple of kTile). AVX2; used by every variant.
void quantize_rows(const float* x, int64_t m0, int64_t m1, const QuantX& q);

// Packed weights (int8_packed.cpp): output rows in groups of kGroupRows, and within a group, per
// block of 32 inputs, a record of kGroupRows fp16 d, (Q4_1) kGroupRows fp16 m, then the quants
// as unsigned bytes in 64-byte chunks of kGroupRows rows x 4 consecutive inputs, so one vector
// of 16 int32 lanes holds one output row each (no horizontal sums):
//   Q4_1, 320 bytes: chunk i (i < 4) holds GGUF nibble bytes 4i..4i+3 of each row: their low
//     nibbles are inputs 4i..4i+3, their high nibbles inputs 16+4i..16+4i+3;
//   Q8_0, 544 bytes: chunk i (i < 8) holds q + 128 of inputs 4i..4i+3 of each row (the offset
//     makes them unsigned; the kernel starts each dot at -128 * sum(q_x) to cancel it).
//   Q4_0, 288 bytes: d, then Q4_1's chunks (no m); its -8 offset starts each dot at -8 * sum(q_x).
//   Q6_S, 448 bytes: after d, kGroupRows int8 scales of inputs 0..15 (sc_a), then of 16..31
//     (sc_b); chunks 0..3 hold the low nibbles of u = q + 32 as Q4_1's do, chunks 4..5 their high
//     2 bits: chunk 4 + c, byte j of a row, bits 2k..2k+1 belong to input 16c + 4k + j.
// Rows past N (the last group's padding) are zero. Same size as the blocks they hold.
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int kQ6_S = 114;          // sparkserve's Q6_K in blocks of 32 (kernels/blocks.py)
constexpr bool nibble_type(int qtype) { return qtype == kQ4_0 || qtype == kQ4_1; }
constexpr int64_t kGroupRows = 16;
constexpr int64_t packed_record_bytes(int qtype) {
  return qtype == kQ4_0 ? 288 : qtype == kQ4_1 ? 320 : qtype == kQ6_S ? 448 : 544;
}
constexpr int packed_m_at = 32;                                            // Q4_1's m, after d
constexpr int packed_sc_at = 32;                                           // Q6_S's sc_a, after d
// the first chunk: after d, and Q4_1's m or Q6_S's scales
constexpr int packed_quants_at(int qtype) { return qtype == kQ4_1 || qtype == kQ6_S ? 64 : 32; }

// Packed weights held in place of their blocks (kernels/blocks.py's Q4_0_X16, Q4_1_X16, Q8_0_X16,
// Q6_S_X16), as ggml's CPU backend holds its repacked types: the layout above with N a multiple of
// kGroupRows, so the tensor keeps the blocks' shape [N, K/32 * block bytes]. Only the int8
// variants read them.
constexpr int kPackedOffset = 1000;   // a packed type is its block type + 1000
// The block types the int8 variants read.
constexpr bool int8_reads(int qtype) { return nibble_type(qtype) || qtype == kQ8_0 || qtype == kQ6_S; }
constexpr bool is_packed_type(int qtype) { return qtype > kPackedOffset && int8_reads(qtype - kPackedOffset); }
// The block type a packed type holds (2 Q4_0, 3 Q4_1, 8 Q8_0, 114 Q6_S); any other type is its own.
constexpr int gguf_type_of(int qtype) { return is_packed_type(qtype) ? qtype - kPackedOffset : qtype; }

template <int QT>
struct TypeTag {
  static constexpr int value = QT;
};

// f(TypeTag<QT>{}) for qtype, one of the block types the int8 variants read (int8_reads).
template <class F>
inline void with_int8_type(int qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: f(TypeTag<kQ4_0>{}); break;
    case kQ4_1: f(TypeTag<kQ4_1>{}); break;
    case kQ6_S: f(TypeTag<kQ6_S>{}); break;
    default: f(TypeTag<kQ8_0>{}); break;
  }
}

// A kernel prefetches each record's successor in the next group of rows (nb records on) only for
// calls of at least this many x rows: a group's records then serve a whole tile of rows, time for
// the lines to arrive; at fewer rows the hardware prefetchers do better alone (docs/kernel-notes.md).
constexpr int64_t kPrefetchMinRows = kTile;

inline void prefetch_record(const uint8_t* rec, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + o), _MM_HINT_T0);
}

// Where a block dot of type QT starts, to cancel its weights' offset: -128 * sum(q_x) for Q8_0's
// +128 (xn), -8 * sum(q_x) for Q4_0's +8, nothing for Q4_1 (its m term does it).
template <int QT>
constexpr int32_t dot_start(int32_t xn) { return QT == kQ4_1 ? 0 : QT == kQ4_0 ? xn / 16 : xn; }

// The weight vectors of one packed record for a block dot: w[g] holds inputs 4g..4g+3 of each row
// (g < 8), as Q4_0 / Q4_1 nibbles (chunk i's low nibbles are inputs 4i.., its high nibbles 16 + 4i..), or
// as Isa::unpack_q8_0(chunk g, w[g], w[8 + g]) makes them of Q8_0 bytes (q + 128), in the form the
// variant's dot wants. load(i) reads chunk i, lo / hi take a vector's low / high nibbles.
//   Q6_S (unpack_q6): w[g] holds u of inputs 4g..4g+3 (0..63), the low nibble from chunk g % 4
//     (low nibbles for g < 4), the high bits from chunk 4 + g / 4, bits 2(g % 4); shl4 / shl2 /
//     shr2 shift a vector's 16-bit lanes, high(w, v) = w | (bits 4..5 of each byte of v).
template <int QT, class Isa, class V, class Load, class Lo, class Hi>
inline void unpack_block(Load load, Lo lo, Hi hi, V w[16]) {
  if (nibble_type(QT)) {
    for (int i = 0; i < 4; ++i) {
      const V raw = load(i);
      w[i] = lo(raw);
      w[i + 4] = hi(raw);
    }
  } else {
    for (int i = 0; i < 8; ++i) Isa::unpack_q8_0(load(i), w[i], w[i + 8]);
  }
}

template <class V, class Load, class Lo, class Hi, class Shl4, class Shl2, class Shr2, class High>
inline void unpack_q6(Load load, Lo lo, Hi hi, Shl4 shl4, Shl2 shl2, Shr2 shr2, High high, V w[8]) {
  const V h[2] = {load(4), load(5)};
  for (int i = 0; i < 4; ++i) {
    const V raw = load(i);
    w[i] = lo(raw);
    w[i + 4] = hi(raw);
  }
  for (int c = 0; c < 2; ++c) {   // field k's bits 2k..2k+1 to bits 4..5 of each byte
    w[4 * c] = high(w[4 * c], shl4(h[c]));
    w[4 * c + 1] = high(w[4 * c + 1], shl2(h[c]));
    w[4 * c + 2] = high(w[4 * c + 2], h[c]);
    w[4 * c + 3] = high(w[4 * c + 3], shr2(h[c]));
  }
}

// y[:, n0:n1] (+ bias) from packed weights `wp`; n0 a multiple of kGroupRows, one thread.
using PackedRowsFn = void (*)(const QuantX& q, const uint8_t* wp, int qtype, int64_t n0, int64_t n1,
                              const float* bias, float* y, int64_t N);
void rows_amx_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*, int64_t);
// The AMX kernel on software tiles, for tests on CPUs without AMX (never dispatched).
void rows_amx_emulated_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*,
                              int64_t);
void rows_avx512vnni_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*, int64_t);
void rows_avx512_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*, int64_t);
void rows_avxvnni_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*, int64_t);
// The AVX-VNNI kernel on AVX-512 VNNI's dpbusd, for tests on CPUs without AVX-VNNI (never dispatched).
void rows_avxvnni_evex_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*,
                              int64_t);
void rows_avx2_packed(const QuantX&, const uint8_t*, int, int64_t, int64_t, const float*, float*, int64_t);

}  // namespace sparkserve::int8
