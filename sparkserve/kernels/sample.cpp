// Sampling at temperature > 0 from CPU logits, one row per request: temperature, top_k, top_p and
// min_p as executor/sampler.py's processed_probs defines them, and the draw as sample_from_probs
// makes it (the first id, in id order, whose cumulative mass exceeds u times the total).
//
// torch builds each step's distributions from a dozen passes over the whole vocabulary (divide,
// softmax, top-k, masks, renormalize, cumulative sums). Here a row is three vector passes (its
// maximum, its exponentials and their sum, the candidates above a cutoff); top_k, top_p and min_p
// then sort only the candidates. The cutoff starts where min_p (or a small share of the best
// token's mass) cuts and is lowered until the candidates hold what the rule needs, so a flat row
// ends as a sort of the whole vocabulary, as torch's would.
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "simd.h"
#include "thread_pool.h"

namespace {

constexpr float kFirstCutoff = 1.0f / 4096;   // of the best token's mass, when min_p sets none
constexpr float kCutoffStep = 1.0f / 64;

struct Candidate {
  float x;      // logit / temperature
  float e;      // exp(x - max)
  int64_t id;
};

// A row's working buffers, kept per thread: they are larger than malloc hands out from its heap,
// and fresh pages every step would cost more than the row's arithmetic.
struct Scratch {
  std::vector<float> x, e;
  std::vector<double> runs;
  std::vector<Candidate> cand;
};

Scratch& scratch(int64_t V) {
  thread_local Scratch s;
  s.x.resize(V);
  s.e.resize(V);
  return s;
}

// x = logits / temperature; returns their maximum.
float scaled(const float* logits, int64_t n, float temperature, float* x) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(logits + i), t);
    _mm256_storeu_ps(x + i, v);
    top8 = _mm256_max_ps(top8, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) top = std::max(top, x[i] = logits[i] / temperature);
  return top;
}

constexpr int64_t kRun = 512;     // ids per run: summed in float, then added up in double

// e[i] = exp(x[i] - top), 0 for x = -inf (a banned id); runs[j] = the sum over ids
// [j kRun, (j + 1) kRun). Returns the sum of all.
double exponentials(const float* x, int64_t n, float top, float* e, std::vector<double>& runs) {
  const __m256 t = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  runs.assign((n + kRun - 1) / kRun, 0.0);
  double total = 0;
  for (int64_t r = 0; r < (int64_t)runs.size(); ++r) {
    const int64_t end = std::min(n, (r + 1) * kRun);
    int64_t i = r * kRun;
    __m256 part = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 y = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ),
                                        sparkserve::exp256(_mm256_sub_ps(v, t)));
      _mm256_storeu_ps(e + i, y);
      part = _mm256_add_ps(part, y);
    }
    double sum = sparkserve::hsum(part);
    for (; i < end; ++i) {
      e[i] = x[i] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(x[i] - top);
      sum += e[i];
    }
    runs[r] = sum;
    total += sum;
  }
  return total;
}

// The first id whose cumulative e exceeds u times the total, over the whole row: the run that
// holds it by the runs' sums, then id by id within that run.
int64_t draw_all(const float* e, int64_t n, const std::vector<double>& runs, double total, double u) {
  double target = std::min(u * total, std::nextafter(total, 0.0));
  int64_t r = 0;
  while (r + 1 < (int64_t)runs.size() && target >= runs[r]) target -= runs[r++];
  const int64_t end = std::min(n, (r + 1) * kRun);
  double sum = 0;
  int64_t last = r * kRun;
  for (int64_t i = r * kRun; i < end; ++i) {
    if (e[i] > 0) last = i;
    sum += e[i];
    if (sum > target) return i;
  }
  return last;          // the draw sat within a rounding step of the run's end
}

// The ids whose e reaches `cutoff` (all of them at cutoff 0).
void collect(const float* x, const float* e, int64_t n, float cutoff, std::vector<Candidate>& out) {
  out.clear();
  const __m256 c = _mm256_set1_ps(cutoff);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), c, _CMP_GE_OQ));
    while (hit) {
      const int j = __builtin_ctz(hit);
      hit &= hit - 1;
      out.push_back({x[i + j], e[i + j], i + j});
    }
  }
  for (; i < n; ++i)
    if (e[i] >= cutoff) out.push_back({x[i], e[i], i});
}

// The first of `kept` (in id order) whose cumulative mass exceeds u times their total.
int64_t draw(std::vector<Candidate>& kept, double u) {
  std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
  double total = 0;
  for (const Candidate& c : kept) total += c.e;
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  double sum = 0;
  for (const Candidate& c : kept) {
    sum += c.e;
    if (sum > target) return c.id;
  }
  return kept.back().id;
}

