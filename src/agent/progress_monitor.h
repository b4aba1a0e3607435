// The agent's side of worker progress (src/common/progress_cell.h): owns the
// node's progress shm object, decides when a worker is hung, and measures the
// node's step time for the master's straggler detection.
//
// Hang rule (CheckHang), per running worker, with S = --hang-timeout:
//  - no step yet: hung once it has run longer than the first-step grace
//    (imports, rendezvous, data loading and compilation come before step 1);
//  - inside a checkpoint save: hung once the save has run longer than the
//    checkpoint grace and the last step is older than that too;
//  - otherwise: hung once its last step is older than S.
// Off (never hung) when S <= 0.
//
// Ownership: a ProgressMonitor owns the shm object and unlinks it when
// destroyed. Threading: not thread-safe; the agent's main loop owns it. The
// workers write the cells concurrently (atomics), the monitor only reads them
// (and zeroes them between rounds, when no worker runs).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/progress_cell.h"

namespace ballast::agent {

struct HangOptions {
  double timeout_s = 0;             // --hang-timeout; <= 0: hang detection off
  double first_step_grace_s = 300;  // BALLAST_HANG_FIRST_STEP_GRACE_S (at least timeout_s)
  double checkpoint_grace_s = 600;  // BALLAST_HANG_CHECKPOINT_GRACE_S (at least timeout_s)
  double exit_grace_s = 120;        // BALLAST_HANG_EXIT_GRACE_S (at least timeout_s)
};

// A copy of one cell.
struct CellSnapshot {
  uint64_t step = 0;
  uint64_t timestamp_ns = 0;   // 0 = never stepped
  uint64_t checkpoint_ns = 0;  // 0 = not in a checkpoint save
  uint64_t reports = 0;
  uint64_t ckpt_saves = 0;
  uint64_t ckpt_stall_ns = 0;
  uint64_t exiting_ns = 0;     // 0 = not exiting
};

// A bad loss a worker recorded in its cell (ballast.step(step, loss=)).
struct HealthRecord {
  HealthKind kind = HealthKind::kNone;
  uint64_t step = 0;
  double value = 0;
  double median = 0;  // a spike: the recent median
  double z = 0;       // a spike: its robust z-score
  uint64_t epoch = 0, begin = 0, end = 0;  // the bad step's samples; end 0: unknown
};

// A parameter fingerprint a worker published (ballast.step(step, model=)).
struct FingerprintRecord {
  uint64_t step = 0;
  uint64_t value = 0;
  uint64_t group = 0;
};

struct HangVerdict {
  bool hung = false;
  double idle_s = 0;      // seconds without progress (since start when no step yet)
  double limit_s = 0;     // the limit that applied
  std::string phase;      // "first step", "checkpoint", "training", "exiting"
};

// Pure rule (see the file comment); started_ns is when the worker was started.
HangVerdict CheckHang(const CellSnapshot& cell, uint64_t now_ns, uint64_t started_ns, const HangOptions& options);

// The node's progress over an interval, from two snapshots of each cell.
struct ProgressSummary {
  bool any_step = false;   // some worker reported a step
  uint64_t min_step = 0;   // the lowest step over the workers that reported one
  uint64_t min_step_ns = 0;  // CLOCK_MONOTONIC when the last worker at min_step reached it
  double step_time_s = 0;  // the slowest worker's mean step time over the interval; 0 = unknown
  // The slowest worker's compute time per forward pass (its cell's
  // compute_ns); 0 = no worker measures it.
  double compute_time_s = 0;
  // Checkpoint saves since the Reset: how many (all workers), the most time
  // one worker was blocked by them, and the time summed over the workers.
  uint64_t ckpt_saves = 0;
  double ckpt_stall_max_s = 0;
  double ckpt_stall_sum_s = 0;
};

// Step time of one worker between two snapshots; 0 when it made no step.
double StepTime(const CellSnapshot& before, const CellSnapshot& after);

class ProgressMonitor {
 public:
  // Creates the shm object "/ballast-progress-<pid>" with num_cells cells.
  static absl::StatusOr<std::unique_ptr<ProgressMonitor>> Create(int num_cells);
  ~ProgressMonitor();
  ProgressMonitor(const ProgressMonitor&) = delete;
  ProgressMonitor& operator=(const ProgressMonitor&) = delete;

  const std::string& name() const { return name_; }
  int num_cells() const { return num_cells_; }

  // Zeroes every cell and forgets the step-time baseline: call before a
  // round's workers start (none may be writing).
  void Reset();
  CellSnapshot Read(int i) const;
  // Cell i's bad loss, if its worker recorded one this round.
  std::optional<HealthRecord> ReadHealth(int i) const;
  // Cell i's newest fingerprint, if one was published this round and is not
  // being rewritten right now.
  std::optional<FingerprintRecord> ReadFingerprint(int i) const;

  // Min step and step time since the previous call (or the Reset).
  ProgressSummary Summarize();

  // The master's newest agreed fingerprint step, for every worker (kept
  // across Reset); the newest check step some worker waits to see agreed (0:
  // none waits for a step newer than the agreed one).
  void SetSdcAgreed(uint64_t step);
  uint64_t SdcAgreed() const;
  uint64_t SdcWaiting() const;

 private:
  ProgressMonitor(std::string name, void* base, int num_cells);

  std::string name_;
  void* base_ = nullptr;
  int num_cells_ = 0;
  std::vector<CellSnapshot> baseline_;
  double last_step_time_s_ = 0;
};

}  // namespace ballast::agent
