#include "agent/progress_monitor.h"

#include <bit>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ballast::agent {
namespace {

double NsToS(uint64_t ns) { return static_cast<double>(ns) / 1e9; }
double SecondsBetween(uint64_t from_ns, uint64_t to_ns) { return to_ns > from_ns ? NsToS(to_ns - from_ns) : 0.0; }

}  // namespace

HangVerdict CheckHang(const CellSnapshot& cell, uint64_t now_ns, uint64_t started_ns, const HangOptions& o) {
  HangVerdict v;
  if (o.timeout_s <= 0) return v;
  if (cell.exiting_ns != 0) {
    // Past the training loop: the interpreter tears torch down (seconds under
    // load, no step to report). A worker stuck there for good is still hung.
    v.phase = "exiting";
    v.limit_s = std::max(o.exit_grace_s, o.timeout_s);
    v.idle_s = SecondsBetween(std::max({cell.exiting_ns, cell.timestamp_ns, started_ns}), now_ns);
  } else if (cell.checkpoint_ns != 0) {
    // A save can take much longer than a step: measure from whichever is newer,
    // the save's start or the last step (a step inside a save counts too).
    v.phase = "checkpoint";
    v.limit_s = std::max(o.checkpoint_grace_s, o.timeout_s);
    v.idle_s = SecondsBetween(std::max({cell.checkpoint_ns, cell.timestamp_ns, started_ns}), now_ns);
  } else if (cell.timestamp_ns == 0) {
    v.phase = "first step";
    v.limit_s = std::max(o.first_step_grace_s, o.timeout_s);
    v.idle_s = SecondsBetween(started_ns, now_ns);
  } else {
    v.phase = "training";
    v.limit_s = o.timeout_s;
    // A cell stamped before this worker started (cannot happen after Reset,
    // but be safe) counts from the start.
    v.idle_s = SecondsBetween(std::max(cell.timestamp_ns, started_ns), now_ns);
  }
  v.hung = v.idle_s > v.limit_s;
  return v;
}

double StepTime(const CellSnapshot& before, const CellSnapshot& after) {
  if (after.timestamp_ns == 0 || before.timestamp_ns == 0 || after.step <= before.step ||
      after.timestamp_ns <= before.timestamp_ns)
    return 0;
  return NsToS(after.timestamp_ns - before.timestamp_ns) / static_cast<double>(after.step - before.step);
}

absl::StatusOr<std::unique_ptr<ProgressMonitor>> ProgressMonitor::Create(int num_cells) {
  if (num_cells < 1) return absl::InvalidArgumentError("a progress object needs at least one cell");
  std::string name = absl::StrCat("/ballast-progress-", getpid());
  // A leftover of an earlier agent with our pid (it was SIGKILLed) is ours to reuse.
  shm_unlink(name.c_str());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", std::strerror(errno)));
  const size_t size = ProgressShmSize(static_cast<size_t>(num_cells));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("ftruncate ", name, ": ", std::strerror(err)));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("mmap ", name, ": ", std::strerror(err)));
  }
  auto* header = new (base) ProgressHeader();
  header->num_cells = static_cast<uint64_t>(num_cells);
  for (int i = 0; i < num_cells; ++i) new (ProgressCellAt(base, i)) ProgressCell();
  return std::unique_ptr<ProgressMonitor>(new ProgressMonitor(std::move(name), base, num_cells));
}

ProgressMonitor::ProgressMonitor(std::string name, void* base, int num_cells)
    : name_(std::move(name)), base_(base), num_cells_(num_cells), baseline_(num_cells) {}

ProgressMonitor::~ProgressMonitor() {
  munmap(base_, ProgressShmSize(static_cast<size_t>(num_cells_)));
  shm_unlink(name_.c_str());
}

void ProgressMonitor::Reset() {
  for (int i = 0; i < num_cells_; ++i) {
    ProgressCell* c = ProgressCellAt(base_, i);
    c->step.store(0, std::memory_order_relaxed);
    c->checkpoint_ns.store(0, std::memory_order_relaxed);
    c->reports.store(0, std::memory_order_relaxed);
    c->ckpt_saves.store(0, std::memory_order_relaxed);
    c->ckpt_stall_ns.store(0, std::memory_order_relaxed);
    c->health_kind.store(0, std::memory_order_relaxed);
    c->fp_step.store(0, std::memory_order_relaxed);
    c->compute_ns.store(0, std::memory_order_relaxed);
    c->sdc_wait.store(0, std::memory_order_relaxed);
    c->exiting_ns.store(0, std::memory_order_relaxed);
    c->timestamp_ns.store(0, std::memory_order_release);
  }
  baseline_.assign(num_cells_, CellSnapshot());
  last_step_time_s_ = 0;
}

