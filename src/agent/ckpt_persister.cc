#include "agent/ckpt_persister.h"

#include <set>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "ckpt/format.h"
#include "ckpt/persister.h"
#include "ckpt/reader.h"
#include "common/status_macros.h"
#include "common/thread_priority.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

// FNV-1a: stable across builds and platforms (std::hash is not), so the same
// job id always gives the same name prefix.
uint32_t Fnv1a(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsCancelled(s);
}

}  // namespace

std::string CkptStorePrefix(const std::string& job_id, pid_t pid) {
  return absl::StrFormat("/ballast-%08x-%d", Fnv1a(job_id), static_cast<int>(pid));
}

int RemoveStaleAgentShmObjects(const std::string& shm_dir) {
  namespace fs = std::filesystem;
  int removed = 0;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(shm_dir, ec)) {
    // Checkpoint stores: ballast-<8 hex>-<pid>-<local rank>[.s<slot>], replica
    // stores ballast-<8 hex>-<pid>-r<source rank>[.s<slot>];
    // progress cells (progress_monitor.h): ballast-progress-<pid>.
    static const std::regex kAgentObject(
        "ballast-(?:[0-9a-f]{8}-([0-9]{1,9})-r?[0-9]+(?:\\.s[0-9]+)?|progress-([0-9]{1,9}))");
    const std::string name = de.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, kAgentObject)) continue;
    int pid = 0;
    const std::string pid_text = m[1].matched ? m[1].str() : m[2].str();
    if (!absl::SimpleAtoi(pid_text, &pid) || pid <= 0 || pid == getpid()) continue;
    // Only a pid that certainly does not exist: EPERM means it lives (another user's).
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (fs::remove(de.path(), ec)) ++removed;
  }
  if (removed > 0) spdlog::info("removed {} shared-memory objects of dead agents", removed);
  return removed;
}

CkptPersister::CkptPersister(CkptPersisterOptions options, ShardReporter reporter)
    : options_(std::move(options)), reporter_(std::move(reporter)) {}

absl::StatusOr<std::unique_ptr<CkptPersister>> CkptPersister::Create(CkptPersisterOptions options,
                                                                     ShardReporter reporter) {
  std::unique_ptr<CkptPersister> p(new CkptPersister(std::move(options), std::move(reporter)));
  ckpt::SlotStoreOptions so;
  // A save proceeds while the previous step is persisted; an overlapped
  // saver (save(blocking=False)) also keeps the step before its newest, the
  // one the world has in common when a rank dies mid-save (the third slot is
  // sized only by such a saver; a fourth with peer replicas: num_slots).
  so.num_slots = p->options_.num_slots;
  so.initial_slot_bytes = 0;
  so.prefault = true;
  so.replace_existing = true;
  for (int lr = 0; lr < p->options_.local_world_size; ++lr) {
    auto s = std::make_unique<Store>();
    s->local_rank = lr;
    // On error the stores created so far are unlinked by their destructors.
    ASSIGN_OR_RETURN(s->slots, ckpt::SlotStore::Create(absl::StrCat(p->options_.name_prefix, "-", lr), so));
    p->stores_.push_back(std::move(s));
  }
  return p;
}

CkptPersister::~CkptPersister() { Stop(); }

void CkptPersister::Start() {
  if (!threads_.empty()) return;
  // One thread per store: writing one rank's shard (a file write and fsync)
  // must not hold up another's, whose step newer saves would overwrite meanwhile.
  for (auto& sp : stores_) threads_.emplace_back([this, store = sp.get()] { Loop(*store); });
}

void CkptPersister::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  // A breakpoint save handed to the thread is written even when stopping.
  for (auto& sp : stores_) WriteBreakpointAndReport(*sp, options_.breakpoint_report_timeout_s);
}

void CkptPersister::Loop(Store& store) {
  LowerThisThreadForCopies(options_.copy_nice, "ckpt-persist");
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    PollStore(store);
    lock.lock();
    cv_.wait_for(lock, std::chrono::duration<double>(options_.poll_interval_s), [&] { return stop_; });
  }
}

std::string CkptPersister::Keys(const ckpt::PersistConfig& cfg) const {
  return absl::StrCat("node=", options_.node_id, " rank=", cfg.rank, " round=", round_.load());
}

void CkptPersister::PollOnce() {
  for (auto& sp : stores_) PollStore(*sp);
}

