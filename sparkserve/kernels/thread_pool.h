// The kernels' own thread pool, in place of at::parallel_for (OpenMP) for the work they split.
// Inside a native step (a SpinScope) its workers spin between jobs, so the next of the ~150 jobs
// back to back starts without a wake-up; outside one they spin only briefly and then sleep, so
// they neither take the cores from the torch (OpenMP) ops that run between kernel calls on the
// Python layer path nor burn CPU in an idle engine. A job is cut into more chunks than threads:
// each thread runs its own contiguous range of them first (one stretch of weights to stream, which
// the hardware prefetcher follows), then takes the others' leftovers, so when another process
// holds a core the other threads take its share instead of the whole step waiting for it. No
// OMP_WAIT_POLICY tuning.
#pragma once
#include <cstdint>
#include <functional>

namespace sparkserve {

// f(lo, hi) over [begin, end) in chunks of at least `grain` items, on up to at::get_num_threads()
// threads (the caller's included). Runs inline when there is one chunk, when called from inside a
// job, or while another thread's job holds the pool. An exception in f is rethrown here.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

// While one lives, idle workers keep spinning for the next job (a run of kernel calls with
// nothing else in between).
class SpinScope {
 public:
  SpinScope();
  ~SpinScope();
  SpinScope(const SpinScope&) = delete;
  SpinScope& operator=(const SpinScope&) = delete;
};

}  // namespace sparkserve
