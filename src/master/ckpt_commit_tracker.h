// CkptCommitTracker: flash-checkpoint commit tracking (master.proto, step 6).
// Counts the durable ranks of each (checkpoint dir, step); the report that
// completes a step's world gets commit = true, exactly once per step.
//
// Bounded: steps at or below a dir's committed step are dropped when a step
// commits, and at most kMaxPendingSteps incomplete steps are kept per dir
// (the oldest go first: a step some rank never persisted can never complete).
// The journal replays the same reports through a tracker of its own, and a
// rollback's Rewind where its round record stands among them
// (ApplyJournalRecord), so a restarted master continues counting where the
// old one stopped, never from a dropped step.
//
// Ownership: plain value type. Thread safety: none; the owner serializes.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ballast/v1/journal.pb.h"

namespace ballast::master {

class CkptCommitTracker {
 public:
  static constexpr size_t kMaxPendingSteps = 64;

  struct Result {
    bool commit = false;        // this report completed the step
    int64_t committed_step = 0; // the dir's newest committed step after it
    bool world_changed = false; // the step was counted for another world size before
  };
  // rank must be in [0, world_size) (the caller validates).
  Result Report(const std::string& dir, int64_t step, int rank, int world_size);
  // A rollback (training health) drops every step >= below, in every dir:
  // the agents delete them from disk, and the re-trained steps of those
  // numbers commit again.
  void Rewind(int64_t below);

  std::vector<v1::CkptDirState> ToProto() const;
  void FromProto(const google::protobuf::RepeatedPtrField<v1::CkptDirState>& dirs);

 private:
  struct Dir {
    int64_t committed = 0;  // newest step handed out for commit
    struct Step {
      int world_size = 0;
      std::set<int> ranks;
    };
    std::map<int64_t, Step> pending;
  };
  std::map<std::string, Dir> dirs_;
};

}  // namespace ballast::master