void CkptPersister::PollStore(Store& s) {
  WriteBreakpointAndReport(s, options_.report_timeout_s);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    PollStoreLocked(s);
  }
  ReportPending(s, options_.report_timeout_s);
}

std::vector<std::string> CkptPersister::TakeWriteErrors() {
  std::lock_guard<std::mutex> lock(errors_mu_);
  std::vector<std::string> out;
  out.swap(write_errors_);
  return out;
}

void CkptPersister::PollStoreLocked(Store& s) {
  std::optional<ckpt::PersistConfig> cfg = s.slots->GetPersistConfig();
  if (!cfg.has_value()) return;  // the worker never asked for persistence
  const auto now = Clock::now();
  const uint64_t requested = s.slots->requested_persist_step();
  const uint64_t durable = s.slots->durable_step();
  if (requested > durable && requested != s.skipped_request &&
      !(requested == s.failed_step && now < s.retry_at)) {
    absl::StatusOr<ckpt::PinnedSlot> pin = s.slots->PinNewestAtMost(requested);
    // Newer steps the worker did not ask to persist overwrote the request
    // (every other slot pinned): persisting a newer step would leave a shard
    // no other rank writes. Wait for the worker's next request; the worker's
    // wait() hears why instead of waiting for the step.
    auto lost = [&](const std::string& why) {
      s.skipped_request = requested;
      spdlog::warn("checkpoint step {} can no longer be persisted ({}); waiting for the next persist request {}",
                   requested, why, Keys(*cfg));
      s.slots->ReportPersistError(
          requested, absl::StrCat("step ", requested,
                                  " was overwritten in shared memory by newer saves before the agent could "
                                  "persist it; save with persist=True less often than every save, or wait() "
                                  "before the next save"));
    };
    if (!pin.ok()) {
      lost(std::string(pin.status().message()));
    } else if (pin->step() <= durable) {  // older than requested: the request is gone
      lost(absl::StrCat("the newest step held before it is ", pin->step(), ", already on disk"));
    } else {
      const uint64_t step = pin->step();
      absl::Status st = PersistLocked(s, *std::move(pin), *cfg);
      if (st.ok()) {
        s.failed_attempts = 0;
      } else {
        s.failed_attempts = s.failed_step == requested ? s.failed_attempts + 1 : 1;
        s.failed_step = requested;
        s.retry_at = now + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(options_.retry_after_s));
        const bool give_up = s.failed_attempts >= CkptPersisterOptions::kMaxWriteAttempts;
        if (give_up) s.skipped_request = requested;  // the next request tries again
        {
          std::lock_guard<std::mutex> lock(errors_mu_);
          if (write_errors_.size() < 16) {
            write_errors_.push_back(absl::StrCat("rank ", cfg->rank, ": cannot write checkpoint step ", step, " to ",
                                                 cfg->dir, ": ", st.message()));
          }
        }
        spdlog::error("cannot persist checkpoint step {} to {}: {} ({}) {}", step, cfg->dir, st.ToString(),
                      give_up ? absl::StrCat("gave up on this step after ", s.failed_attempts,
                                             " attempts; the next persist request tries again")
                              : absl::StrCat("attempt ", s.failed_attempts, ", retrying in ", options_.retry_after_s, " s"),
                      Keys(*cfg));
        s.slots->ReportPersistError(
            requested, give_up ? absl::StrCat("the agent gave up writing step ", step, " to ", cfg->dir, " after ",
                                              s.failed_attempts, " attempts (check the disk; the next persist "
                                              "request tries again): ", st.message())
                               : absl::StrCat("the agent cannot write step ", step, " to ", cfg->dir, ": ",
                                              st.message(), " (it retries every ", options_.retry_after_s, " s)"));
      }
    }
  }
  // Commits made by other agents: `latest` is the truth about what is
  // globally committed (it only moves after COMPLETE). Cheap (a tiny file),
  // and only read while this store has a durable step not known committed.
  if (s.slots->committed_step() < s.slots->durable_step() && Clock::now() >= s.next_latest_check) {
    s.next_latest_check = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options_.latest_check_interval_s));
    absl::StatusOr<uint64_t> latest = ckpt::ReadLatestStep(cfg->dir);
    if (latest.ok()) s.slots->MarkCommitted(*latest);
  }
}

