#include "master/failure_arbiter.h"

#include "master/fault_policy.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/limits.h"
#include "health/failure_class.h"
#include "health/stack_dump.h"

namespace ballast::master {

bool IsHangReport(const v1::FailureReport& report) {
  return report.kind() == health::FailureKindName(health::FailureKind::kHang);
}

double FailureArbiter::SettleSeconds(const v1::FailureReport& report, size_t members) const {
  // With one node in the round no other node's loss can be behind the failure.
  if (members <= 1) return 0;
  double s = failure_settle_s_;
  if (IsHangReport(report)) s = std::max(s, hang_settle_s_);
  return s;
}

bool FailureArbiter::CanHold() const { return held_.size() < kMaxHeldFailures; }

std::vector<FailureArbiter::Held> FailureArbiter::DropStale(Round round) {
  std::vector<Held> stale;
  std::erase_if(held_, [&](Held& h) {
    if (Round(h.report.round()) == round) return false;
    stale.push_back(std::move(h));
    return true;
  });
  return stale;
}

std::vector<FailureArbiter::Held> FailureArbiter::TakeDue(
    double now, size_t members, const std::function<bool(const NodeId& except)>& other_member_disconnected) {
  if (held_.empty()) return {};
  const Held& first = held_.front();
  double settle_s = 0;
  std::set<std::string> reporters;
  for (const Held& h : held_) {
    settle_s = std::max(settle_s, SettleSeconds(h.report, members));
    reporters.insert(h.report.node_id());
  }
  // Every member reported (a hang stops every rank, so every node's agent
  // reports it): no report is left to wait for.
  const bool all_reported = reporters.size() >= members;
  if (now - first.reported_at < settle_s && !all_reported) return {};
  if (other_member_disconnected(NodeId(first.report.node_id()))) return {};  // back or lost first
  std::vector<Held> due;
  due.swap(held_);
  return due;
}

std::string FailureArbiter::OrderForBlame(std::vector<Held>* reports) {
  // A bad loss first (its agent stopped the workers: the other ranks'
  // crashes follow from it), then hangs (a crash in the same window follows
  // from the hung worker being killed), blamed in order: outside a
  // collective, lowest step, longest without progress; then crashes, those
  // that say a collective lost its peer last (another rank's death made them,
  // and their report can arrive before the dead rank's).
  auto key = [](const Held& h) {
    const v1::FailureReport& r = h.report;
    const bool hang = IsHangReport(r);
    const int cls = FaultPolicy::IsHealthReport(r) ? 0
                    : hang                         ? 1
                    : health::LooksLikePeerLoss(r.stderr_tail()) ? 3
                                                                 : 2;
    return std::make_tuple(cls, hang ? health::HangBlameTier(r.hang_stack_found(), r.hang_in_collective()) : 0,
                           hang ? r.hang_last_step() : 0,
                           hang ? -r.hang_idle_s() : 0.0);
  };
  std::stable_sort(reports->begin(), reports->end(), [&](const Held& a, const Held& b) { return key(a) < key(b); });
  if (reports->empty() || !IsHangReport(reports->front().report)) return "";
  std::vector<std::string> others;
  for (size_t i = 1; i < reports->size(); ++i) {
    const v1::FailureReport& r = (*reports)[i].report;
    if (!IsHangReport(r)) continue;
    others.push_back(absl::StrCat("rank ", r.global_rank(), " on node ", r.node_id(), " (",
                                  r.hang_stack_found()
                                      ? (r.hang_in_collective()
                                             ? absl::StrCat("waiting in a collective at ", r.hang_top_frame())
                                             : absl::StrCat("at ", r.hang_top_frame()))
                                      : std::string("no stack"),
                                  ")"));
  }
  if (others.empty()) return "";
  v1::FailureReport& blamed = reports->front().report;
  blamed.set_stderr_tail(
      absl::StrCat(blamed.stderr_tail(), "; also hung, waiting for it: ", absl::StrJoin(others, "; ")));
  return absl::StrCat(others.size() + 1, " nodes hung together; blaming rank ", blamed.global_rank(), " on node ",
                      blamed.node_id(),
                      blamed.hang_stack_found()
                          ? (blamed.hang_in_collective() ? "" : " (outside any collective)")
                          : " (it did not answer the stack dump: stopped, or stuck outside Python)",
                      "; also hung: ", absl::StrJoin(others, "; "));
}

double FailureArbiter::DetectionSeconds(const v1::FailureReport& report, double held_s) {
  return held_s + report.seen_age_s() + (IsHangReport(report) ? report.hang_idle_s() : 0);
}

}  // namespace ballast::master
