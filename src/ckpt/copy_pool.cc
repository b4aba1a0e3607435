#include "ckpt/copy_pool.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace ballast::ckpt {

void MakeThisThreadBackground() {
  const pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
  sched_param param{};
  param.sched_priority = 0;
  if (sched_setscheduler(tid, SCHED_IDLE, &param) != 0) setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19);
}

CopyPool::CopyPool(int threads, bool background) {
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, background] {
      if (background) MakeThisThreadBackground();
      WorkerLoop();
    });
  }
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void CopyPool::Drain() {
  for (size_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    (*fn_)(i);
  }
}

void CopyPool::WorkerLoop() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    Drain();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++finished_ == workers_.size()) done_cv_.notify_all();
    }
  }
}

void CopyPool::Run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    finished_ = 0;
    ++generation_;
  }
  work_cv_.notify_all();
  Drain();
  // Every worker takes part in every generation (a late one finds no work
  // left), so none can still be reading fn_/n_ when the next Run rewrites them.
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return finished_ == workers_.size(); });
}

void ParallelMemcpy(void* dst, const void* src, size_t n, CopyPool* pool, size_t threshold) {
  if (pool == nullptr || pool->threads() == 1 || n < threshold) {
    std::memcpy(dst, src, n);
    return;
  }
  // A few chunks per thread balances uneven progress; 64-byte aligned splits
  // keep cache lines whole per thread.
  const size_t tasks = static_cast<size_t>(pool->threads()) * 4;
  size_t chunk = (n + tasks - 1) / tasks;
  chunk = std::max<size_t>((chunk + 63) / 64 * 64, 256 << 10);
  const size_t count = (n + chunk - 1) / chunk;
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  pool->Run(count, [&](size_t i) {
    const size_t off = i * chunk;
    std::memcpy(d + off, s + off, std::min(chunk, n - off));
  });
}

}  // namespace ballast::ckpt
