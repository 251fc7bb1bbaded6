// Packed weights for the int8 variants (int8_common.h has the layout). Served with int8
// activations, a model holds its Q4_0 / Q4_1 / Q8_0 / Q6_S weights packed in place of the GGUF blocks
// (pack_blocks; kernels/blocks.py); unpack_blocks and gguf_block_of_packed give the GGUF bytes
// back to the readers that want them (a switch to fp32 activations, the embedding's lookups).
// Blocks that cannot be held packed (rows not a multiple of 16) get a packed copy on their first
// int8 call, kept beside them for as long as the blocks' storage lives (weight blocks are never
// written in place, so the copy cannot go stale). An entry whose storage died is dropped at the
// next insert, and a new tensor at a recycled address is told apart by its storage.
#include "int8_packed.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/Storage.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "block_linear.h"
#include "int8_common.h"

namespace sparkserve::int8 {
namespace {

void pack(const uint8_t* w, int64_t N, int64_t K, int qtype, uint8_t* out) {
  const int64_t nb = K / 32, rb = packed_record_bytes(qtype), groups = (N + kGroupRows - 1) / kGroupRows;
  const int bb = block_bytes_of(qtype);
  std::memset(out, 0, groups * nb * rb);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rec = out + (g * nb + b) * rb;
      for (int64_t r = 0; r < kGroupRows; ++r) {
        const int64_t n = g * kGroupRows + r;
        uint8_t* quants = rec + packed_quants_at(qtype) + 4 * r;
        if (n >= N) {          // padding: zero scales, and Q8_0 quants that mean 0 (+128 offset)
          if (qtype == kQ8_0)
            for (int i = 0; i < 8; ++i) std::memset(quants + 64 * i, 0x80, 4);
          continue;
        }
        const uint8_t* blk = w + (n * nb + b) * bb;
        std::memcpy(rec + 2 * r, blk, 2);                                  // d
        if (qtype == kQ6_S) {
          rec[packed_sc_at + r] = blk[2], rec[packed_sc_at + kGroupRows + r] = blk[3];
          for (int i = 0; i < 6; ++i) std::memcpy(quants + 64 * i, blk + 4 + 4 * i, 4);   // nibbles, high bits
        } else if (qtype == kQ4_1) {
          std::memcpy(rec + packed_m_at + 2 * r, blk + 2, 2);              // m
          for (int i = 0; i < 4; ++i) std::memcpy(quants + 64 * i, blk + 4 + 4 * i, 4);
        } else if (qtype == kQ4_0) {
          for (int i = 0; i < 4; ++i) std::memcpy(quants + 64 * i, blk + 2 + 4 * i, 4);
        } else {
          for (int i = 0; i < 8; ++i)
            for (int j = 0; j < 4; ++j) quants[64 * i + j] = blk[2 + 4 * i + j] ^ 0x80;
        }
      }
    }
}

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t nbytes;
  at::Tensor packed;
};

std::mutex mu;
std::unordered_map<const void*, Entry> cache;

}  // namespace

const uint8_t* packed_weights(const at::Tensor& w, int64_t N, int64_t K, int qtype) {
  const void* key = w.data_ptr();
  c10::StorageImpl* storage = w.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) {
    const Entry& e = it->second;
    if (!e.storage.expired() && e.storage._unsafe_get_target() == storage && e.nbytes == w.nbytes())
      return e.packed.data_ptr<uint8_t>();
    cache.erase(it);
  }
  for (auto i = cache.begin(); i != cache.end();) i = i->second.storage.expired() ? cache.erase(i) : std::next(i);
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  at::Tensor packed = at::empty({groups * (K / 32) * packed_record_bytes(qtype)}, w.options());
  pack(w.data_ptr<uint8_t>(), N, K, qtype, packed.data_ptr<uint8_t>());
  cache.emplace(key, Entry{w.storage().getWeakStorageImpl(), static_cast<int64_t>(w.nbytes()), packed});
  return packed.data_ptr<uint8_t>();
}

void gguf_block_of_packed(const uint8_t* wp, int64_t n, int64_t b, int64_t nb, int qtype, uint8_t* out) {
  const uint8_t* rec = wp + (n / kGroupRows * nb + b) * packed_record_bytes(qtype);
  const int64_t r = n % kGroupRows;
  const uint8_t* quants = rec + packed_quants_at(qtype) + 4 * r;
  std::memcpy(out, rec + 2 * r, 2);                                      // d
  if (qtype == kQ6_S) {
    out[2] = rec[packed_sc_at + r], out[3] = rec[packed_sc_at + kGroupRows + r];
    for (int i = 0; i < 6; ++i) std::memcpy(out + 4 + 4 * i, quants + 64 * i, 4);
  } else if (qtype == kQ4_1) {
    std::memcpy(out + 2, rec + packed_m_at + 2 * r, 2);                  // m
    for (int i = 0; i < 4; ++i) std::memcpy(out + 4 + 4 * i, quants + 64 * i, 4);
  } else if (qtype == kQ4_0) {
    for (int i = 0; i < 4; ++i) std::memcpy(out + 2 + 4 * i, quants + 64 * i, 4);
  } else {
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) out[2 + 4 * i + j] = quants[64 * i + j] ^ 0x80;
  }
}

int64_t packed_weights_held() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int64_t>(cache.size());
}

}  // namespace sparkserve::int8

namespace {

using sparkserve::block_bytes_of;

void check_packable(const at::Tensor& w, int64_t qtype, const char* what) {
  TORCH_CHECK(sparkserve::int8::int8_reads(static_cast<int>(qtype)), what,
              ": only Q4_0, Q4_1, Q8_0 and Q6_S blocks pack, got type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), what,
              ": blocks must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(w.size(0) % sparkserve::int8::kGroupRows == 0, what, ": ", w.size(0), " rows are not a multiple of ",
              sparkserve::int8::kGroupRows);
  TORCH_CHECK(w.size(1) % block_bytes_of(static_cast<int>(qtype)) == 0, what, ": a row is not whole blocks");
}

}  // namespace

// Q4_0 / Q4_1 / Q8_0 / Q6_S blocks [N, row bytes] (N a multiple of 16) in the packed layout the int8
// variants read, to be held in their place (same shape and size).
at::Tensor pack_blocks(at::Tensor w, int64_t qtype) {
  check_packable(w, qtype, "pack_blocks");
  const int64_t N = w.size(0), K = w.size(1) / block_bytes_of(static_cast<int>(qtype)) * 32;
  at::Tensor out = at::empty_like(w);
  sparkserve::int8::pack(w.data_ptr<uint8_t>(), N, K, static_cast<int>(qtype), out.data_ptr<uint8_t>());
  return out;
}

// The inverse of pack_blocks: packed blocks of type `qtype` (2, 3, 8 or 114) back in block order.
at::Tensor unpack_blocks(at::Tensor w, int64_t qtype) {
  check_packable(w, qtype, "unpack_blocks");
  const int bb = block_bytes_of(static_cast<int>(qtype));
  const int64_t N = w.size(0), nb = w.size(1) / bb;
  at::Tensor out = at::empty_like(w);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b)
      sparkserve::int8::gguf_block_of_packed(wp, n, b, nb, static_cast<int>(qtype), op + (n * nb + b) * bb);
  return out;
}
