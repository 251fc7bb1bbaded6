// thread_pool.h. One job at a time: the caller publishes it by bumping `epoch_`. Its chunks are
// split into one contiguous home range per thread (the caller is thread 0); each thread claims its
// own range's chunks from the front, so it streams one contiguous stretch of the weights, then
// takes what is left of the others' from their back ends, so a thread another process holds up
// delays the job by at most the chunk it is in. A range is one atomic word, epoch << 32 |
// front << 16 | back: a worker that arrives after its job ended claims nothing from the next one,
// and the owner and a thief race for the last chunk on one CAS. Each thread adds the chunks it ran
// to `done_` once; the caller returns when it counts every chunk. Workers spin while a SpinScope
// lives, else for SPARKSERVE_SPIN_US (default 20) microseconds after their last job, then sleep on
// a condition variable.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace sparkserve {
namespace {

constexpr int kChunksPerThread = 4;   // claimable pieces per thread: slack for a descheduled one
constexpr int kEpochShift = 32;       // a range's word: epoch << 32 | front << 16 | back
constexpr uint64_t kIndexMask = 0xffff;

// One thread's home range of chunks, on its own cache line (its owner claims from it alone
// unless others run out of work).
struct alignas(64) Range {
  std::atomic<uint64_t> word{0};
};

inline uint64_t range_word(uint64_t epoch, int64_t front, int64_t back) {
  return epoch << kEpochShift | static_cast<uint64_t>(front) << 16 | static_cast<uint64_t>(back);
}

thread_local bool t_in_job = false;
std::atomic<int> g_spin_scopes{0};

int64_t spin_us() {
  static const int64_t us = [] {
    const char* s = std::getenv("SPARKSERVE_SPIN_US");
    return s ? std::max<int64_t>(0, std::atoll(s)) : int64_t{20};
  }();
  return us;
}

class Pool {
 public:
  ~Pool() { resize(0); }

  // Runs the job on `threads` threads (the caller is one). Caller holds run_mutex_.
  void run(int threads, int64_t begin, int64_t chunk, int64_t nchunks, int64_t end,
           const std::function<void(int64_t, int64_t)>& f) {
    if (static_cast<int>(workers_.size()) != threads - 1) resize(threads - 1);
    const uint64_t e = epoch_.load(std::memory_order_relaxed) + 1;
    // Closed first: a worker still in the previous job can claim nothing while the fields change.
    for (int t = 0; t < threads; ++t) ranges_[t].word.store(range_word(e, 0, 0));
    fn_.store(&f);
    begin_.store(begin), end_.store(end), chunk_.store(chunk), threads_.store(threads);
    error_ = nullptr;
    done_.store(0);
    for (int t = 0; t < threads; ++t)
      ranges_[t].word.store(range_word(e, nchunks * t / threads, nchunks * (t + 1) / threads));
    epoch_.store(e, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(sleep_mutex_); }
      wake_.notify_all();
    }
    work(e, 0);
    while (done_.load(std::memory_order_acquire) < nchunks) _mm_pause();
    if (error_) std::rethrow_exception(error_);
  }

  std::mutex run_mutex_;

 private:
  void resize(size_t n) {
    if (!workers_.empty()) {
      stop_.store(true);
      { std::lock_guard<std::mutex> lk(sleep_mutex_); }
      wake_.notify_all();
      for (auto& t : workers_) t.join();
      workers_.clear();
      stop_.store(false);
    }
    ranges_ = std::vector<Range>(n + 1);
    for (size_t i = 0; i < n; ++i)
      workers_.emplace_back([this, i] {
        pthread_setname_np(pthread_self(), "sparkserve-pool");   // named: tools and tests can find them
        loop(static_cast<int>(i) + 1);
      });
  }

