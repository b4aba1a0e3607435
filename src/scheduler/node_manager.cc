#include "scheduler/node_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler {

NodeManager::NodeManager(SchedulerInterface* scheduler, NodeManagerOptions options)
    : scheduler_(scheduler), options_(std::move(options)) {}

void NodeManager::Event(const std::string& reason, const std::string& message, bool warning) {
  if (warning) {
    spdlog::warn("{}", message);
  } else {
    spdlog::info("{}", message);
  }
  if (options_.on_event) options_.on_event(reason, message, warning);
}

std::string NodeManager::Describe(const std::string& name) const {
  auto r = rank_of_.find(name);
  auto h = hosts_.find(name);
  std::string where = h == hosts_.end() || h->second.empty() || h->second == name ? "" : absl::StrCat(", host ", h->second);
  if (r == rank_of_.end()) return name;
  return absl::StrCat(name, " (node rank ", r->second, where, ")");
}

absl::Status NodeManager::Launch(Slot* slot) {
  if (!slot->early.empty()) {
    // Started ahead of the loss: it is the replacement (and already placed).
    const std::string early = std::exchange(slot->early, "");
    slot->incarnation = slot->early_incarnation;
    slot->name = early;
    auto h = hosts_.find(early);
    slot->host = h == hosts_.end() ? "" : h->second;
    slot->ended = false;
    return absl::OkStatus();
  }
  slot->incarnation = NextIncarnation(*slot);
  const NodeRequest req = Request(*slot, slot->incarnation);
  slot->name = req.name;
  slot->host.clear();
  slot->ended = false;
  absl::Status s = scheduler_->LaunchNode(req);
  if (!s.ok()) slot->ended = true;
  return s;
}

NodeRequest NodeManager::Request(const Slot& slot, int incarnation) {
  NodeRequest req;
  req.node_rank = slot.node_rank;
  req.incarnation = incarnation;
  req.name = options_.name(slot.node_rank, incarnation);
  req.avoid_hosts.assign(avoid_hosts_.begin(), avoid_hosts_.end());
  rank_of_[req.name] = slot.node_rank;
  return req;
}

int NodeManager::NextIncarnation(const Slot& slot) {
  return std::max(slot.incarnation, slot.early_incarnation) + 1;  // an early one's number stays used
}

void NodeManager::DropEarly(Slot& slot, const std::string& why) {
  const std::string early = std::exchange(slot.early, "");
  handled_.insert(early);
  Release(early, why);
}

void NodeManager::StartEarly(Slot* slot, const std::string& why) {
  const int incarnation = NextIncarnation(*slot);
  const NodeRequest req = Request(*slot, incarnation);
  slot->early_incarnation = incarnation;  // used up, even when the launch is refused
  if (absl::Status s = scheduler_->LaunchNode(req); !s.ok()) {
    spdlog::warn("cannot start {} early ({}): {}", req.name, why, std::string(s.message()));
    return;
  }
  slot->early = req.name;
  slot->early_since = options_.now();
  Event("EarlyReplacement",
        absl::StrCat("node ", Describe(slot->name), " ", why, ": starting ", req.name,
                     " now, to take its place if it is lost (released if it is still there in ",
                     options_.early_keep_s, " s)"),
        false);
}

void NodeManager::ExpireEarly() {
  const double now = options_.now();
  for (auto& [rank, slot] : slots_) {
    if (slot.early.empty() || slot.early_since + options_.early_keep_s > now) continue;
    spdlog::info("node {} is still in the job {:.0f} s after it disconnected: releasing its early replacement {}",
                 Describe(slot.name), options_.early_keep_s, slot.early);
    DropEarly(slot, absl::StrCat("not needed: ", slot.name, " is still in the job"));
  }
}

