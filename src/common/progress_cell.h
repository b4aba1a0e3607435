// Progress cells: how a worker tells its agent "I made a step" for the price of
// two atomic stores. The agent creates one POSIX shared-memory object per node
// (ProgressCells below) holding one 64-byte cell per local rank, and hands its
// name to the workers in BALLAST_PROGRESS_SHM; worker LOCAL_RANK writes cell
// LOCAL_RANK (`ballast.step(n)` in Python, python/bindings/ballast_module.cc).
// The agent only reads the cells (src/agent/progress_monitor.h).
//
// Header-only on purpose: the Python extension maps the same layout without
// linking the agent.
//
// Thread safety: every field is a lock-free atomic; one writer (the worker) and
// any number of readers. Readers tolerate torn combinations (a step with the
// previous timestamp): they only decide timeouts of seconds.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>

namespace ballast {

// The environment variable that names the node's progress shm object.
inline constexpr char kProgressShmEnv[] = "BALLAST_PROGRESS_SHM";
// First 8 bytes of the object: tells a stale or foreign object apart.
inline constexpr uint64_t kProgressMagic = 0x33676f7270626c62ULL;  // "blbprog3"

// A bad loss a worker saw (health/health_policy.h), in its cell.
enum class HealthKind : uint64_t { kNone = 0, kNonFinite = 1, kSpike = 2 };

struct alignas(64) ProgressCell {
  std::atomic<uint64_t> step{0};            // the last step the worker reported
  std::atomic<uint64_t> timestamp_ns{0};    // CLOCK_MONOTONIC of that report; 0 = none yet
  std::atomic<uint64_t> checkpoint_ns{0};   // CLOCK_MONOTONIC when a checkpoint save began; 0 = none
  std::atomic<uint64_t> reports{0};         // how many step() calls (step numbers may repeat)
  // Checkpoint saves this round and the time training was blocked by them
  // (a blocking save; the wait for an overlapped one), for the master's
  // goodput accountant. Added to by the worker only.
  std::atomic<uint64_t> ckpt_saves{0};
  std::atomic<uint64_t> ckpt_stall_ns{0};
  // Training health: the first bad loss of this round (ballast.step(step,
  // loss=)). The worker writes the details, then `health_kind` (release);
  // the agent reads health_kind (acquire), then the details. Written once
  // per round: the worker stops making progress after it.
  std::atomic<uint64_t> health_kind{0};      // HealthKind
  std::atomic<uint64_t> health_step{0};
  std::atomic<uint64_t> health_value{0};     // the loss (double bits)
  std::atomic<uint64_t> health_median{0};    // a spike: the recent median (double bits)
  std::atomic<uint64_t> health_z{0};         // a spike: its robust z-score (double bits)
  // The bad step's samples (an ElasticSampler's global positions); end 0: unknown.
  std::atomic<uint64_t> health_epoch{0};
  std::atomic<uint64_t> health_begin{0};
  std::atomic<uint64_t> health_end{0};
  // The newest parameter fingerprint (ballast.step(step, model=)): value and
  // group first, then fp_step (release); the agent reads fp_step (acquire)
  // and sends each new one to the master. 0: none this round.
  std::atomic<uint64_t> fp_step{0};
  std::atomic<uint64_t> fp_value{0};
  std::atomic<uint64_t> fp_group{0};
  // The rank's own compute time per forward pass (ballast.step(step,
  // model=): the median of its recent forward passes, in ns; 0 = unknown):
  // unlike the step time, which synchronous training makes the same on
  // every rank, it shows which rank is slow (the master's straggler check).
  std::atomic<uint64_t> compute_ns{0};
  // The rollback target of silent data corruption (python/ballast/checkpoint.py
  // keeps it pinned). sdc_agreed: written by the agent, the newest step at
  // which the master found every rank's fingerprints equal (kept across
  // rounds). sdc_wait: written by the worker, a check step whose verdict it
  // waits for before it unpins the older target (0: none); the agent then
  // reports at once to hear the verdict. (They took the cell's padding: a
  // worker and an agent of the release before read them as 0.)
  std::atomic<uint64_t> sdc_agreed{0};
  std::atomic<uint64_t> sdc_wait{0};
  // CLOCK_MONOTONIC when the worker began to exit (its interpreter's atexit
  // handlers ran: `import ballast` registers one); 0 = not exiting. Tearing
  // down torch takes seconds under load: the agent then allows
  // BALLAST_HANG_EXIT_GRACE_S instead of the hang timeout. (Padding before.)
  std::atomic<uint64_t> exiting_ns{0};
};
static_assert(sizeof(ProgressCell) == 192);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct alignas(64) ProgressHeader {
  uint64_t magic = kProgressMagic;
  uint64_t num_cells = 0;
};
static_assert(sizeof(ProgressHeader) == 64);

// Bytes of a progress object with n cells.
inline constexpr size_t ProgressShmSize(size_t n) { return sizeof(ProgressHeader) + n * sizeof(ProgressCell); }

// Cell i of a mapped progress object.
inline ProgressCell* ProgressCellAt(void* base, size_t i) {
  return reinterpret_cast<ProgressCell*>(static_cast<char*>(base) + sizeof(ProgressHeader)) + i;
}

inline uint64_t MonotonicNowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ULL + static_cast<uint64_t>(ts.tv_nsec);
}

// The worker side of one step: the step first, then the timestamp with release
// order, so a reader that sees the new timestamp sees the new step too.
inline void RecordStep(ProgressCell* cell, uint64_t step, uint64_t now_ns) {
  cell->step.store(step, std::memory_order_relaxed);
  cell->reports.store(cell->reports.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  cell->timestamp_ns.store(now_ns, std::memory_order_release);
}

}  // namespace ballast
