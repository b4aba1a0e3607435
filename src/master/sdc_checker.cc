#include "master/sdc_checker.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace ballast::master {

SdcChecker::Verdict SdcChecker::Add(int rank, int64_t step, uint64_t value, uint64_t group, int world_size) {
  Verdict v;
  v.step = step;
  v.last_agreed_step = last_agreed_;
  if (step <= last_agreed_ || world_size < 1) return v;
  auto& ranks = pending_[step];
  ranks[rank] = Entry{value, group};
  while (pending_.size() > kMaxPendingSteps) pending_.erase(pending_.begin());
  if (static_cast<int>(ranks.size()) < world_size || pending_.find(step) == pending_.end()) return v;
  std::map<int, Entry> all = std::move(ranks);
  pending_.erase(pending_.begin(), pending_.upper_bound(step));

  std::map<uint64_t, std::vector<int>> groups;
  for (const auto& [r, e] : all) groups[e.group].push_back(r);
  for (const auto& [g, members] : groups) {
    std::map<uint64_t, std::vector<int>> by_value;
    for (int r : members) by_value[all[r].value].push_back(r);
    if (by_value.size() == 1) continue;
    auto majority = std::max_element(by_value.begin(), by_value.end(),
                                      [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    if (majority->second.size() * 2 > members.size()) {
      v.kind = Verdict::Kind::kBlame;
      for (const auto& [val, rs] : by_value) {
        if (val == majority->first) continue;
        v.ranks.insert(v.ranks.end(), rs.begin(), rs.end());
        absl::StrAppend(&v.detail, v.detail.empty() ? "" : "; ", rs.size() == 1 ? "rank " : "ranks ",
                        absl::StrJoin(rs, ","), "'s parameter fingerprint ", absl::StrFormat("%016x", val),
                        " differs from the ", majority->second.size(), " other replicas' ",
                        absl::StrFormat("%016x", majority->first));
      }
      std::sort(v.ranks.begin(), v.ranks.end());
      return v;
    }
    // No strict majority: which side is wrong cannot be told.
    v.ranks = members;
    std::vector<std::string> sides;
    for (const auto& [val, rs] : by_value) {
      sides.push_back(absl::StrCat(rs.size() == 1 ? "rank " : "ranks ", absl::StrJoin(rs, ","), ": ",
                                   absl::StrFormat("%016x", val)));
    }
    v.detail = absl::StrCat("replicas disagree without a majority (", absl::StrJoin(sides, "; "), ")");
    const bool again = std::any_of(members.begin(), members.end(), [&](int r) { return tied_.count(r) > 0; });
    v.kind = again ? Verdict::Kind::kTieAgain : Verdict::Kind::kTie;
    tied_.insert(members.begin(), members.end());
    return v;
  }
  last_agreed_ = step;
  tied_.clear();
  v.kind = Verdict::Kind::kAgree;
  v.last_agreed_step = step;
  return v;
}

}  // namespace ballast::master
