#include "master/precheck_coordinator.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tunables.h"
#include "spdlog/spdlog.h"

namespace ballast::master {

PrecheckOptions PrecheckOptions::FromEnv() {
  const Tunables& t = Tunables::Get();  // BALLAST_PRECHECK_*
  PrecheckOptions o;
  if (t.precheck_timeout_s > 0) o.timeout_s = t.precheck_timeout_s;
  o.grace_s = t.precheck_grace_s;
  if (t.precheck_allreduce_bytes > 0) o.allreduce_bytes = t.precheck_allreduce_bytes;
  if (t.precheck_matmul_size > 0) o.matmul_size = t.precheck_matmul_size;
  o.straggler_min_gap_s = t.precheck_straggler_min_s;
  return o;
}

PrecheckCoordinator::PrecheckCoordinator(PrecheckOptions options) : options_(options) {}

CheckDecisions PrecheckCoordinator::Begin(std::vector<PrecheckNode> nodes, double now, bool joiners,
                                          std::vector<double> reference_times) {
  nodes_ = std::move(nodes);
  active_ = true;
  joiners_ = joiners;
  alone_round_ = false;
  reference_ = std::move(reference_times);
  round_ = 0;
  r1_.clear();
  r2_.clear();
  verdict2_ = health::Verdict{};
  errors_.clear();
  const int n = static_cast<int>(nodes_.size());
  return StartRound(n >= 2 ? health::GroupInOrder(n) : health::Groups{{0}}, now);
}

CheckDecisions PrecheckCoordinator::StartRound(const health::Groups& groups, double now) {
  ++round_;
  check_id_ = next_check_id_++;
  groups_ = groups;
  deadline_ = now + options_.timeout_s + options_.grace_s;
  results_.assign(nodes_.size(), health::NodeResult{});
  pending_.clear();
  CheckDecisions out;
  for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
    int world = 0;
    for (int i : groups[g]) world += nodes_[i].local_world_size;
    int offset = 0;
    for (int r = 0; r < static_cast<int>(groups[g].size()); ++r) {
      int i = groups[g][r];
      v1::RunCheck rc;
      rc.set_check_id(check_id_);
      rc.set_check_round(round_);
      rc.set_group_id(g);
      rc.set_group_rank(r);
      rc.set_group_world_size(static_cast<int>(groups[g].size()));
      rc.set_rank_offset(offset);
      rc.set_world_size(world);
      rc.set_endpoint_key(absl::StrCat("check/", check_id_, "/group/", g, "/master_endpoint"));
      rc.set_timeout_s(options_.timeout_s);
      rc.set_allreduce_bytes(options_.allreduce_bytes);
      rc.set_matmul_size(options_.matmul_size);
      offset += nodes_[i].local_world_size;
      pending_.insert(i);
      out.emplace_back(nodes_[i].node_id, std::move(rc));
    }
  }
  return out;
}

absl::Status PrecheckCoordinator::Record(const v1::CheckResult& result) {
  if (!active_ || result.check_id() != check_id_) {
    return absl::AbortedError(absl::StrCat("stale check ", result.check_id(), " (current is ",
                                           active_ ? check_id_ : 0, ")"));
  }
  for (int i = 0; i < static_cast<int>(nodes_.size()); ++i) {
    if (nodes_[i].node_id != NodeId(result.node_id())) continue;
    if (pending_.erase(i) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("node ", result.node_id(), " has no pending result in check ", check_id_));
    }
    results_[i].ok = result.ok() && std::isfinite(result.time_s());
    results_[i].time_s = results_[i].ok ? result.time_s() : std::numeric_limits<double>::infinity();
    if (!result.ok() && errors_.count(NodeId(result.node_id())) == 0) {
      errors_[NodeId(result.node_id())] = absl::StrCat("round ", round_, ": ", result.error());
    }
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("node ", result.node_id(), " is not part of check ", check_id_));
}

bool PrecheckCoordinator::RoundComplete(double now) const {
  return active_ && (pending_.empty() || now >= deadline_);
}

