#include "master/node_table.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace ballast::master {

std::string_view NodeStateName(NodeState state) {
  switch (state) {
    case NodeState::kWaiting:
      return "waiting";
    case NodeState::kTraining:
      return "training";
    case NodeState::kDone:
      return "done";
    case NodeState::kDead:
      return "dead";
    case NodeState::kLeft:
      return "left";
  }
  return "unknown";
}

NodeTable::NodeTable(ClockInterface* clock, double heartbeat_timeout_s)
    : clock_(clock), heartbeat_timeout_s_(heartbeat_timeout_s) {}

NodeRecord& NodeTable::Upsert(const NodeSpec& spec, int64_t pid, bool* added) {
  double now = clock_->Now();
  auto it = alive_.find(spec.node_id);
  if (added != nullptr) *added = (it == alive_.end());
  if (it != alive_.end()) {
    it->second.spec = spec;
    it->second.pid = pid;
    it->second.last_heartbeat = now;
    oldest_heartbeat_ = std::min(oldest_heartbeat_, now);
    return it->second;
  }
  // Alive again: it is no longer one of the gone nodes.
  gone_.erase(std::remove_if(gone_.begin(), gone_.end(),
                             [&](const NodeRecord& r) { return r.spec.node_id == spec.node_id; }),
              gone_.end());
  NodeRecord& rec = alive_[spec.node_id];
  index_[spec.node_id] = &rec;
  ++version_;
  rec.spec = spec;
  rec.pid = pid;
  rec.state = NodeState::kWaiting;
  rec.joined_at = now;
  rec.last_heartbeat = now;
  oldest_heartbeat_ = std::min(oldest_heartbeat_, now);
  return rec;
}

NodeRecord* NodeTable::Find(const NodeId& node_id) {
  auto it = index_.find(node_id);
  return it == index_.end() ? nullptr : it->second;
}

const NodeRecord* NodeTable::Find(const NodeId& node_id) const {
  auto it = index_.find(node_id);
  return it == index_.end() ? nullptr : it->second;
}

absl::Status NodeTable::Heartbeat(const NodeId& node_id) {
  NodeRecord* rec = Find(node_id);
  if (rec == nullptr) {
    return absl::NotFoundError(absl::StrCat("unknown node ", node_id.str(), ": join again"));
  }
  rec->last_heartbeat = clock_->Now();
  oldest_heartbeat_ = std::min(oldest_heartbeat_, rec->last_heartbeat);  // a clock may step back
  return absl::OkStatus();
}

std::vector<NodeId> NodeTable::SilentNodes() const {
  double now = clock_->Now();
  std::vector<NodeId> out;
  // No heartbeat is older than oldest_heartbeat_: while that one is in time
  // every node is, and a tick costs O(1) instead of a pass over every node.
  if (now - oldest_heartbeat_ <= heartbeat_timeout_s_) return out;
  double oldest = std::numeric_limits<double>::infinity();
  for (const auto& [id, rec] : alive_) {
    if (now - rec.last_heartbeat > heartbeat_timeout_s_) {
      out.push_back(id);
    } else {
      oldest = std::min(oldest, rec.last_heartbeat);  // the silent ones are removed by the caller or stay silent
    }
  }
  oldest_heartbeat_ = out.empty() ? oldest : std::min(oldest, oldest_heartbeat_);
  return out;
}

std::vector<NodeId> NodeTable::ExpireSilent() {
  std::vector<NodeId> silent = SilentNodes();
  for (const auto& id : silent) Remove(id, NodeState::kDead, "heartbeat timeout");
  return silent;
}

bool NodeTable::Remove(const NodeId& node_id, NodeState state, const std::string& reason) {
  auto it = alive_.find(node_id);
  if (it == alive_.end()) return false;
  index_.erase(it->first);  // node_id may be the record's own (moved below)
  ++version_;
  NodeRecord rec = std::move(it->second);
  alive_.erase(it);
  rec.state = state;
  rec.group_rank = -1;
  rec.gone_reason = reason;
  gone_.push_back(std::move(rec));
  while (gone_.size() > kMaxRemembered) gone_.pop_front();
  return true;
}

}  // namespace ballast::master
