// CkptPersister: the agent's side of flash checkpoint under `ballast run`.
//
// What it owns: one ckpt::SlotStore per local rank (shared memory under
// /dev/shm, created before the first round and unlinked when the persister is
// destroyed, i.e. when the agent exits). A store outlives every worker that
// writes it, so a restarted worker finds the previous incarnation's steps in
// memory. Workers find their store through env BALLAST_CKPT_SHM.
//
// The persistence channel (slot_store.h): a worker that wants a step on disk
// sets its PersistConfig (dir, rank, world size, keep) and calls
// RequestPersist(step); it waits for durable_step() >= step. This class
//  - polls every store (its own thread, every poll_interval_s): when
//    requested_persist_step() > durable_step(), pins the newest committed step
//    not newer than the request, writes it as the rank's shard
//    (ckpt::WriteShardFile: temp, fsync, rename, dir fsync), and only then
//    marks it durable: durable_step() never names a step that a crash could
//    still lose;
//  - reports every durable shard to the master (ShardReporter); the one
//    report that completes a step's set of ranks is told to commit, and this
//    agent then runs ckpt::CommitStep (COMPLETE, then `latest`) and marks the
//    step committed in the store;
//  - BreakpointSave(): after the agent stopped its workers (a failure, a new
//    round, a signal), persists each store's newest in-memory step when it is
//    newer than the durable one, so a step that only lived in memory reaches
//    disk: synchronously before the agent exits, and in the background
//    (BreakpointSaveAsync) before a restart, which must not wait for it (only
//    for ranks that asked for disk at least once: a rank whose Checkpointer
//    just named its folder is written when the agent exits).
//
// Threading: one poll thread per store (a slow shard write of one rank must
// not hold up another's), and the agent's main thread (BreakpointSave) may
// touch the same store; a per-store mutex serializes writing it (both write
// the same <shard>.tmp) and is never held across a report to the master: a
// slow master holds up neither a breakpoint save nor the next write.
// SlotStore's pin/inspect/channel calls are thread-safe themselves. The
// reporter is called from both threads and must be thread-safe (MasterClient
// is). set_round is thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ballast/v1/master.pb.h"
#include "ckpt/slot_store.h"