PrecheckOutcome PrecheckCoordinator::MakeOutcome(const health::Verdict& verdict) const {
  PrecheckOutcome o;
  o.verdict = verdict;
  o.errors = errors_;
  o.joiners = joiners_;
  for (const auto& n : nodes_) o.nodes.push_back(n.node_id);
  for (int i : verdict.faulty) o.faulty.push_back(nodes_[i].node_id);
  if (verdict.all_failed) return o;  // Judge's message says why
  // Best time per node over the rounds it passed, and their median.
  const int n = static_cast<int>(nodes_.size());
  std::vector<double> best(n, std::numeric_limits<double>::infinity());
  for (const auto* r : {&r1_, &r2_}) {
    for (int i = 0; i < n && i < static_cast<int>(r->size()); ++i) {
      if ((*r)[i].ok) best[i] = std::min(best[i], (*r)[i].time_s);
    }
  }
  std::vector<double> finite;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(best[i])) continue;
    finite.push_back(best[i]);
    // Reference times for later checks come from groups of several nodes
    // only: a node checked alone skips the network, so its time is shorter.
    const bool timed_alone = n == 1 || (alone_round_ && !r1_[i].ok);
    if (!timed_alone) o.best_times[nodes_[i].node_id] = best[i];
  }
  for (double t : reference_) {
    if (std::isfinite(t)) finite.push_back(t);
  }
  std::sort(finite.begin(), finite.end());
  double median = 0;
  if (!finite.empty()) {
    size_t k = finite.size();
    median = k % 2 == 1 ? finite[k / 2] : (finite[k / 2 - 1] + finite[k / 2]) / 2;
  }
  // Stragglers by the factor rule, minus those within timing noise.
  o.verdict.stragglers.clear();
  std::vector<std::string> slow_text;
  for (int i : verdict.stragglers) {
    if (best[i] - median < options_.straggler_min_gap_s) continue;
    o.verdict.stragglers.push_back(i);
    o.stragglers.push_back(nodes_[i].node_id);
    slow_text.push_back(absl::StrCat(nodes_[i].node_id.str(), " (", absl::SixDigits(best[i]), " s)"));
  }
  std::vector<std::string> parts;
  if (!o.faulty.empty()) {
    parts.push_back(absl::StrCat("faulty node(s) ", JoinNodeIds(o.faulty, ", "),
                                 " failed in every check round they ran in"));
  }
  if (!slow_text.empty()) {
    parts.push_back(absl::StrCat("straggler(s) ", absl::StrJoin(slow_text, ", "), " took more than ",
                                 options_.straggler_factor, "x the median ", absl::SixDigits(median), " s"));
  }
  const std::string what = joiners_ ? absl::StrCat(n, " joining node(s)") : absl::StrCat(n, " nodes");
  o.verdict.message =
      parts.empty() ? absl::StrCat("all ", what, " passed the pre-flight check (median ", absl::SixDigits(median), " s)")
                    : absl::StrCat("pre-flight check of ", what, ": ", absl::StrJoin(parts, "; "));
  if (!verdict.note.empty()) absl::StrAppend(&o.verdict.message, "; ", verdict.note);
  return o;
}

PrecheckCoordinator::Step PrecheckCoordinator::Advance(double now) {
  Step step;
  for (int i : pending_) {
    if (errors_.count(nodes_[i].node_id) == 0) {
      errors_[nodes_[i].node_id] = absl::StrCat("round ", round_, ": no result within ",
                                                options_.timeout_s + options_.grace_s, " s");
    }
  }
  pending_.clear();
  std::vector<health::NodeResult> applied = health::ApplyGroupFailure(groups_, results_);
  const int n = static_cast<int>(nodes_.size());
  if (round_ == 1) {
    r1_ = applied;
    bool all_ok = std::all_of(r1_.begin(), r1_.end(), [](const health::NodeResult& r) { return r.ok; });
    if (!all_ok && joiners_ && n <= 3) {
      // Joiners: a failure is localized by checking each failed node alone
      // (one joiner already ran alone).
      std::vector<int> failed;
      for (int i = 0; i < n; ++i) {
        if (!r1_[i].ok) failed.push_back(i);
      }
      if (n == 1) {
        active_ = false;
        step.outcome = MakeOutcome(health::JudgeWithAloneRound(r1_, r1_, options_.straggler_factor, reference_));
        return step;
      }
      alone_round_ = true;
      step.next = StartRound(health::GroupAlone(failed), now);
      return step;
    }
    if (all_ok || n <= 3) {
      active_ = false;
      step.outcome = MakeOutcome(health::Judge(r1_, {}, options_.straggler_factor, reference_));
      return step;
    }
    std::vector<double> times;
    for (const auto& r : r1_) times.push_back(r.time_s);
    step.next = StartRound(health::GroupFastestWithSlowest(times), now);
    return step;
  }
  if (round_ == 2 && alone_round_) {
    r2_ = applied;
    active_ = false;
    step.outcome = MakeOutcome(health::JudgeWithAloneRound(r1_, r2_, options_.straggler_factor, reference_));
    return step;
  }
  if (round_ == 2) {
    r2_ = applied;
    verdict2_ = health::Judge(r1_, r2_, options_.straggler_factor, reference_);
    if (!verdict2_.suspects.empty()) {
      std::vector<double> best(n, std::numeric_limits<double>::infinity());
      for (int i = 0; i < n; ++i) {
        if (r1_[i].ok) best[i] = std::min(best[i], r1_[i].time_s);
        if (r2_[i].ok) best[i] = std::min(best[i], r2_[i].time_s);
      }
      health::Groups g3 = health::GroupSuspectsWithHealthy(verdict2_, best);
      if (!g3.empty()) {
        step.next = StartRound(g3, now);
        return step;
      }
    }
    active_ = false;
    step.outcome = MakeOutcome(verdict2_);
    return step;
  }
  // Round 3: the suspects with healthy partners.
  active_ = false;
  step.outcome = MakeOutcome(health::RefineWithSuspectRound(verdict2_, groups_, applied));
  return step;
}

}  // namespace ballast::master
