// The DSpark draft's context injection and greedy draft pass in C++ (native_draft.h): the Python
// path's ops (DSparkDraft.inject, DSparkWorker._draft_pass) on the same kernels, so the two differ by
// fp32 rounding only.
#include "native_draft.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>

#include "block_linear.h"
#include "markov_greedy.h"
#include "rms_norm.h"
#include "thread_pool.h"

namespace sparkserve {

NativeDraft::NativeDraft(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                         double eps, at::Tensor cos, at::Tensor sin, at::Tensor final_norm, at::Tensor fc,
                         int64_t fc_type, std::optional<at::Tensor> fc_bias, at::Tensor hidden_norm)
    : NativeLlama(hidden, heads, kv_heads, head_dim, intermediate, eps, cos, sin, final_norm),
      hidden_norm_(norm_weight(hidden_norm, hidden)) {
  const int64_t bytes = fc.dim() == 2 ? fc.size(1) : 0, per32 = block_bytes_of(static_cast<int>(fc_type));
  TORCH_CHECK(per32 > 0 && bytes % per32 == 0 && fc.size(0) == hidden,
              "native draft: fc must be [hidden, taps * hidden / 32 blocks]");
  fc_ = block_proj(fc, fc_type, fc_bias, bytes / per32 * 32);
}

void NativeDraft::inject(at::Tensor taps, at::Tensor positions, at::Tensor slots, bool int8) {
  TORCH_CHECK(taps.scalar_type() == at::kFloat && taps.dim() == 2 && taps.size(1) == fc_.k && taps.is_contiguous(),
              "native draft: taps must be contiguous float32 [T, ", fc_.k, "]");
  const int64_t T = taps.size(0);
  const int64_t* pos = long_ptr(positions, T, "positions");
  const int64_t* loc = long_ptr(slots, T, "slots");
  const SpinScope spinning;
  at::Tensor ctx = at::empty({T, hidden_}, taps.options());
  float* cp = ctx.data_ptr<float>();
  run_proj(fc_, taps.data_ptr<float>(), T, cp, int8);
  for (int64_t t = 0; t < T; ++t) rms_row(cp + t * hidden_, hidden_norm_.data_ptr<float>(), cp + t * hidden_, hidden_, eps_);
  store_kv_of(cp, T, pos, loc, int8);
}

void NativeDraft::set_heads(at::Tensor mask_emb, at::Tensor lm_head, int64_t lm_type,
                            std::optional<at::Tensor> lm_bias, at::Tensor w1, at::Tensor w2p,
                            std::optional<at::Tensor> d2t, std::optional<at::Tensor> conf_w, double conf_b,
                            int64_t block, int64_t shift) {
  TORCH_CHECK(mask_emb.scalar_type() == at::kFloat && mask_emb.is_contiguous() && mask_emb.numel() == hidden_,
              "native draft: mask_emb must be contiguous float32 [hidden]");
  mask_emb_ = mask_emb;
  lm_ = block_proj(lm_head, lm_type, lm_bias, hidden_);
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == at::kFloat && w1.is_contiguous(),
              "native draft: w1 must be contiguous float32 [vocab, r]");
  const int64_t V = lm_.n, r = w1.size(1);
  TORCH_CHECK(w2p.scalar_type() == at::kFloat && w2p.is_contiguous() &&
                  w2p.numel() == (V + kMarkovTile - 1) / kMarkovTile * kMarkovTile * r,
              "native draft: w2p must be markov_pack(W2 [V, r]) for the LM head's V");
  d2t_ = at::Tensor();
  if (d2t.has_value() && d2t->defined()) {
    TORCH_CHECK(d2t->scalar_type() == at::kLong && d2t->numel() == V && d2t->is_contiguous(),
                "native draft: d2t must be contiguous int64 [V]");
    d2t_ = *d2t;
  }
  conf_w_ = at::Tensor();
  if (conf_w.has_value() && conf_w->defined()) {
    TORCH_CHECK(conf_w->scalar_type() == at::kFloat && conf_w->is_contiguous() &&
                    (conf_w->numel() == hidden_ || conf_w->numel() == hidden_ + r),
                "native draft: the confidence weight must be float32 [hidden] or [hidden + r]");
    conf_w_ = *conf_w;
  }
  TORCH_CHECK(block > 0 && shift >= 0 && shift < block, "native draft: bad block / shift");
  w1_ = w1, w2p_ = w2p, conf_b_ = static_cast<float>(conf_b), block_ = block, shift_ = shift;
}