absl::Status NodeManager::Start() {
  // Taken over from an earlier master process: each rank's newest
  // incarnation is its node (one that ended meanwhile is reported by the
  // backend's next Poll and replaced then); older ones are known, so their
  // events are recognised as stale.
  std::map<int, AdoptedNode> newest;
  for (const AdoptedNode& a : scheduler_->AdoptedNodes()) {
    rank_of_[a.name] = a.node_rank;
    if (!a.host.empty()) hosts_[a.name] = a.host;
    auto [it, fresh] = newest.emplace(a.node_rank, a);
    if (!fresh && a.incarnation > it->second.incarnation) it->second = a;
  }
  for (const auto& [rank, a] : newest) {
    if (rank < 0 || rank >= options_.initial_nodes) continue;
    Slot& slot = slots_[rank];
    slot.node_rank = rank;
    slot.incarnation = a.incarnation;
    slot.name = a.name;
    slot.host = a.host;
    replacements_ += a.incarnation - 1;
  }
  if (!newest.empty()) {
    spdlog::info("took over {} node(s) an earlier master process started ({} replacement(s) so far)", newest.size(),
                 replacements_);
  }
  for (int rank = 0; rank < options_.initial_nodes; ++rank) {
    if (newest.count(rank) > 0) continue;
    Slot& slot = slots_[rank];
    slot.node_rank = rank;
    if (absl::Status s = Launch(&slot); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("cannot start node rank ", rank, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

void NodeManager::OnNodeLost(const std::string& node_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  notices_.push_back({node_id, reason, NoticeKind::kLost});
}

void NodeManager::OnNodeExcluded(const std::string& node_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  notices_.push_back({node_id, reason, NoticeKind::kExcluded});
}

void NodeManager::OnNodeDisconnected(const std::string& node_id) {
  if (!options_.early_replacement) return;
  std::lock_guard<std::mutex> lock(mu_);
  notices_.push_back({node_id, "", NoticeKind::kDisconnected});
}

void NodeManager::Gone(const std::string& name, const std::string& cause, bool still_running, bool job_finished,
                       double release_after_s) {
  auto r = rank_of_.find(name);
  if (r == rank_of_.end() || handled_.count(name) > 0) return;  // not ours, or seen already
  handled_.insert(name);
  Slot& slot = slots_[r->second];
  if (slot.early == name) {  // an early replacement ended before it was needed
    slot.early.clear();
    if (!job_finished) spdlog::warn("early replacement {} of {} is gone ({})", Describe(name), slot.name, cause);
    return;
  }
  if (slot.name != name) return;  // an older incarnation: already replaced
  slot.ended = true;
  if (still_running && release_after_s > 0) {
    // Excluded: it exits by itself once the rollback target is written; the
    // replacement starts then (ReleaseDeferred), not before.
    deferred_[name] = Deferred{options_.now() + release_after_s, cause, !job_finished};
    return;
  }
  if (still_running) Release(name, cause);
  if (job_finished) return;
  Replace(slot, name, cause);
}

void NodeManager::Replace(Slot& slot, const std::string& name, const std::string& cause) {
  if (replacements_ >= options_.max_replacements) {
    if (!slot.early.empty()) DropEarly(slot, "the replacement budget is used up");
    Event("ReplacementsUsedUp",
          absl::StrCat("node ", Describe(name), " is gone (", cause, "); not replacing it: the replacement budget (",
                       options_.max_replacements, ") is used up"),
          true);
    return;
  }
  ++replacements_;
  const std::string old = Describe(name);
  const std::string early = slot.early;
  const double early_s = options_.now() - slot.early_since;
  if (absl::Status s = Launch(&slot); !s.ok()) {
    Event("ReplacementFailed",
          absl::StrCat("node ", old, " is gone (", cause, "); cannot start its replacement: ", s.message()), true);
    return;
  }
  Event("NodeReplaced",
        absl::StrCat("node ", old, " is gone (", cause, "); replacing it with ", slot.name,
                     early.empty() ? "" : absl::StrFormat(" (started %.1f s before, when it disconnected)", early_s),
                     " (", replacements_, "/", options_.max_replacements, " replacements",
                     avoid_hosts_.empty() ? "" : absl::StrCat(", avoiding ", avoid_hosts_.size(), " bad host(s)"),
                     ")"),
        false);
}

void NodeManager::Poll(bool job_finished) {
  const std::vector<NodeEvent> events = scheduler_->Poll();
  // Where nodes run first: an exclusion below needs the host to avoid.
  for (const NodeEvent& e : events) {
    auto r = rank_of_.find(e.name);
    if (r == rank_of_.end()) continue;
    if (!e.host.empty()) hosts_[e.name] = e.host;
    Slot& slot = slots_[r->second];
    if (e.kind == NodeEvent::Kind::kStarted && slot.name == e.name) slot.host = e.host;
  }
  // Then what the master said, before what the scheduler saw next: an
  // excluded node's agent exits at once, and its replacement must already
  // avoid the bad host.
  std::vector<Notice> notices;
  {
    std::lock_guard<std::mutex> lock(mu_);
    notices.swap(notices_);
  }
  for (const Notice& n : notices) {
    if (n.kind == NoticeKind::kDisconnected) {
      auto r = rank_of_.find(n.node_id);
      if (job_finished || r == rank_of_.end() || handled_.count(n.node_id) > 0) continue;
      Slot& slot = slots_[r->second];
      if (slot.name == n.node_id && !slot.ended && slot.early.empty() &&
          replacements_ < options_.max_replacements) {
        StartEarly(&slot, "hung up its connection to the master");
      }
      continue;
    }
    const bool excluded = n.kind == NoticeKind::kExcluded;
    if (excluded) {
      auto h = hosts_.find(n.node_id);
      if (h != hosts_.end() && !h->second.empty() && avoid_hosts_.insert(h->second).second) {
        Event("NodeExcluded",
              absl::StrCat("node ", Describe(n.node_id), " was excluded (", n.reason,
                           "); its replacements avoid host ", h->second),
              true);
      }
    }
    // The master is the truth: a node it lost or excluded is gone even when
    // its agent still runs (hung, partitioned): release it, then replace it.
    // An excluded one first gets the time to exit by itself (file comment).
    Gone(n.node_id, excluded ? absl::StrCat("excluded: ", n.reason) : n.reason, /*still_running=*/true,
         job_finished, excluded ? options_.excluded_exit_s : 0);
  }
  ReleaseDeferred(events, job_finished);
  ExpireEarly();
  for (const NodeEvent& e : events) {
    if (rank_of_.count(e.name) == 0) continue;
    switch (e.kind) {
      case NodeEvent::Kind::kStarted:
        break;
      case NodeEvent::Kind::kExited:
        // An agent exits 0 only when its job succeeded (JobFinished): it is
        // done, not gone, even before the driver has heard of the end.
        Gone(e.name, absl::StrCat("its agent exited: ", e.status.Describe()), /*still_running=*/false,
             job_finished || e.status.ok());
        break;
      case NodeEvent::Kind::kLost:
        if (options_.on_scheduler_lost && !job_finished && handled_.count(e.name) == 0)
          options_.on_scheduler_lost(e.name, e.reason);
        Gone(e.name, e.reason, /*still_running=*/true, job_finished);
        break;
      case NodeEvent::Kind::kPendingTooLong:
        Event("NodePending",
              absl::StrCat("node ", Describe(e.name), " has not started: ", e.reason,
                           "; the job goes on with the nodes it has and takes this one in when it starts"),
              true);
        break;
    }
  }
}

void NodeManager::Release(const std::string& name, const std::string& cause) {
  absl::Status s = scheduler_->ReleaseNode(name, cause, options_.release_grace_s);
  if (!s.ok() && !absl::IsNotFound(s)) spdlog::warn("cannot release {}: {}", Describe(name), std::string(s.message()));
}

void NodeManager::ReleaseDeferred(const std::vector<NodeEvent>& events, bool job_finished) {
  // Those that ended (exited by themselves, or lost) are replaced now.
  for (const NodeEvent& e : events) {
    if (e.kind != NodeEvent::Kind::kExited && e.kind != NodeEvent::Kind::kLost) continue;
    auto it = deferred_.find(e.name);
    if (it == deferred_.end()) continue;
    const Deferred d = it->second;
    deferred_.erase(it);
    if (d.replace && !job_finished) Replace(slots_[rank_of_[e.name]], e.name, d.cause);
  }
  const double now = options_.now();
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    if (it->second.at > now) {
      ++it;
      continue;
    }
    spdlog::warn("{} still runs {:.0f} s after it was excluded: stopping it", Describe(it->first),
                 options_.excluded_exit_s);
    const std::string name = it->first;
    const Deferred d = it->second;
    it = deferred_.erase(it);
    Release(name, d.cause);
    if (d.replace && !job_finished) Replace(slots_[rank_of_[name]], name, d.cause);
  }
}

bool NodeManager::Exhausted() const {
  // A gone node is replaced at once while the budget lasts (an excluded one
  // once its agent exited: deferred_), so "every slot ended" with nothing
  // deferred means nothing more will come.
  if (!deferred_.empty()) return false;
  for (const auto& [rank, slot] : slots_) {
    if (!slot.ended) return false;
  }
  return true;
}

NodeCallbacks ForwardTo(std::atomic<NodeManager*>* slot) {
  return NodeCallbacks{[slot](const std::string& id, const std::string& reason) {
                         if (NodeManager* n = slot->load()) n->OnNodeLost(id, reason);
                       },
                       [slot](const std::string& id, const std::string& reason) {
                         if (NodeManager* n = slot->load()) n->OnNodeExcluded(id, reason);
                       },
                       [slot](const std::string& id) {
                         if (NodeManager* n = slot->load()) n->OnNodeDisconnected(id);
                       }};
}

}  // namespace ballast::scheduler