namespace ballast::agent {

// The environment variable that tells a worker which store is its own.
inline constexpr char kCkptShmEnv[] = "BALLAST_CKPT_SHM";
// Comma-separated stores of the replicas this node holds for other ranks
// (set at each round start; see replica.h).
inline constexpr char kCkptReplicasEnv[] = "BALLAST_CKPT_REPLICAS";
// How many peer nodes hold this round's replicas of each rank (min(K, nodes
// - 1); unset: none): every rank of the round sees the same value, so the
// workers' Checkpointer agrees on which steps to replicate (ReplicaPace).
inline constexpr char kCkptReplicaPeersEnv[] = "BALLAST_CKPT_REPLICA_PEERS";

// Reports one durable shard to the master (MasterClient::ReportShardDurable in
// the agent, a fake in tests). Must be thread-safe.
using ShardReporter =
    std::function<absl::StatusOr<v1::ShardDurableResponse>(const v1::ShardDurableReport&, double timeout_s)>;

struct CkptPersisterOptions {
  std::string node_id;
  int local_world_size = 1;
  // Store i is named "<name_prefix>-<i>" (see CkptStorePrefix).
  std::string name_prefix;
  // The store threads' nice value (LowerThisThread; 0: the agent's): the
  // writes yield the cores and the disk to training (--ckpt-copy-nice).
  int copy_nice = 0;
  // Slots per store (SlotStoreOptions::num_slots): 3, and 4 with peer
  // replicas (the sender keeps the replicated step pinned; a slot takes
  // memory only once a save needs it).
  int num_slots = 3;
  // How often the poll thread looks for persist requests.
  double poll_interval_s = 0.025;
  // Deadline of one report from the poll thread, and from a breakpoint save
  // (shorter: it runs on the agent's main loop, possibly with the master gone).
  double report_timeout_s = 5.0;             // Tunables ckpt_report_timeout_s
  double breakpoint_report_timeout_s = 2.0;  // Tunables ckpt_breakpoint_report_timeout_s
  // After a failed shard write or report, wait this long before retrying it.
  double retry_after_s = 1.0;
  static constexpr int kMaxWriteAttempts = 3;  // per requested step
  // How often a store with a durable step not known committed reads
  // <dir>/latest to learn of a commit another agent made.
  double latest_check_interval_s = 0.2;
  // Asked before each shard write (chaos disk-full/disk-error: DiskChaos);
  // an error fails that write as the disk would. Called from the store threads.
  std::function<absl::Status(uint64_t step, const std::string& dir)> before_write;
};

// "/ballast-<8 hex of a hash of job_id>-<pid>": unique per agent process, a
// valid POSIX shm name (one leading '/', short).
std::string CkptStorePrefix(const std::string& job_id, pid_t pid);

// Unlinks the shm objects of agents that died without cleaning up (SIGKILL):
// checkpoint stores named like CkptStorePrefix and progress cells
// ("ballast-progress-<pid>") whose pid no longer exists. Returns how many
// objects were removed. Best effort: errors are ignored.
int RemoveStaleAgentShmObjects(const std::string& shm_dir = "/dev/shm");

class CkptPersister {
 public:
  // The shard writes that failed since the last call, "rank R: <error>"
  // (at most 16 kept between calls), for the agent's progress report.
  std::vector<std::string> TakeWriteErrors();
  // Creates the stores (kUnavailable etc. when /dev/shm cannot hold them; then
  // the caller runs without agent-owned stores).
  static absl::StatusOr<std::unique_ptr<CkptPersister>> Create(CkptPersisterOptions options,
                                                               ShardReporter reporter);
  // Stops the thread; the stores are unlinked.
  ~CkptPersister();
  CkptPersister(const CkptPersister&) = delete;
  CkptPersister& operator=(const CkptPersister&) = delete;

  // Starts / stops the poll threads (one per store). Stop is idempotent.
  void Start();
  void Stop();

  int num_stores() const { return static_cast<int>(stores_.size()); }
  const std::string& store_name(int local_rank) const { return stores_[local_rank]->slots->name(); }
  ckpt::SlotStore* store(int local_rank) { return stores_[local_rank]->slots.get(); }

  // The agent's current round, carried in reports (informational).
  void set_round(int64_t round) { round_ = round; }

  // One pass of the poll threads over every store: persists requested steps, retries failed
  // reports, picks up commits other agents made. Tests call it directly.
  void PollOnce();

  // Persists, for every store with a persist config, the newest committed
  // in-memory step when it is newer than durable_step(). Call only after the
  // workers are stopped (so the newest step is final). Returns the number of
  // shards written; `why` goes into the log line.
  int BreakpointSave(const std::string& why);
  // The same without waiting for the disk: pins each store's newest step now
  // (final: the workers are stopped) and leaves the writing to the poll
  // thread, which does it before anything else for that store. The next
  // round's workers start meanwhile (they restore from memory; their saves
  // never overwrite the pinned step). Stop() and BreakpointSave() finish a
  // pending one first. Returns the number of steps pinned.
  // A store whose rank never asked for disk (requested_persist_step() 0:
  // its Checkpointer only named the folder) is written only by
  // BreakpointSave, when the agent exits, never here.
  int BreakpointSaveAsync(const std::string& why);

  // A rollback (training health; the workers are stopped): waits for a shard
  // write in progress, drops a pending breakpoint save and every step >=
  // `below` from the stores (SlotStore::DiscardFrom) and from the stores'
  // checkpoint directories (ckpt::RewindSteps), so the next workers resume
  // from the newest step before it and no late write makes a dropped step
  // `latest`. Returns what it did, for the log; errors are logged and skipped.
  std::string Rewind(uint64_t below);

