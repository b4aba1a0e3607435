// CopyPool: a small persistent thread pool for large memory copies, and
// ParallelMemcpy on top of it. Persistent threads avoid thread start-up on
// every save (tens of microseconds per thread).
//
// Thread safety: Run() may be called from any thread; concurrent calls are
// serialized (one parallel job at a time, since a copy already saturates
// memory bandwidth).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace ballast::ckpt {

// Puts the calling thread at idle priority (SCHED_IDLE, else nice 19): it
// runs only on CPU time nothing else wants. For copies that overlap training
// (save(blocking=False)); irreversible for the thread without privileges.
void MakeThisThreadBackground();

class CopyPool {
 public:
  // `threads` is the total parallelism including the calling thread
  // (threads - 1 workers are started); values < 1 mean 1. With background,
  // the workers run at idle priority (MakeThisThreadBackground).
  explicit CopyPool(int threads, bool background = false);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) on the workers and the calling thread and
  // returns when all calls have returned. fn must not throw.
  void Run(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();
  void Drain();

  std::mutex run_mu_;  // serializes Run()
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  size_t finished_ ABSL_GUARDED_BY(mu_) = 0;  // workers done with generation_
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  const std::function<void(size_t)>* fn_ = nullptr;  // valid during a Run
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  std::vector<std::thread> workers_;
};

// Below this many bytes a copy runs on the calling thread: waking workers
// costs more than it saves.
inline constexpr size_t kDefaultParallelCopyThreshold = 4u << 20;

// memcpy(dst, src, n), split over the pool when n >= threshold. pool may be
// null (single-threaded).
void ParallelMemcpy(void* dst, const void* src, size_t n, CopyPool* pool,
                    size_t threshold = kDefaultParallelCopyThreshold);

}  // namespace ballast::ckpt
