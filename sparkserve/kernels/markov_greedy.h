// The DSpark Markov head's greedy loop over a block (markov_greedy.cpp), for the binding and for
// the native draft pass (native_draft.cpp).
#pragma once
#include <cstdint>

namespace sparkserve {

// Logits per tile of W2 as markov_pack lays it out: [tiles][r][kMarkovTile], zero rows past V.
constexpr int64_t kMarkovTile = 64;

// base [B, G, V] fp32 slot logits; w1 [vocab, r] (the previous token's code); w2p: W2 [V, r] as
// markov_pack lays it out; d2t [V] (nullptr: draft ids are target ids); anchors [B] target ids,
// each checked against vocab. Writes tokens [B, G] (target ids) and embs [B, G, r].
void markov_greedy_into(const float* base, int64_t B, int64_t G, int64_t V, const float* w1, int64_t vocab,
                        int64_t r, const float* w2p, const int64_t* d2t, const int64_t* anchors, int64_t* tokens,
                        float* embs);

}  // namespace sparkserve
