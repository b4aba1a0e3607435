// Journal: the job master's durable state, so a master that crashed (or was
// killed, or its pod restarted) resumes as the same job: same round, same
// members, same restart count, same checkpoint commits.
//
// On disk, in one directory (--journal DIR):
//   journal.log   "BLSTJNL1", then records: u32 length, u64 Checksum64 of the
//                 payload, payload (a serialized v1::JournalRecord), all
//                 little-endian. Append-only.
//   snapshot.pb   "BLSTSNP1", u64 length, u64 checksum, payload (a serialized
//                 v1::MasterSnapshot): the state of every record up to its
//                 last_seq. Written to snapshot.tmp, fsynced, renamed.
// Compaction (when journal.log passes compact_bytes) writes a snapshot of the
// current state, then starts an empty journal.log; a crash between the two
// leaves records the snapshot already holds, which replay skips by seq.
//
// Recovery: a torn or corrupt tail of journal.log (a crash mid-write, a bad
// checksum, a length that runs past the end) is cut off at the last good
// record, with a warning; a snapshot that does not read back whole is an
// error (never a silent reset: the job's state would be lost).
//
// Records are state assignments (journal.proto), applied to a
// v1::MasterSnapshot by ApplyJournalRecord, so replay never re-runs a decision.
//
// Durability: Append(record, sync=true) returns after fdatasync, so a
// decision an agent may already act on (a round, a checkpoint commit, a held
// failure report) is on disk before the master answers or pushes it; other
// records are written at once and reach the disk with the next sync.
//
// Ownership: owns its file descriptor. Thread safety: none; the JobMaster
// calls it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ballast/v1/journal.pb.h"
#include "master/ckpt_commit_tracker.h"

namespace ballast::master {

// Applies one record to a state image. Pure (the journal and the fuzz target
// use it); records that make no sense (a shard outside its world) change
// nothing.
void ApplyJournalRecord(const v1::JournalRecord& record, v1::MasterSnapshot* state,
                        CkptCommitTracker* ckpt);

// The records framed in a journal.log's bytes (after the magic).
struct ParsedJournal {
  std::vector<v1::JournalRecord> records;
  size_t good_bytes = 0;   // bytes up to the end of the last good record
  std::string tail_error;  // why parsing stopped before the end ("" at the end)
};
ParsedJournal ParseJournalRecords(std::string_view data);
// One framed record (length, checksum, payload).
std::string FrameJournalRecord(const v1::JournalRecord& record);

inline constexpr std::string_view kJournalMagic = "BLSTJNL1";
inline constexpr std::string_view kSnapshotMagic = "BLSTSNP1";
// A record longer than this is corrupt (the largest, a round of 100,000
// members, is a few MB).
inline constexpr uint32_t kMaxJournalRecordBytes = 64u << 20;

class Journal {
 public:
  struct Options {
    std::string dir;
    size_t compact_bytes = 16u << 20;  // compact once journal.log is this big
  };
  // Creates the directory if needed, reads the snapshot and replays the log.
  // Errors: the directory cannot be made or written, the snapshot is corrupt.
  static absl::StatusOr<std::unique_ptr<Journal>> Open(Options options);
  // Starts the journal in `dir` from a snapshot kept elsewhere (a master pod
  // that replaced a lost one: kubernetes/master_state.h): writes it as the
  // snapshot and an empty log. Returns false, writing nothing, when `dir`
  // already holds a job (this pod's own journal is the newer one).
  static absl::StatusOr<bool> Seed(const std::string& dir, const v1::MasterSnapshot& snapshot);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // The job it holds (state().has_job()): the master resumes it.
  bool recovered() const { return recovered_; }
  // The state as of the last record, checkpoint dirs included (a copy).
  v1::MasterSnapshot state() const;
  // Its job record alone, without copying the state.
  const v1::JournalJob& job() const { return state_.job(); }
  uint64_t last_seq() const { return state_.last_seq(); }
  // What recovery did, for the master's log ("replayed 1234 records ...").
  const std::string& recovery_note() const { return recovery_note_; }
  const std::string& dir() const { return options_.dir; }

  // Numbers, applies and writes the record (and fdatasyncs with sync).
  absl::Status Append(v1::JournalRecord record, bool sync);
  // Writes a snapshot of the state and starts an empty log.
  absl::Status Compact();
  uint64_t records_written() const { return records_written_; }
  size_t log_bytes() const { return log_bytes_; }

 private:
  explicit Journal(Options options) : options_(std::move(options)) {}
  absl::Status Recover();
  absl::Status WriteSnapshot(const v1::MasterSnapshot& snapshot);
  absl::Status OpenLogForAppend();
  std::string LogPath() const;
  std::string SnapshotPath() const;

  Options options_;
  v1::MasterSnapshot state_;  // ckpt_dirs filled by state()
  CkptCommitTracker ckpt_;
  bool recovered_ = false;
  std::string recovery_note_;
  int fd_ = -1;
  size_t log_bytes_ = 0;
  uint64_t records_written_ = 0;
};

}  // namespace ballast::master
