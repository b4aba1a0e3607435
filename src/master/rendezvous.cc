#include "master/rendezvous.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"

namespace ballast::master {

const MemberAssignment* World::Find(const NodeId& node_id) const {
  if (index_.size != members.size() || index_.data != members.data()) {
    index_.positions.clear();
    index_.positions.reserve(members.size());
    for (size_t i = 0; i < members.size(); ++i) index_.positions.emplace(members[i].node_id, i);  // the first of a duplicate
    index_.size = members.size();
    index_.data = members.data();
  }
  auto it = index_.positions.find(node_id);
  return it == index_.positions.end() ? nullptr : &members[it->second];
}

Rendezvous::Rendezvous(RendezvousConfig config) : config_(config) {}

bool Rendezvous::Join(const NodeSpec& node, double now) {
  if (ids_.contains(node.node_id)) {
    for (auto& e : entries_) {
      if (e.spec.node_id == node.node_id) {
        e.spec = node;
        break;
      }
    }
    return false;
  }
  ids_.insert(node.node_id);
  entries_.push_back(Entry{node, next_seq_++});
  last_join_time_ = now;
  return true;
}

bool Rendezvous::Remove(const NodeId& node_id) {
  if (ids_.erase(node_id) == 0) return false;
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return e.spec.node_id == node_id; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  return true;
}

bool Rendezvous::Contains(const NodeId& node_id) const { return ids_.contains(node_id); }

int Rendezvous::RoundedNodes(int n) const {
  int capped = std::min(n, config_.max_nodes);
  int unit = std::max(config_.node_unit, 1);
  int rounded = capped - capped % unit;
  return rounded >= config_.min_nodes && rounded > 0 ? rounded : 0;
}

bool Rendezvous::Ready(double now) const {
  auto wait = SecondsUntilReady(now);
  return wait.has_value() && *wait <= 0;
}

std::optional<double> Rendezvous::SecondsUntilReady(double now) const {
  if (UsableNodes() == 0) return std::nullopt;
  if (size() >= config_.max_nodes) return 0.0;
  return std::max(0.0, last_join_time_ + config_.last_call_s - now);
}

std::vector<const Rendezvous::Entry*> Rendezvous::OrderedEntries() const {
  std::vector<const Entry*> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(&e);
  // Nodes with a hint first (ascending hint), then the rest; join order breaks
  // every tie, so the order never depends on map or hash iteration.
  auto before = [](const Entry* a, const Entry* b) {
    bool a_hint = a->spec.node_rank_hint >= 0;
    bool b_hint = b->spec.node_rank_hint >= 0;
    if (a_hint != b_hint) return a_hint;
    if (a_hint && a->spec.node_rank_hint != b->spec.node_rank_hint) {
      return a->spec.node_rank_hint < b->spec.node_rank_hint;
    }
    return a->seq < b->seq;
  };
  // Without hints entries_ (join order) is the order already: a pass, not a sort.
  if (!std::is_sorted(out.begin(), out.end(), before)) std::stable_sort(out.begin(), out.end(), before);
  return out;
}

std::vector<NodeSpec> Rendezvous::Ordered() const {
  std::vector<NodeSpec> out;
  for (const Entry* e : OrderedEntries()) out.push_back(e->spec);
  return out;
}

std::vector<NodeId> Rendezvous::OrderedIds() const {
  const std::vector<const Entry*> ordered = OrderedEntries();
  std::vector<NodeId> out;
  out.reserve(ordered.size());
  for (const Entry* e : ordered) out.push_back(e->spec.node_id);
  return out;
}

std::vector<NodeId> Rendezvous::JoinOrder() const {
  std::vector<NodeId> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.spec.node_id);  // entries_ is in join order
  return out;
}

std::optional<World> Rendezvous::Form() const {
  const std::vector<const Entry*> ordered = OrderedEntries();
  return FormImpl(ordered, ordered);
}

std::optional<World> Rendezvous::FormFrom(const std::vector<NodeId>& candidates) const {
  const absl::flat_hash_set<NodeId> wanted(candidates.begin(), candidates.end());
  const std::vector<const Entry*> ordered = OrderedEntries();
  std::vector<const Entry*> chosen;
  chosen.reserve(std::min(ordered.size(), candidates.size()));
  for (const Entry* e : ordered) {
    if (wanted.count(e->spec.node_id) > 0) chosen.push_back(e);
  }
  return FormImpl(chosen, ordered);
}

std::optional<World> Rendezvous::FormImpl(const std::vector<const Entry*>& ordered_candidates,
                                          const std::vector<const Entry*>& ordered) const {
  int n = RoundedNodes(static_cast<int>(ordered_candidates.size()));
  if (n == 0) return std::nullopt;
  World world;
  world.members.reserve(static_cast<size_t>(n));
  absl::flat_hash_set<const Entry*> members;  // entries are distinct participants
  members.reserve(static_cast<size_t>(n));
  int offset = 0;
  for (int i = 0; i < n; ++i) {
    const NodeSpec& s = ordered_candidates[i]->spec;
    world.members.push_back(MemberAssignment{s.node_id, i, s.local_world_size, offset, s.host});
    members.insert(ordered_candidates[i]);
    offset += s.local_world_size;
  }
  world.world_size = offset;
  for (const Entry* e : ordered) {
    if (!members.contains(e)) world.surplus.push_back(e->spec.node_id);
  }
  return world;
}

}  // namespace ballast::master
