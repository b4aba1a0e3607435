#include "master/ckpt_commit_tracker.h"

#include <algorithm>

namespace ballast::master {

CkptCommitTracker::Result CkptCommitTracker::Report(const std::string& dir, int64_t step, int rank,
                                                    int world_size) {
  Dir& d = dirs_[dir];
  Result r;
  // A step at or below the committed one is already complete (a late or
  // repeated report, e.g. a breakpoint save racing the persister).
  if (step <= d.committed) {
    r.committed_step = d.committed;
    return r;
  }
  Dir::Step& s = d.pending[step];
  if (s.world_size != world_size) {
    // A different world wrote this step number (the job scaled and restarted
    // from an older step): only the newest world's shards count.
    r.world_changed = s.world_size != 0;
    s.world_size = world_size;
    s.ranks.clear();
  }
  s.ranks.insert(rank);
  if (static_cast<int>(s.ranks.size()) == s.world_size) {
    d.committed = step;
    d.pending.erase(d.pending.begin(), d.pending.upper_bound(d.committed));
    r.commit = true;
  } else {
    while (d.pending.size() > kMaxPendingSteps) d.pending.erase(d.pending.begin());
  }
  r.committed_step = d.committed;
  return r;
}

void CkptCommitTracker::Rewind(int64_t below) {
  for (auto& [name, d] : dirs_) {
    d.committed = std::min(d.committed, below - 1);
    d.pending.erase(d.pending.lower_bound(below), d.pending.end());
  }
}

std::vector<v1::CkptDirState> CkptCommitTracker::ToProto() const {
  std::vector<v1::CkptDirState> out;
  for (const auto& [name, d] : dirs_) {
    v1::CkptDirState& p = out.emplace_back();
    p.set_dir(name);
    p.set_committed(d.committed);
    for (const auto& [step, s] : d.pending) {
      v1::CkptDirState::Step* ps = p.add_pending();
      ps->set_step(step);
      ps->set_world_size(s.world_size);
      for (int rank : s.ranks) ps->add_ranks(rank);
    }
  }
  return out;
}

void CkptCommitTracker::FromProto(const google::protobuf::RepeatedPtrField<v1::CkptDirState>& dirs) {
  dirs_.clear();
  for (const v1::CkptDirState& p : dirs) {
    Dir& d = dirs_[p.dir()];
    d.committed = p.committed();
    for (const auto& ps : p.pending()) {
      Dir::Step& s = d.pending[ps.step()];
      s.world_size = ps.world_size();
      s.ranks.insert(ps.ranks().begin(), ps.ranks().end());
    }
  }
}

}  // namespace ballast::master
