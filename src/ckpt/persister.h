// Persisting flash checkpoints to disk and committing steps globally.
//
// Layout under a checkpoint directory <dir>:
//   step-<N>/rank-<R>.ballast   one shard per rank (format.h); present = durable
//   step-<N>/COMPLETE           written once every rank's shard of N is durable
//   latest                      decimal N of the newest complete step
//
// Crash-safety reasoning (order of writes):
//  - A shard is written to rank-<R>.ballast.tmp, fsync'ed, renamed to its final
//    name, then the step directory is fsync'ed. A crash before the rename
//    leaves only a .tmp (never read, overwritten by the next attempt, removed
//    by retention); after the rename the file is whole. So "the final name
//    exists" means "the shard is durable".
//  - A step becomes complete only after every rank's shard is durable:
//    COMPLETE is written (temp + fsync + rename + dir fsync) and then `latest`
//    is replaced the same way. A crash at any point leaves `latest` naming the
//    previous complete step, never a partial one. `latest` never moves
//    backwards (a late rank committing an older step does not regress it).
//  - Retention runs only after `latest` moved: it keeps the newest K complete
//    steps and deletes older step directories (and abandoned incomplete ones
//    older than latest), never latest itself or anything newer.
//  - Commits are serialized by flock(<dir>/.commit.lock), so ranks (or agents)
//    sharing a directory on one machine do not race; on network file systems
//    use one committer (the master under `ballast run`).
//
// Who commits: under `ballast run` the master learns of every rank's durable
// shard and performs the global commit (CommitStep); without an agent, each
// process uses LocalCommitCoordinator, which commits as soon as it sees all
// world_size shards of a step on disk.
//
// Thread safety: free functions are thread-safe (commits take the lock);
// Persister is not (one thread uses it; AsyncPersister runs one on its own
// thread).
#pragma once

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
#include "ckpt/slot_store.h"

namespace ballast::ckpt {

struct ShardWriteOptions {
  // write() size; also how often the test hook runs.
  uint64_t chunk_bytes = 16u << 20;
  // Test hook: called after each chunk with the bytes written so far (used to
  // SIGKILL a persister in the middle of a write).
  std::function<void(uint64_t written)> after_chunk_for_test;
};

// Writes image[0, bytes) as rank's shard of step (temp, fsync, rename, dir
// fsync). Creates the step directory.
absl::Status WriteShardFile(const std::string& dir, uint64_t step, int rank, const uint8_t* image,
                            uint64_t bytes, const ShardWriteOptions& options = {});

// True when all world_size shards of step exist under their final names.
bool AllShardsDurable(const std::string& dir, uint64_t step, int world_size);

// The global commit of `step`: marks it COMPLETE, points `latest` at it (unless
// latest is already newer) and applies retention with keep_last. Call only
// when every rank's shard is durable.
absl::Status CommitStep(const std::string& dir, uint64_t step, int world_size, int keep_last);

// A rollback (training health): deletes every step >= `below` (its COMPLETE
// marker first, so a crash halfway leaves an incomplete step, never a wrong
// complete one) and points `latest` at the newest complete step left (no
// `latest` when none is). The one place `latest` moves backwards. Under the
// commit lock. Returns the steps deleted.
absl::StatusOr<std::vector<uint64_t>> RewindSteps(const std::string& dir, uint64_t below);
// Steps with a step-<N> directory, ascending; and those marked COMPLETE.
std::vector<uint64_t> ListSteps(const std::string& dir);
std::vector<uint64_t> ListCompleteSteps(const std::string& dir);

// Keeps the newest keep_last complete steps (at most latest); deletes older
// step directories and incomplete ones older than latest.
absl::Status ApplyRetention(const std::string& dir, int keep_last);

// Decides when a step is globally complete. Seam for the master-coordinated
// implementation (which reports to the master over RPC).
class CommitCoordinatorInterface {
 public:
  virtual ~CommitCoordinatorInterface() = default;
  // Called after rank's shard of step is durable. Returns true when the step
  // is (now) globally committed as far as this caller knows.
  virtual absl::StatusOr<bool> OnShardDurable(uint64_t step, int rank) = 0;
};

// Without an agent: commits when all world_size shards are on disk.
class LocalCommitCoordinator : public CommitCoordinatorInterface {
 public:
  LocalCommitCoordinator(std::string dir, int world_size, int keep_last)
      : dir_(std::move(dir)), world_size_(world_size), keep_last_(keep_last) {}
  absl::StatusOr<bool> OnShardDurable(uint64_t step, int rank) override;

 private:
  const std::string dir_;
  const int world_size_;
  const int keep_last_;
};

struct PersisterOptions {
  std::string dir;
  int rank = 0;
  ShardWriteOptions write;
};

struct PersistResult {
  uint64_t step = 0;
  bool written = false;    // false: that step was already durable
  bool committed = false;  // the coordinator reported a global commit
  uint64_t bytes = 0;
};

// Persists committed slots of a SlotStore (the agent's, or the process's own
// without an agent). The slot is pinned while it is written, so the writer
// keeps saving into the other slot meanwhile.
class Persister {
 public:
  Persister(SlotStore* store, CommitCoordinatorInterface* coordinator, PersisterOptions options);

  // Persists the newest committed step (the "breakpoint save" on worker
  // failure uses this too). kNotFound when the store holds no step.
  absl::StatusOr<PersistResult> PersistNewest() { return Persist(std::nullopt); }
  // Persists the step asked for: the newest committed one <= `limit` (the
  // step itself while it is in memory; a save of a newer step before the
  // persist runs does not replace it), or, when every slot already holds a
  // newer step, the newest one. Nothing when that is on disk already.
  absl::StatusOr<PersistResult> Persist(std::optional<uint64_t> limit);

  std::optional<uint64_t> last_durable_step() const { return last_durable_; }

 private:
  SlotStore* store_;
  CommitCoordinatorInterface* coordinator_;
  PersisterOptions options_;
  std::optional<uint64_t> last_durable_;
};

// Runs a Persister on a background thread: Request(step) after each save;
// WaitDurable(step) blocks until a step >= step is durable on disk.
class AsyncPersister {
 public:
  explicit AsyncPersister(Persister* persister);
  ~AsyncPersister();  // finishes the pending request, then stops

  // Asks for the newest committed step (>= step) to be persisted. Returns
  // immediately; requests coalesce (a slow disk skips intermediate steps).
  void Request(uint64_t step);
  // Waits until a step >= step is durable (OK), the last attempt failed (its
  // error), or timeout_s passed (kDeadlineExceeded). timeout_s < 0: no limit
  // (then the caller must have saved a step >= step, or it waits forever).
  absl::Status WaitDurable(uint64_t step, double timeout_s = -1);

 private:
  void Loop();

  Persister* persister_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<uint64_t> requested_ ABSL_GUARDED_BY(mu_);
  std::optional<uint64_t> durable_ ABSL_GUARDED_BY(mu_);
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
  uint64_t attempts_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace ballast::ckpt