std::tuple<at::Tensor, at::Tensor> NativeDraft::propose(at::Tensor anchors, at::Tensor anchor_emb,
                                                        at::Tensor kv_indices, std::vector<int64_t> ctx_lens,
                                                        at::Tensor block_slots, bool int8,
                                                        std::optional<at::Tensor> mask_rows,
                                                        std::vector<int64_t> anchor_pos) {
  TORCH_CHECK(block_ > 0, "native draft: set_heads first");
  const int64_t B = static_cast<int64_t>(ctx_lens.size()), G = block_, Gd = G - shift_, d = hidden_;
  const int64_t V = lm_.n, r = w1_.size(1);
  const int64_t* anchor = long_ptr(anchors, B, "anchors");
  TORCH_CHECK(anchor_emb.scalar_type() == at::kFloat && anchor_emb.is_contiguous() && anchor_emb.dim() == 2 &&
              anchor_emb.size(0) == B && anchor_emb.size(1) == d,
              "native draft: anchor_emb must be contiguous float32 [B, hidden]");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.dim() == 2 && kv_indices.size(0) == B &&
              kv_indices.stride(1) == 1, "native draft: kv_indices must be int64 [B, L], rows contiguous");
  TORCH_CHECK(block_slots.scalar_type() == at::kLong && block_slots.is_contiguous() && block_slots.numel() >= B * G,
              "native draft: block_slots must be contiguous int64, ", B * G, " of them at least");
  const bool own_masks = mask_rows.has_value() && mask_rows->defined();
  TORCH_CHECK(!own_masks || (mask_rows->scalar_type() == at::kFloat && mask_rows->is_contiguous() &&
                             mask_rows->dim() == 2 && mask_rows->size(0) == B && mask_rows->size(1) == d),
              "native draft: mask_rows must be contiguous float32 [B, hidden]");
  TORCH_CHECK(anchor_pos.empty() || static_cast<int64_t>(anchor_pos.size()) == B,
              "native draft: anchor_pos must hold one position per request (or none)");
  const int64_t L = kv_indices.size(1);
  const int64_t* own = block_slots.data_ptr<int64_t>();

  // The blocks: [anchor, mask x (G-1)] at positions ctx .. ctx + G - 1; request b's keys are its
  // context, then its block rows' slots.
  at::Tensor x = at::empty({B * G, d}, at::kFloat), pos = at::empty({B * G}, at::kLong);
  at::Tensor table = at::zeros({B, L + G}, at::kLong);
  float* xp = x.data_ptr<float>();
  int64_t *pp = pos.data_ptr<int64_t>(), *tp = table.data_ptr<int64_t>();
  std::vector<int64_t> seq_lens(B), q_lens(B, G);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = ctx_lens[b];
    TORCH_CHECK(n >= 0 && n <= L, "native draft: ctx_lens[", b, "] = ", n, " is outside kv_indices' ", L);
    const int64_t* kv = kv_indices.data_ptr<int64_t>() + b * kv_indices.stride(0);
    if (std::find(kv, kv + n, 0) != kv + n) return {};     // a gap: before any pool write
    std::copy(kv, kv + n, tp + b * (L + G));
    const float* mask = own_masks ? mask_rows->data_ptr<float>() + b * d : mask_emb_.data_ptr<float>();
    const int64_t at = anchor_pos.empty() ? n : anchor_pos[b];
    TORCH_CHECK(at >= n, "native draft: anchor_pos[", b, "] = ", at, " is before its ", n, " context rows");
    for (int64_t j = 0; j < G; ++j) {
      const float* src = j == 0 ? anchor_emb.data_ptr<float>() + b * d : mask;
      std::copy(src, src + d, xp + (b * G + j) * d);
      pp[b * G + j] = at + j;
      tp[b * (L + G) + n + j] = own[b * G + j];
    }
    seq_lens[b] = n + G;
  }
  at::Tensor out_loc = block_slots.narrow(0, 0, B * G);
  at::Tensor h = forward(x, pos, out_loc, table, 0, std::nullopt, std::nullopt, 0, seq_lens, q_lens, {}, int8,
                         false)[0];

  // The drafts' rows (after the leading `shift`), the LM head over them, the Markov loop.
  at::Tensor rows = shift_ == 0 ? h : h.view({B, G, d}).narrow(1, shift_, Gd).contiguous().view({B * Gd, d});
  const float* hp = rows.data_ptr<float>();
  const SpinScope spinning;
  at::Tensor base = at::empty({B * Gd, V}, at::kFloat);
  run_proj(lm_, hp, B * Gd, base.data_ptr<float>(), int8);
  at::Tensor tokens = at::empty({B, Gd}, at::kLong), embs = at::empty({B * Gd, r}, at::kFloat);
  float* ep = embs.data_ptr<float>();
  markov_greedy_into(base.data_ptr<float>(), B, Gd, V, w1_.data_ptr<float>(), w1_.size(0), r,
                     w2p_.data_ptr<float>(), d2t_.defined() ? d2t_.data_ptr<int64_t>() : nullptr, anchor,
                     tokens.data_ptr<int64_t>(), ep);

  // P(slot accepted | prefix accepted) = sigmoid(w . [hidden; code] + b)
  at::Tensor conf;
  if (conf_w_.defined()) {
    conf = at::empty({B, Gd}, at::kFloat);
    const float* w = conf_w_.data_ptr<float>();
    const bool with_code = conf_w_.numel() == d + r;
    for (int64_t i = 0; i < B * Gd; ++i) {
      float z = conf_b_;
      for (int64_t k = 0; k < d; ++k) z += w[k] * hp[i * d + k];
      if (with_code)
        for (int64_t k = 0; k < r; ++k) z += w[d + k] * ep[i * r + k];
      conf.data_ptr<float>()[i] = 1.0f / (1.0f + std::exp(-z));
    }
  }
  return {tokens, conf};
}

}  // namespace sparkserve
