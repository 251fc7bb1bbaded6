// The DSpark Markov head's serial loop over a block, for greedy requests, in one call.
//
// Slot k's logits are base[b, k] + W2 W1[prev], prev being the anchor for slot 0 and slot k-1's
// argmax after it. Each slot waits for the previous one's token, so from Python the loop is G
// rounds of five small torch calls, which cost more than the arithmetic (a rank-r product over
// a few thousand logits).
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "markov_greedy.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kTile = sparkserve::kMarkovTile;   // 8 ymm accumulators: enough to keep two FMA ports busy

// Tiles [t0, t1) of logits = base + W2 emb, W2 packed as [tiles][r][kTile] (zero rows past V),
// so a tile streams one contiguous panel. Returns the first maximum over them (as torch.argmax)
// and its value.
std::pair<int64_t, float> tiles_argmax(const float* base, const float* emb, const float* packed, int64_t r,
                                       int64_t V, int64_t t0, int64_t t1) {
  int64_t best = -1;
  float top = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const float* w = packed + t * r * kTile;
    __m256 acc[kTile / 8];
    for (int i = 0; i < kTile / 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; ++j, w += kTile) {
      const __m256 e = _mm256_set1_ps(emb[j]);
      for (int i = 0; i < kTile / 8; ++i) acc[i] = _mm256_fmadd_ps(e, _mm256_loadu_ps(w + 8 * i), acc[i]);
    }
    alignas(32) float logits[kTile];
    for (int i = 0; i < kTile / 8; ++i) _mm256_store_ps(logits + 8 * i, acc[i]);
    const int64_t n = std::min(kTile, V - t * kTile);
    for (int64_t i = 0; i < n; ++i) {
      const float x = base[t * kTile + i] + logits[i];
      if (best < 0 || x > top) top = x, best = t * kTile + i;
    }
  }
  return {best, top};
}

// One slot's argmax: with `split`, its tiles go over the thread pool (one request in flight, so
// the threads share W2's stream) and the chunks' maxima join in vocab order.
int64_t slot_argmax(const float* base, const float* emb, const float* packed, int64_t r, int64_t V, bool split) {
  const int64_t tiles = (V + kTile - 1) / kTile;
  if (!split) return tiles_argmax(base, emb, packed, r, V, 0, tiles).first;
  std::vector<std::pair<int64_t, float>> part(tiles, {-1, 0.0f});
  sparkserve::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    part[t0] = tiles_argmax(base, emb, packed, r, V, t0, t1);
  });
  std::pair<int64_t, float> best{-1, 0.0f};
  for (const auto& p : part)
    if (p.first >= 0 && (best.first < 0 || p.second > best.second)) best = p;
  return best.first;
}

}  // namespace

// W2 [V, r] fp32 as markov_greedy reads it.
at::Tensor markov_pack(at::Tensor w2) {
  TORCH_CHECK(w2.dim() == 2 && w2.scalar_type() == at::kFloat, "w2 must be float32 [V, r]");
  const int64_t V = w2.size(0), r = w2.size(1), tiles = (V + kTile - 1) / kTile;
  at::Tensor padded = at::zeros({tiles * kTile, r}, at::kFloat);
  padded.slice(0, 0, V).copy_(w2);
  return padded.view({tiles, kTile, r}).transpose(1, 2).contiguous();
}

namespace sparkserve {

void markov_greedy_into(const float* base, int64_t B, int64_t G, int64_t V, const float* w1, int64_t vocab,
                        int64_t r, const float* w2p, const int64_t* d2t, const int64_t* anchors, int64_t* tokens,
                        float* embs) {
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(anchors[b] >= 0 && anchors[b] < vocab, "anchor ", anchors[b], " is outside the vocab of ", vocab);
  const auto greedy_block = [&](int64_t b, bool split) {
    int64_t prev = anchors[b];
    for (int64_t k = 0; k < G; ++k) {
      float* emb = embs + (b * G + k) * r;
      std::copy(w1 + prev * r, w1 + (prev + 1) * r, emb);
      const int64_t best = slot_argmax(base + (b * G + k) * V, emb, w2p, r, V, split);
      prev = d2t ? best + d2t[best] : best;
      tokens[b * G + k] = prev;
    }
  };
  // Requests split over the threads; fewer requests than threads split each slot's vocab instead.
  const SpinScope spinning;
  if (B < at::get_num_threads()) {
    for (int64_t b = 0; b < B; ++b) greedy_block(b, true);
  } else {
    parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) greedy_block(b, false);
    });
  }
}

}  // namespace sparkserve

// base [B, G, V] fp32; w1 [target vocab, r] fp32 (the previous token's code); w2p: W2 by
// markov_pack; d2t [V] int64: draft id i is target id i + d2t[i] (None: same vocab);
// anchors [B] int64 target ids. Returns (tokens [B, G] target ids, embs [B, G, r]: the code of
// each slot's previous token, which the confidence head reads).
std::tuple<at::Tensor, at::Tensor> markov_greedy(at::Tensor base, at::Tensor w1, at::Tensor w2p,
                                                 std::optional<at::Tensor> d2t, at::Tensor anchors) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat, "base must be float32 [B, G, V]");
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == at::kFloat, "w1 must be float32 [vocab, r]");
  const int64_t B = base.size(0), G = base.size(1), V = base.size(2), r = w1.size(1);
  TORCH_CHECK(w2p.scalar_type() == at::kFloat && w2p.is_contiguous() &&
                  w2p.numel() == (V + kTile - 1) / kTile * kTile * r, "w2p must be markov_pack(W2 [V, r])");
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == B && anchors.scalar_type() == at::kLong,
              "anchors must be int64 [B]");
  if (d2t) TORCH_CHECK(d2t->dim() == 1 && d2t->size(0) == V && d2t->scalar_type() == at::kLong,
                       "d2t must be int64 [V]");
  base = base.contiguous();
  w1 = w1.contiguous();
  anchors = anchors.contiguous();
  at::Tensor map = d2t ? d2t->contiguous() : at::Tensor();
  at::Tensor tokens = at::empty({B, G}, at::kLong);
  at::Tensor embs = at::empty({B, G, r}, at::kFloat);
  sparkserve::markov_greedy_into(base.data_ptr<float>(), B, G, V, w1.data_ptr<float>(), w1.size(0), r,
                                 w2p.data_ptr<float>(), d2t ? map.data_ptr<int64_t>() : nullptr,
                                 anchors.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(), embs.data_ptr<float>());
  return {tokens, embs};
}