void ProgressMonitor::SetSdcAgreed(uint64_t step) {
  for (int i = 0; i < num_cells_; ++i) {
    std::atomic<uint64_t>& a = ProgressCellAt(base_, i)->sdc_agreed;
    if (a.load(std::memory_order_relaxed) < step) a.store(step, std::memory_order_release);
  }
}

uint64_t ProgressMonitor::SdcAgreed() const {
  return num_cells_ > 0 ? ProgressCellAt(base_, 0)->sdc_agreed.load(std::memory_order_relaxed) : 0;
}

uint64_t ProgressMonitor::SdcWaiting() const {
  const uint64_t agreed = SdcAgreed();
  uint64_t waiting = 0;
  for (int i = 0; i < num_cells_; ++i) {
    const uint64_t w = ProgressCellAt(base_, i)->sdc_wait.load(std::memory_order_acquire);
    if (w > agreed) waiting = std::max(waiting, w);
  }
  return waiting;
}

CellSnapshot ProgressMonitor::Read(int i) const {
  const ProgressCell* c = ProgressCellAt(base_, i);
  CellSnapshot s;
  s.timestamp_ns = c->timestamp_ns.load(std::memory_order_acquire);
  s.step = c->step.load(std::memory_order_relaxed);
  s.checkpoint_ns = c->checkpoint_ns.load(std::memory_order_relaxed);
  s.reports = c->reports.load(std::memory_order_relaxed);
  s.ckpt_saves = c->ckpt_saves.load(std::memory_order_relaxed);
  s.ckpt_stall_ns = c->ckpt_stall_ns.load(std::memory_order_relaxed);
  s.exiting_ns = c->exiting_ns.load(std::memory_order_relaxed);
  return s;
}

std::optional<HealthRecord> ProgressMonitor::ReadHealth(int i) const {
  const ProgressCell* c = ProgressCellAt(base_, i);
  const uint64_t kind = c->health_kind.load(std::memory_order_acquire);
  if (kind == 0) return std::nullopt;
  HealthRecord h;
  h.kind = kind == static_cast<uint64_t>(HealthKind::kSpike) ? HealthKind::kSpike : HealthKind::kNonFinite;
  h.step = c->health_step.load(std::memory_order_relaxed);
  h.value = std::bit_cast<double>(c->health_value.load(std::memory_order_relaxed));
  h.median = std::bit_cast<double>(c->health_median.load(std::memory_order_relaxed));
  h.z = std::bit_cast<double>(c->health_z.load(std::memory_order_relaxed));
  h.epoch = c->health_epoch.load(std::memory_order_relaxed);
  h.begin = c->health_begin.load(std::memory_order_relaxed);
  h.end = c->health_end.load(std::memory_order_relaxed);
  return h;
}

std::optional<FingerprintRecord> ProgressMonitor::ReadFingerprint(int i) const {
  const ProgressCell* c = ProgressCellAt(base_, i);
  FingerprintRecord f;
  f.step = c->fp_step.load(std::memory_order_acquire);
  if (f.step == 0) return std::nullopt;
  f.value = c->fp_value.load(std::memory_order_relaxed);
  f.group = c->fp_group.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (c->fp_step.load(std::memory_order_relaxed) != f.step) return std::nullopt;  // rewritten meanwhile
  return f;
}

ProgressSummary ProgressMonitor::Summarize() {
  ProgressSummary sum;
  double slowest = 0;
  for (int i = 0; i < num_cells_; ++i) {
    CellSnapshot now = Read(i);
    if (now.timestamp_ns != 0) {
      if (!sum.any_step || now.step < sum.min_step) {
        sum.min_step = now.step;
        sum.min_step_ns = now.timestamp_ns;
      } else if (now.step == sum.min_step) {
        sum.min_step_ns = std::max(sum.min_step_ns, now.timestamp_ns);
      }
      sum.any_step = true;
    }
    sum.ckpt_saves += now.ckpt_saves;
    sum.ckpt_stall_max_s = std::max(sum.ckpt_stall_max_s, static_cast<double>(now.ckpt_stall_ns) / 1e9);
    sum.ckpt_stall_sum_s += static_cast<double>(now.ckpt_stall_ns) / 1e9;
    slowest = std::max(slowest, StepTime(baseline_[i], now));
    sum.compute_time_s = std::max(
        sum.compute_time_s,
        static_cast<double>(ProgressCellAt(base_, i)->compute_ns.load(std::memory_order_relaxed)) / 1e9);
    // The baseline moves only when the worker stepped, so a slow worker's
    // steps that straddle several calls are still measured.
    if (now.timestamp_ns != baseline_[i].timestamp_ns) baseline_[i] = now;
  }
  if (slowest > 0) last_step_time_s_ = slowest;
  sum.step_time_s = last_step_time_s_;
  return sum;
}

}  // namespace ballast::agent