  // A chunk of job `e` from range r: its front (the owner) or its back (a thief); -1 when the
  // range is empty or job e is over. The fields are read after the word and before the claim
  // (all sequentially consistent): a claim that succeeds proves the word did not change in
  // between, so they were job e's, and they stay so until this chunk is counted done.
  int64_t claim(Range& r, uint64_t e, bool front) {
    uint64_t w = r.word.load();
    for (;;) {
      if ((w >> kEpochShift) != e) return -1;
      const int64_t lo = static_cast<int64_t>(w >> 16 & kIndexMask), hi = static_cast<int64_t>(w & kIndexMask);
      if (lo >= hi) return -1;
      const uint64_t next = front ? range_word(e, lo + 1, hi) : range_word(e, lo, hi - 1);
      if (r.word.compare_exchange_weak(w, next)) return front ? lo : hi - 1;
    }
  }

  // Runs chunks of job `e` as thread `self`: its own range in order, then the others' leftovers.
  void work(uint64_t e, int self) {
    t_in_job = true;
    const int threads = threads_.load();
    int64_t ran = 0;
    for (int k = 0; k < threads; ++k) {
      const int t = (self + k) % threads;
      int64_t i;
      while ((i = claim(ranges_[t], e, k == 0)) >= 0) {
        const auto* fn = fn_.load();
        const int64_t begin = begin_.load(), end = end_.load(), chunk = chunk_.load();
        try {
          (*fn)(begin + i * chunk, std::min(end, begin + (i + 1) * chunk));
        } catch (...) {
          std::lock_guard<std::mutex> lk(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
        ++ran;
      }
    }
    if (ran) done_.fetch_add(ran, std::memory_order_release);
    t_in_job = false;
  }

  void loop(int self) {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint64_t e;
      while ((e = epoch_.load(std::memory_order_acquire)) == seen && !stop_.load(std::memory_order_relaxed)) {
        _mm_pause();
        if (g_spin_scopes.load(std::memory_order_relaxed) > 0) {
          t0 = std::chrono::steady_clock::now();
        } else if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us())) {
          std::unique_lock<std::mutex> lk(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lk, [&] { return epoch_.load(std::memory_order_seq_cst) != seen || stop_.load(); });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
        }
      }
      if (stop_.load()) return;
      seen = e;
      work(e, self);
    }
  }

  std::vector<std::thread> workers_;
  std::vector<Range> ranges_;      // one per thread, the caller's first
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_, error_mutex_;
  std::condition_variable wake_;
  // The job, written by the caller before the epoch is published (atomics: a worker late for
  // the previous job may read them while they change; its claim then fails).
  std::atomic<const std::function<void(int64_t, int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, chunk_{1};
  std::atomic<int> threads_{1};
  std::exception_ptr error_;
};

// Never destroyed (workers must not be joined during exit); a forked child, which has none of
// the parent's worker threads, starts a fresh one.
Pool* g_pool = nullptr;
std::once_flag g_once;

Pool& pool() {
  std::call_once(g_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool(); });
  });
  return *g_pool;
}

}  // namespace

SpinScope::SpinScope() { g_spin_scopes.fetch_add(1, std::memory_order_relaxed); }
SpinScope::~SpinScope() { g_spin_scopes.fetch_sub(1, std::memory_order_relaxed); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (end <= begin) return;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t range = end - begin;
  const int64_t chunk = std::max<int64_t>({1, grain, (range + threads * kChunksPerThread - 1) /
                                                         (threads * kChunksPerThread)});
  const int64_t nchunks = (range + chunk - 1) / chunk;
  if (threads == 1 || nchunks == 1 || t_in_job) {
    f(begin, end);
    return;
  }
  Pool& p = pool();
  std::unique_lock<std::mutex> lk(p.run_mutex_, std::try_to_lock);
  if (!lk.owns_lock()) {     // another thread's job holds the pool (two engines in one process)
    f(begin, end);
    return;
  }
  p.run(threads, begin, chunk, nchunks, end, f);
}

}  // namespace sparkserve
