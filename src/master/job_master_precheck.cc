// JobMaster's pre-flight check driver (see precheck_coordinator.h for the
// rounds and job_master.h for the locking contract: every method here runs
// under mu_). The check holds the rendezvous back: a round forms only from
// nodes that passed; faulty nodes (and, with exclude_stragglers, stragglers)
// get an Excluded decision, leave the rendezvous, and their agents exit
// non-zero so the scheduler starts replacements, which are checked in turn.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "master/job_master.h"

#include "common/limits.h"
#include "spdlog/spdlog.h"

namespace ballast::master {

absl::Status JobMaster::ReportCheckResult(const v1::CheckResult& received) {
  v1::CheckResult result = received;
  TruncateFront(result.mutable_error());
  JobLock lock(&mu_);
  if (nodes_.Find(NodeId(result.node_id())) == nullptr) {
    spdlog::warn("job={} node={} check result refused: unknown node", options_.job_id, result.node_id());
    return absl::NotFoundError(absl::StrCat("unknown node ", result.node_id(), ": join again"));
  }
  absl::Status s = precheck_.coordinator.Record(result);
  if (!s.ok()) {
    spdlog::warn("job={} node={} check result refused: {}", options_.job_id, result.node_id(),
                 std::string(s.message()));
    return s;
  }
  spdlog::info("job={} node={} pre-flight check {} round {}: {} in {:.3f} s{}{}", options_.job_id,
               result.node_id(), result.check_id(), precheck_.coordinator.check_round(),
               result.ok() ? "passed" : "FAILED", result.time_s(), result.error().empty() ? "" : ": ",
               result.error());
  if (!finished() && !shutdown_) Evaluate(clock_->Now());
  return absl::OkStatus();
}

void JobMaster::PushRunChecks(CheckDecisions decisions) {
  for (auto& [id, rc] : decisions) {
    v1::Decision d;
    *d.mutable_run_check() = std::move(rc);
    Push(id, std::move(d));
  }
}

bool JobMaster::Admissible(const NodeId& node_id) const {
  return !precheck_.enabled || precheck_.passed.count(node_id) > 0;
}

std::vector<NodeId> JobMaster::AdmissibleNodes() const {
  std::vector<NodeId> ordered = rdzv_.OrderedIds();
  if (!precheck_.enabled) return ordered;  // every one is admissible
  std::vector<NodeId> out;
  for (NodeId& id : ordered) {
    if (Admissible(id)) out.push_back(std::move(id));
  }
  return out;
}

int JobMaster::AdmissibleWorldNodes() const {
  // Without the pre-flight check every participant is admissible: no list.
  if (!precheck_.enabled) return rdzv_.UsableNodes();
  return rdzv_.RoundedNodes(static_cast<int>(AdmissibleNodes().size()));
}

std::optional<World> JobMaster::FormAdmissible() const {
  // Who is in the new world: the running world's members first (they hold
  // the in-memory checkpoints, and a scale-up must not push one out), then
  // the waiting nodes that waited longest (hot spares in the order they
  // joined, before a lost node's newer replacement). Rank hints then order
  // the chosen nodes; they do not choose them.
  const std::vector<NodeId> admissible = AdmissibleNodes();  // in rank order
  const int n = rdzv_.RoundedNodes(static_cast<int>(admissible.size()));
  if (n == 0) return std::nullopt;
  std::vector<NodeId> chosen;
  for (const NodeId& id : admissible) {
    if (IsMember(id)) chosen.push_back(id);
  }
  for (const NodeId& id : rdzv_.JoinOrder()) {
    if (Admissible(id) && !IsMember(id)) chosen.push_back(id);
  }
  if (chosen.size() > static_cast<size_t>(n)) chosen.resize(static_cast<size_t>(n));
  return rdzv_.FormFrom(chosen);
}

bool JobMaster::InRunningCheck(const NodeId& node_id) const {
  const PrecheckCoordinator& c = precheck_.coordinator;
  return c.active() && std::any_of(c.nodes().begin(), c.nodes().end(),
                                   [&](const PrecheckNode& n) { return n.node_id == node_id; });
}

void JobMaster::AbortCheckIfNodeLeft() {
  PrecheckCoordinator& c = precheck_.coordinator;
  if (!c.active()) return;
  for (const auto& n : c.nodes()) {
    if (!rdzv_.Contains(n.node_id)) {
      spdlog::warn("job={} node={} pre-flight check aborted: the node left; the check starts over",
                   options_.job_id, n.node_id);
      c.Abort();
      return;
    }
  }
}

bool JobMaster::JoinerCheckGate(double now) {
  if (!precheck_.enabled) return false;
  PrecheckCoordinator& c = precheck_.coordinator;
  AbortCheckIfNodeLeft();
  if (c.active()) {
    if (c.RoundComplete(now)) DrivePrecheck(now);
    if (c.active() || finished()) return true;
  }
  std::vector<PrecheckNode> joiners;
  for (const NodeSpec& spec : rdzv_.Ordered()) {
    if (!IsMember(spec.node_id) && !Admissible(spec.node_id)) {
      joiners.push_back({spec.node_id, spec.local_world_size});
    }
  }
  if (joiners.empty()) return false;
  // A burst of joins (several replacements) is checked together.
  if (now < rdzv_.last_join_time() + options_.last_call_s) return true;
  std::vector<double> reference;
  for (const auto& m : world_.members) {
    if (auto it = precheck_.best_times.find(m.node_id); it != precheck_.best_times.end()) {
      reference.push_back(it->second);
    }
  }
  std::vector<NodeId> ids;
  for (const auto& j : joiners) ids.push_back(j.node_id);
  CheckDecisions decisions = c.Begin(std::move(joiners), now, /*joiners=*/true, std::move(reference));
  spdlog::info("job={} round={} pre-flight check of {} joining node(s) ({}) while the job trains", options_.job_id,
               round_, ids.size(), JoinNodeIds(ids, ", "));
  PushRunChecks(std::move(decisions));
  return true;
}

bool JobMaster::PrecheckGate(double now) {
  if (!precheck_.enabled) return false;
  PrecheckCoordinator& c = precheck_.coordinator;
  AbortCheckIfNodeLeft();
  if (c.active()) {
    goodput_.Precheck(now);  // no round runs while this check holds it back
    if (c.RoundComplete(now)) DrivePrecheck(now);
    if (c.active() || finished()) return true;
    // The check is over: the survivors may form the round now.
  }
  if (!rdzv_.Ready(now)) return false;
  std::vector<PrecheckNode> nodes;
  std::vector<NodeId> unchecked;
  for (const NodeSpec& spec : rdzv_.Ordered()) {
    nodes.push_back({spec.node_id, spec.local_world_size});
    if (precheck_.passed.count(spec.node_id) == 0) unchecked.push_back(spec.node_id);
  }
  if (unchecked.empty()) return false;
  CheckDecisions decisions = c.Begin(std::move(nodes), now);
  message_ = absl::StrCat("pre-flight check of ", c.nodes().size(), " nodes (new: ", JoinNodeIds(unchecked, ", "),
                          "): round 1");
  spdlog::info("job={} {}", options_.job_id, message_);
  goodput_.Precheck(now);
  PushRunChecks(std::move(decisions));
  return true;
}

void JobMaster::DrivePrecheck(double now) {
  PrecheckCoordinator::Step step = precheck_.coordinator.Advance(now);
  if (!step.next.empty()) {
    message_ = absl::StrCat("pre-flight check of ", precheck_.coordinator.nodes().size(), " nodes: round ",
                            precheck_.coordinator.check_round());
    spdlog::info("job={} {}", options_.job_id, message_);
    PushRunChecks(std::move(step.next));
    return;
  }
  if (step.outcome.has_value()) ApplyPrecheckOutcome(*step.outcome, now);
}

void JobMaster::ExcludeNode(const NodeId& node_id, const std::string& reason) {
  precheck_.excluded[node_id] = reason;
  v1::JournalRecord r;
  r.mutable_excluded()->set_node_id(node_id.str());
  r.mutable_excluded()->set_reason(reason);
  Record(std::move(r), /*sync=*/true);  // its re-joins stay refused after a master restart
  precheck_.passed.erase(node_id);
  precheck_.best_times.erase(node_id);
  rdzv_.Remove(node_id);
  if (NodeRecord* rec = nodes_.Find(node_id); rec != nullptr) {
    rec->state = NodeState::kWaiting;
    rec->group_rank = -1;
  }
  spdlog::warn("job={} node={} excluded from the job: {}", options_.job_id, node_id, reason);
  events_.Append("node_excluded", round_.value(), node_id.str(), reason);
  v1::Decision d;
  d.mutable_excluded()->set_reason(reason);
  d.mutable_excluded()->set_rollback_below(rollback_below_);  // 0 unless a rollback is under way
  Push(node_id, std::move(d));
  if (options_.on_node_excluded) options_.on_node_excluded(node_id.str(), reason);
}

void JobMaster::ApplyPrecheckOutcome(const PrecheckOutcome& outcome, double now) {
  const health::Verdict& v = outcome.verdict;
  precheck_.verdict = v.message;
  events_.Append("precheck", round_.value(), "", v.message);
  std::vector<std::string> errors;
  for (const auto& [id, err] : outcome.errors) errors.push_back(absl::StrCat(id.str(), " (", err, ")"));
  // Joiners that all failed are kept out; the training members are fine.
  if (v.all_failed && !outcome.joiners) {
    Finish(false, absl::StrCat("job failed: ", v.message,
                               errors.empty() ? "" : absl::StrCat("; failures: ", absl::StrJoin(errors, "; "))));
    return;
  }
  for (const auto& id : outcome.faulty) {
    auto it = outcome.errors.find(id);
    ExcludeNode(id, absl::StrCat("failed the pre-flight check: ", v.message,
                                 it == outcome.errors.end() ? "" : absl::StrCat("; this node: ", it->second)));
  }
  for (const auto& id : outcome.stragglers) {
    if (precheck_.exclude_stragglers) {
      ExcludeNode(id, absl::StrCat("a straggler in the pre-flight check (--exclude-stragglers): ", v.message));
    } else {
      spdlog::warn("job={} node={} is a straggler in the pre-flight check ({}); it stays in the job "
                   "(--exclude-stragglers would replace it)",
                   options_.job_id, id, v.message);
    }
  }
  for (const auto& id : outcome.nodes) {
    if (precheck_.excluded.count(id) == 0) precheck_.passed.insert(id);
  }
  for (const auto& [id, t] : outcome.best_times) precheck_.best_times[id] = t;
  for (const auto& id : precheck_.passed) {
    v1::JournalRecord r;
    r.mutable_passed()->set_node_id(id.str());
    if (auto it = precheck_.best_times.find(id); it != precheck_.best_times.end()) r.mutable_passed()->set_check_time_s(it->second);
    Record(std::move(r), /*sync=*/false);
  }
  if (v.faulty.empty() && v.stragglers.empty()) {
    spdlog::info("job={} {}", options_.job_id, v.message);
  } else {
    spdlog::warn("job={} {}", options_.job_id, v.message);
  }
  if (state_ == JobState::kRunning) {
    // Joiners that passed wait as surplus unless Evaluate scales up next.
    for (const auto& id : outcome.nodes) {
      if (Admissible(id) && !IsMember(id)) PushWait(id, SurplusReason());
    }
    return;
  }
  message_ = v.message;
  if (!rdzv_.Ready(now)) {
    for (const NodeSpec& spec : rdzv_.Ordered()) {
      PushWait(spec.node_id, absl::StrCat(v.message, "; ", RendezvousWaitReason(now)));
    }
  }
}

}  // namespace ballast::master
