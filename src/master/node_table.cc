#include "master/node_table.h"

#include <algorithm>
#include <iterator>

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

void NodeTable::Place(const Slot& slot) {
  const double at = slot.rec->last_heartbeat;
  // From the newest back past every newer heartbeat (none, unless the clock
  // stepped back), itself skipped.
  auto pos = by_heartbeat_.end();
  while (pos != by_heartbeat_.begin()) {
    auto prev = std::prev(pos);
    if (prev != slot.by_heartbeat && (*prev)->last_heartbeat <= at) break;
    pos = prev;
  }
  by_heartbeat_.splice(pos, by_heartbeat_, slot.by_heartbeat);  // iterators stay valid
}

NodeRecord& NodeTable::Upsert(const NodeSpec& spec, int64_t pid, bool* added) {
  double now = clock_->Now();
  auto it = alive_.find(spec.node_id);
  if (added != nullptr) *added = (it == alive_.end());
  if (it != alive_.end()) {
    it->second.spec = spec;
    it->second.pid = pid;
    it->second.last_heartbeat = now;
    Place(index_.at(spec.node_id));
    return it->second;
  }
  // Alive again: it is no longer one of the gone nodes.
  gone_.erase(std::remove_if(gone_.begin(), gone_.end(),
                             [&](const NodeRecord& r) { return r.spec.node_id == spec.node_id; }),
              gone_.end());
  NodeRecord& rec = alive_[spec.node_id];
  ++version_;
  rec.spec = spec;
  rec.pid = pid;
  rec.state = NodeState::kWaiting;
  rec.joined_at = now;
  rec.last_heartbeat = now;
  const Slot& slot = index_[spec.node_id] = Slot{&rec, by_heartbeat_.insert(by_heartbeat_.end(), &rec)};
  Place(slot);
  return rec;
}

NodeRecord* NodeTable::Find(const NodeId& node_id) {
  auto it = index_.find(node_id);
  return it == index_.end() ? nullptr : it->second.rec;
}

const NodeRecord* NodeTable::Find(const NodeId& node_id) const {
  auto it = index_.find(node_id);
  return it == index_.end() ? nullptr : it->second.rec;
}

absl::Status NodeTable::Heartbeat(const NodeId& node_id) { return Heartbeat(node_id, clock_->Now()); }

absl::Status NodeTable::Heartbeat(const NodeId& node_id, double at) {
  auto it = index_.find(node_id);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown node ", node_id.str(), ": join again"));
  }
  it->second.rec->last_heartbeat = at;
  Place(it->second);
  return absl::OkStatus();
}

std::vector<NodeId> NodeTable::SilentNodes() const {
  const double now = clock_->Now();
  std::vector<NodeId> out;
  // The silent nodes are the oldest heartbeats: stop at the first in time.
  for (const NodeRecord* rec : by_heartbeat_) {
    if (!(now - rec->last_heartbeat > heartbeat_timeout_s_)) break;
    out.push_back(rec->spec.node_id);
  }
  std::sort(out.begin(), out.end());
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
  auto slot = index_.find(it->first);
  by_heartbeat_.erase(slot->second.by_heartbeat);
  index_.erase(slot);  // node_id may be the record's own (moved below)
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
