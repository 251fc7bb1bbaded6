// Packed copies of GGUF weight blocks for the int8 variants that read them (int8_common.h has the
// layout). A weight's packed copy is made on its first int8 call and kept beside the blocks for
// as long as the blocks' storage lives: the layers and the native step go on passing the GGUF
// blocks (the fp32-activation kernel and the other variants read those), and weight blocks are
// never written in place, so the copy cannot go stale. An entry whose storage died is dropped
// at the next insert, and a new tensor at a recycled address is told apart by its storage.
#include "int8_packed.h"

#include <ATen/ops/empty.h>
#include <c10/core/Storage.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "int8_common.h"

namespace sparkserve::int8 {
namespace {

constexpr int kQ4_1 = 3;

void pack(const uint8_t* w, int64_t N, int64_t K, int qtype, uint8_t* out) {
  const int64_t nb = K / 32, rb = packed_record_bytes(qtype), groups = (N + kGroupRows - 1) / kGroupRows;
  const int bb = qtype == kQ4_1 ? 20 : 34;
  std::memset(out, 0, groups * nb * rb);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rec = out + (g * nb + b) * rb;
      for (int64_t r = 0; r < kGroupRows; ++r) {
        const int64_t n = g * kGroupRows + r;
        uint8_t* quants = rec + packed_quants_at(qtype) + 4 * r;
        if (n >= N) {          // padding: zero scales, and Q8_0 quants that mean 0 (+128 offset)
          if (qtype != kQ4_1)
            for (int i = 0; i < 8; ++i) std::memset(quants + 64 * i, 0x80, 4);
          continue;
        }
        const uint8_t* blk = w + (n * nb + b) * bb;
        std::memcpy(rec + 2 * r, blk, 2);                                  // d
        if (qtype == kQ4_1) {
          std::memcpy(rec + packed_m_at + 2 * r, blk + 2, 2);              // m
          for (int i = 0; i < 4; ++i) std::memcpy(quants + 64 * i, blk + 4 + 4 * i, 4);
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

int64_t packed_weights_held() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int64_t>(cache.size());
}

}  // namespace sparkserve::int8