absl::Status CkptPersister::PersistLocked(Store& s, ckpt::PinnedSlot pin, const ckpt::PersistConfig& cfg) {
  const uint64_t step = pin.step();
  const auto start = Clock::now();
  // Header and index only (the data checksum travels in the header and is
  // verified by whoever loads the file): never write something that is not a
  // checkpoint image under a shard's name.
  ckpt::ParseOptions parse;
  parse.verify_data = false;
  RETURN_IF_ERROR(ckpt::ParseImage(pin.image(), pin.image_bytes(),
                                   absl::StrCat("shm:", ckpt::SlotStore::SlotName(s.slots->name(), pin.slot())), parse)
                      .status());
  if (options_.before_write) RETURN_IF_ERROR(options_.before_write(step, cfg.dir));
  // The pin keeps the writer off this slot while we write it, without a copy.
  RETURN_IF_ERROR(ckpt::WriteShardFile(cfg.dir, step, cfg.rank, pin.image(), pin.image_bytes()));
  pin.Release();
  // Only after the shard's rename and the directory fsync: a worker waiting on
  // durable_step() may then rely on the file surviving a crash.
  // With the write's time: what a persist costs, which the worker's pacing of
  // its requests weighs against its step time (--ckpt-copy-share).
  s.slots->MarkDurable(step, std::chrono::duration<double>(Clock::now() - start).count());
  s.unreported = Store::Unreported{step, cfg};
  s.report_retry_at = Clock::now();  // due at once
  return absl::OkStatus();
}

void CkptPersister::ReportPending(Store& s, double timeout_s) {
  Store::Unreported u;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.unreported.has_value() || Clock::now() < s.report_retry_at) return;
    u = *std::move(s.unreported);
    s.unreported.reset();  // ours to report; put back below if it must be retried
  }
  v1::ShardDurableReport report;
  report.set_node_id(options_.node_id);
  report.set_round(round_.load());
  report.set_step(static_cast<int64_t>(u.step));
  report.set_rank(u.config.rank);
  report.set_world_size(u.config.world_size);
  report.set_dir(u.config.dir);
  absl::StatusOr<v1::ShardDurableResponse> r =
      reporter_ ? reporter_(report, timeout_s) : absl::UnavailableError("no master to report to");
  bool commit = false;
  if (r.ok()) {
    commit = r->commit();
  } else if (Retryable(r.status())) {
    // Without the master (lost, or gone after the job ended) the shards on
    // disk are still the truth: commit when every rank's is there. Commits
    // are serialized by a lock file and idempotent, so a later commit by the
    // master's chosen reporter does no harm.
    commit = ckpt::AllShardsDurable(u.config.dir, u.step, u.config.world_size);
    bool warn = false;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!commit && u.step >= s.slots->durable_step() && !s.unreported.has_value()) {
        // Retried later, unless a newer shard of this store became durable
        // meanwhile (its report stands for this store's progress).
        s.unreported = u;
        s.report_retry_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(options_.retry_after_s));
      }
      warn = commit || s.report_warned_step != u.step;
      s.report_warned_step = u.step;
    }
    if (warn) {
      spdlog::warn("could not report durable checkpoint step {} to the master: {}{} {}", u.step,
                   r.status().ToString(),
                   commit ? "; all shards are on disk, committing it here" : "; retrying", Keys(u.config));
    }
  } else {
    spdlog::error("the master refused the durable checkpoint step {}: {} {}", u.step, r.status().ToString(),
                  Keys(u.config));
  }
  if (!commit) return;
  absl::Status c = ckpt::CommitStep(u.config.dir, u.step, u.config.world_size, u.config.keep_last);
  if (!c.ok()) {
    spdlog::error("cannot commit checkpoint step {} in {}: {} {}", u.step, u.config.dir, c.ToString(),
                  Keys(u.config));
    return;
  }
  s.slots->MarkCommitted(u.step);
  spdlog::info("checkpoint step {} committed in {} ({} ranks) {}", u.step, u.config.dir, u.config.world_size,
               Keys(u.config));
}

int CkptPersister::BreakpointSave(const std::string& why) {
  Pin(why, /*exiting=*/true);  // pins what is to be written, then writes it here
  int written = 0;
  // Once the master failed to answer, don't wait the full deadline for every
  // other store: the reports are retried by the poll thread anyway.
  double report_timeout_s = options_.breakpoint_report_timeout_s;
  for (auto& sp : stores_) {
    Store& s = *sp;
    written += WriteBreakpointAndReport(s, report_timeout_s) ? 1 : 0;
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.unreported.has_value()) report_timeout_s = 0.2;
  }
  return written;
}

int CkptPersister::BreakpointSaveAsync(const std::string& why) { return Pin(why, /*exiting=*/false); }

