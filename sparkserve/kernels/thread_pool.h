// The kernels' own thread pool, in place of at::parallel_for (OpenMP) for the work they split.
// Its workers spin briefly after a job, so the next one (a native step runs ~150 back to back)
// starts without a wake-up, then sleep, so an idle engine burns no CPU; and a job is cut into
// more chunks than threads, claimed one at a time, so when another process holds a core the other
// threads take its share instead of the whole step waiting for it. No OMP_WAIT_POLICY tuning.
#pragma once
#include <cstdint>
#include <functional>

namespace sparkserve {

// f(lo, hi) over [begin, end) in chunks of at least `grain` items, on up to at::get_num_threads()
// threads (the caller's included). Runs inline when there is one chunk, when called from inside a
// job, or while another thread's job holds the pool. An exception in f is rethrown here.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

}  // namespace sparkserve
