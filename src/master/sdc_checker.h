// SdcChecker: silent data corruption from parameter fingerprints
// (ballast.step(step, model=); python/ballast/health.py). Ranks whose
// fingerprints carry the same group hold the same parameters (DDP: every
// rank; HSDP: each replica group) and must agree. Once every rank of the
// world reported a step, each group is judged:
//  - all equal: the step is the newest agreed one (the rollback target);
//  - a strict majority value: the ranks that differ are blamed;
//  - no strict majority (two replicas, or a split): a tie; the job
//    recomputes from the newest agreed step, and a second tie among the
//    same ranks fails the job (which one is wrong cannot be told).
//
// Bounded: at most kMaxPendingSteps steps wait for their last ranks; a step
// no rank completes (a restart came first) is dropped.
// Ownership: plain value type. Thread safety: none (the JobMaster's lock).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ballast::master {

class SdcChecker {
 public:
  static constexpr size_t kMaxPendingSteps = 16;

  struct Verdict {
    enum class Kind { kPending, kAgree, kBlame, kTie, kTieAgain };
    Kind kind = Kind::kPending;
    int64_t step = 0;
    std::vector<int> ranks;        // kBlame: the minority; kTie*: the group that split
    int64_t last_agreed_step = 0;  // newest step at which every group agreed (0: none yet)
    std::string detail;            // "rank 3's fingerprint 0x.. differs from the 3 others' 0x.."
  };

  // One rank's fingerprint of `step`, in a world of world_size ranks.
  Verdict Add(int rank, int64_t step, uint64_t value, uint64_t group, int world_size);
  // A new round (other ranks, another world): fingerprints not judged yet are dropped.
  void NewRound() { pending_.clear(); }
  int64_t last_agreed_step() const { return last_agreed_; }
  // A restarted master takes back the agreed step its agents heard from the
  // one before it (ProgressReport.sdc_agreed_step): only ever newer.
  void NoteAgreed(int64_t step) { last_agreed_ = std::max(last_agreed_, step); }

 private:
  struct Entry {
    uint64_t value = 0;
    uint64_t group = 0;
  };
  std::map<int64_t, std::map<int, Entry>> pending_;  // step -> rank -> fingerprint
  int64_t last_agreed_ = 0;
  std::set<int> tied_;  // the ranks of the last tie, until a step agrees
};

}  // namespace ballast::master