int64_t sample_row(const float* logits, int64_t V, float temperature, int64_t top_k, double top_p,
                   double min_p, double u) {
  Scratch& sc = scratch(V);
  std::vector<float>& x = sc.x;
  std::vector<float>& e = sc.e;
  std::vector<Candidate>& cand = sc.cand;
  const float top = scaled(logits, V, temperature, x.data());
  const double total = exponentials(x.data(), V, top, e.data(), sc.runs);
  const bool by_k = top_k > 0 && top_k < V;
  if (!by_k && top_p >= 1.0 && min_p <= 0.0) return draw_all(e.data(), V, sc.runs, total, u);
  // Candidates: every id the rules could keep, found by lowering the cutoff until they hold it.
  float cutoff = min_p > 0.0 ? std::min<float>(min_p, kFirstCutoff) : kFirstCutoff;
  for (;;) {
    collect(x.data(), e.data(), V, cutoff, cand);
    double mass = 0;
    for (const Candidate& c : cand) mass += c.e;
    // top_k needs its k-th value among them (then the nucleus lies in them too); top_p a
    // nucleus's mass; min_p alone is cut by the first cutoff already.
    const bool enough = by_k ? (int64_t)cand.size() >= top_k : top_p >= 1.0 || mass >= top_p * total;
    if (enough || cutoff == 0.0f) break;
    cutoff = cutoff < 1e-30f ? 0.0f : cutoff * kCutoffStep;
  }
  double kept_total = total;
  if (by_k) {                                               // ties with the k-th value stay
    std::nth_element(cand.begin(), cand.begin() + (top_k - 1), cand.end(),
                     [](const Candidate& a, const Candidate& b) { return a.x > b.x; });
    const float kth = cand[top_k - 1].x;
    cand.erase(std::remove_if(cand.begin(), cand.end(), [kth](const Candidate& c) { return c.x < kth; }),
               cand.end());
    kept_total = 0;
    for (const Candidate& c : cand) kept_total += c.e;
  }
  if (top_p < 1.0) {                                        // keep while the mass above is below top_p
    std::sort(cand.begin(), cand.end(), [](const Candidate& a, const Candidate& b) { return a.e > b.e; });
    double above = 0;
    size_t n = 0;
    while (n < cand.size() && (n == 0 || above < top_p * kept_total)) above += cand[n++].e;
    cand.resize(n);
  }
  if (min_p > 0.0)                                          // the best token's e is 1: it stays
    cand.erase(std::remove_if(cand.begin(), cand.end(), [min_p](const Candidate& c) { return c.e < min_p; }),
               cand.end());
  return draw(cand, u);
}

// log_softmax(logits) at `id` and at the row's k best ids (best first, ties by id).
void logprob_row(const float* logits, int64_t V, int64_t id, int64_t k, float* chosen, float* top_v,
                 int64_t* top_i) {
  Scratch& sc = scratch(V);
  std::vector<float>& x = sc.x;
  std::vector<float>& e = sc.e;
  std::vector<Candidate>& cand = sc.cand;
  const float top = scaled(logits, V, 1.0f, x.data());
  const float lse = top + (float)std::log(exponentials(x.data(), V, top, e.data(), sc.runs));
  *chosen = x[id] - lse;
  if (k <= 0) return;
  for (float cutoff = kFirstCutoff;; cutoff = cutoff < 1e-30f ? 0.0f : cutoff * kCutoffStep) {
    collect(x.data(), e.data(), V, cutoff, cand);
    if ((int64_t)cand.size() >= k || cutoff == 0.0f) break;
  }
  const int64_t n = std::min<int64_t>(k, cand.size());
  std::partial_sort(cand.begin(), cand.begin() + n, cand.end(), [](const Candidate& a, const Candidate& b) {
    return a.x > b.x || (a.x == b.x && a.id < b.id);
  });
  for (int64_t j = 0; j < n; ++j) top_v[j] = cand[j].x - lse, top_i[j] = cand[j].id;
}

}  // namespace

// logits [N, V] float32 with contiguous rows; rows: the rows to sample, each with its temperature
// (> 0), top_k (<= 0: off), top_p, min_p and uniform draw u in [0, 1). Returns their ids.
at::Tensor sample_rows(at::Tensor logits, const std::vector<int64_t>& rows, const std::vector<double>& temperature,
                       const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                       const std::vector<double>& min_p, const std::vector<double>& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_rows takes float32 logits [N, V] with contiguous rows");
  const int64_t R = rows.size(), V = logits.size(1);
  for (const auto* v : {&temperature, &top_p, &min_p, &u})
    TORCH_CHECK((int64_t)v->size() == R, "sample_rows needs one temperature, top_p, min_p and u per row");
  TORCH_CHECK((int64_t)top_k.size() == R, "sample_rows needs one top_k per row");
  for (int64_t r : rows) TORCH_CHECK(r >= 0 && r < logits.size(0), "row index out of range");
  at::Tensor out = at::empty({R}, at::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  sparkserve::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      ids[r] = sample_row(x + rows[r] * logits.stride(0), V, (float)temperature[r], top_k[r], top_p[r], min_p[r],
                          u[r]);
  });
  return out;
}

// The logprobs a request asks for: per listed row, log_softmax(logits) at ids[r] and its k best
// entries (best first). Returns (chosen [R], top values [R, k], top ids [R, k]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_rows(at::Tensor logits, const std::vector<int64_t>& rows,
                                                            const std::vector<int64_t>& ids, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logprob_rows takes float32 logits [N, V] with contiguous rows");
  const int64_t R = rows.size(), V = logits.size(1);
  TORCH_CHECK((int64_t)ids.size() == R && k >= 0 && k <= V, "logprob_rows needs one id per row and 0 <= k <= V");
  for (int64_t j = 0; j < R; ++j)
    TORCH_CHECK(rows[j] >= 0 && rows[j] < logits.size(0) && ids[j] >= 0 && ids[j] < V, "row or id out of range");
  at::Tensor chosen = at::empty({R}, at::kFloat), top_v = at::empty({R, k}, at::kFloat),
             top_i = at::empty({R, k}, at::kLong);
  const float* x = logits.data_ptr<float>();
  sparkserve::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      logprob_row(x + rows[r] * logits.stride(0), V, ids[r], k, chosen.data_ptr<float>() + r,
                  top_v.data_ptr<float>() + r * k, top_i.data_ptr<int64_t>() + r * k);
  });
  return {chosen, top_v, top_i};
}