int CkptPersister::Pin(const std::string& why, bool exiting) {
  int pinned = 0;
  for (auto& sp : stores_) {
    Store& s = *sp;
    std::lock_guard<std::mutex> lock(s.bp_mu);  // not s.mu: a write in progress must not hold up a restart
    std::optional<ckpt::PersistConfig> cfg = s.slots->GetPersistConfig();
    if (!cfg.has_value()) continue;
    // A rank that never asked for disk (its Checkpointer only named the
    // folder) gets its last state written when the agent exits (a
    // preemption, a stop, a failed job), not at every restart.
    if (!exiting && s.slots->requested_persist_step() == 0) continue;
    absl::StatusOr<ckpt::PinnedSlot> pin = s.slots->PinLatest();
    if (!pin.ok()) continue;  // nothing in memory
    if (pin->step() <= s.slots->durable_step()) continue;
    if (s.breakpoint.has_value() && s.breakpoint->pin.step() >= pin->step()) continue;  // already pending
    s.breakpoint = Store::PendingBreakpoint{*std::move(pin), *cfg, why, Clock::now()};
    ++pinned;
  }
  if (pinned > 0) cv_.notify_all();
  return pinned;
}

std::string CkptPersister::Rewind(uint64_t below) {
  int slots = 0;
  std::set<std::string> dirs;
  for (auto& sp : stores_) {
    Store& s = *sp;
    std::lock_guard<std::mutex> lock(s.mu);  // a write in progress finishes first
    {
      std::lock_guard<std::mutex> bp_lock(s.bp_mu);
      if (s.breakpoint.has_value() && s.breakpoint->pin.step() >= below) s.breakpoint.reset();
    }
    if (s.unreported.has_value() && s.unreported->step >= below) s.unreported.reset();
    if (s.failed_step >= below) s.failed_step = 0;
    if (s.skipped_request >= below) s.skipped_request = 0;
    if (absl::StatusOr<int> n = s.slots->DiscardFrom(below); n.ok()) {
      slots += *n;
    } else {
      spdlog::warn("rollback: cannot drop steps >= {} from store {}: {} node={}", below, s.slots->name(),
                   n.status().ToString(), options_.node_id);
    }
    if (std::optional<ckpt::PersistConfig> cfg = s.slots->GetPersistConfig(); cfg.has_value()) dirs.insert(cfg->dir);
  }
  std::vector<std::string> deleted;
  for (const std::string& dir : dirs) {
    absl::StatusOr<std::vector<uint64_t>> gone = ckpt::RewindSteps(dir, below);
    if (!gone.ok()) {
      spdlog::warn("rollback: cannot delete steps >= {} in {}: {} node={}", below, dir, gone.status().ToString(),
                   options_.node_id);
      continue;
    }
    for (uint64_t step : *gone) deleted.push_back(absl::StrCat(dir, "/step-", step));
  }
  return absl::StrCat(slots, " in-memory step(s) dropped",
                      deleted.empty() ? "" : absl::StrCat("; deleted ", absl::StrJoin(deleted, ", ")));
}

bool CkptPersister::WriteBreakpointAndReport(Store& s, double report_timeout_s) {
  bool written = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    written = WriteBreakpointLocked(s);
  }
  ReportPending(s, report_timeout_s);
  return written;
}

bool CkptPersister::WriteBreakpointLocked(Store& s) {
  std::optional<Store::PendingBreakpoint> pending;
  {
    std::lock_guard<std::mutex> bp_lock(s.bp_mu);
    pending.swap(s.breakpoint);
  }
  if (!pending.has_value()) return false;
  Store::PendingBreakpoint b = std::move(*pending);
  const uint64_t step = b.pin.step();
  if (step <= s.slots->durable_step()) return false;
  const auto t0 = Clock::now();
  absl::Status st = PersistLocked(s, std::move(b.pin), b.config);
  if (!st.ok()) {
    spdlog::error("breakpoint save of step {} to {} failed: {} {}", step, b.config.dir, st.ToString(), Keys(b.config));
    return false;
  }
  spdlog::info("breakpoint save: step {} of rank {} persisted from memory ({}; {:.3f} s, {:.3f} s after the stop) {}",
               step, b.config.rank, b.why, std::chrono::duration<double>(Clock::now() - t0).count(),
               std::chrono::duration<double>(Clock::now() - b.since).count(), Keys(b.config));
  return true;
}

}  // namespace ballast::agent