 private:
  // BreakpointSaveAsync's work; exiting: BreakpointSave's (stores never asked to persist too).
  int Pin(const std::string& why, bool exiting);
  using Clock = std::chrono::steady_clock;
  struct Store {
    int local_rank = 0;
    std::unique_ptr<ckpt::SlotStore> slots;
    // Serializes writing this store's shards (poll thread vs a final
    // breakpoint save) and guards the fields below; held across a shard
    // write, never across a report (ReportPending).
    std::mutex mu;
    // Guards only `breakpoint`, so BreakpointSaveAsync (the agent's event
    // loop, at a restart) never waits for a write or an RPC in progress.
    // Lock order: mu, then bp_mu.
    std::mutex bp_mu;
    // A breakpoint save the poll thread has yet to write (BreakpointSaveAsync).
    struct PendingBreakpoint {
      ckpt::PinnedSlot pin;
      ckpt::PersistConfig config;
      std::string why;
      Clock::time_point since;
    };
    std::optional<PendingBreakpoint> breakpoint ABSL_GUARDED_BY(bp_mu);
    // A request that cannot be served (its step was overwritten in memory by
    // newer, unrequested steps): not retried until a newer request comes.
    uint64_t skipped_request ABSL_GUARDED_BY(mu) = 0;
    // A failed shard write: retried after retry_at, at most
    // kMaxWriteAttempts times in all (a disk that fails with EIO does not
    // heal by retrying forever); then the step is given up and the next
    // persist request tries again.
    uint64_t failed_step ABSL_GUARDED_BY(mu) = 0;
    int failed_attempts ABSL_GUARDED_BY(mu) = 0;
    Clock::time_point retry_at ABSL_GUARDED_BY(mu);
    // A durable shard the master has not acknowledged yet (report failed).
    struct Unreported {
      uint64_t step = 0;
      ckpt::PersistConfig config;
    };
    std::optional<Unreported> unreported ABSL_GUARDED_BY(mu);
    Clock::time_point report_retry_at ABSL_GUARDED_BY(mu);
    uint64_t report_warned_step ABSL_GUARDED_BY(mu) = 0;  // warn once per step
    Clock::time_point next_latest_check ABSL_GUARDED_BY(mu);
  };

  CkptPersister(CkptPersisterOptions options, ShardReporter reporter);
  void Loop(Store& store);  // one store's thread
  void PollStore(Store& s);
  // PollStore's decisions and write, under s.mu.
  void PollStoreLocked(Store& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Writes the pinned step as cfg.rank's shard and marks it durable; its
  // report is due at once (ReportPending).
  absl::Status PersistLocked(Store& s, ckpt::PinnedSlot pin, const ckpt::PersistConfig& cfg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Writes s.breakpoint, if any (and clears it). Returns true if it wrote one.
  bool WriteBreakpointLocked(Store& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Reports the store's unreported durable shard, if one is due, with s.mu
  // released during the call, and commits the step if told to. A failed
  // report is put back for a retry (unless a newer shard is waiting).
  void ReportPending(Store& s, double timeout_s) ABSL_LOCKS_EXCLUDED(s.mu);
  // Writes, under s.mu, then reports a pending breakpoint save.
  bool WriteBreakpointAndReport(Store& s, double report_timeout_s) ABSL_LOCKS_EXCLUDED(s.mu);
  std::string Keys(const ckpt::PersistConfig& cfg) const;  // "node= rank= round=" log keys

  const CkptPersisterOptions options_;
  const ShardReporter reporter_;
  std::vector<std::unique_ptr<Store>> stores_;
  std::atomic<int64_t> round_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // one per store
  std::mutex errors_mu_;
  std::vector<std::string> write_errors_ ABSL_GUARDED_BY(errors_mu_);
};

}  // namespace ballast::agent
