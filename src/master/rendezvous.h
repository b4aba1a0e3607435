// Rendezvous: decides when a round of nodes is complete and which node gets
// which rank. Pure logic: no gRPC, no threads, time is passed in (`now`, in
// seconds of the job master's clock), so every rule is unit-tested without
// sleeping.
//
// Rules (the torchrun/DLRover semantics users know):
//  - A round can form when MAX nodes joined, or when at least MIN joined and
//    `last_call_s` passed since the last new join.
//  - The world is min(joined, MAX) rounded down to a multiple of `node_unit`;
//    if that is below MIN, keep waiting. Nodes left out are "surplus" and wait
//    for a later round.
//  - Rank order is deterministic: nodes with a rank hint first (ascending),
//    then nodes without one, in join order; ties by join order. group_rank is
//    the index in that order and a node's rank offset is the prefix sum of the
//    local world sizes before it. With a surplus, the first nodes in that order
//    are chosen.
//
// The participants are every alive node the job master knows (members of the
// running round and waiting nodes alike); the job master removes lost nodes.
//
// Ownership: plain value type. Thread safety: none; the owner (JobMaster)
// serializes access under its mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/ids.h"

namespace ballast::master {

struct RendezvousConfig {
  int min_nodes = 1;
  int max_nodes = 1;
  int node_unit = 1;
  double last_call_s = 1.0;
};

// What a node brings to the rendezvous.
struct NodeSpec {
  NodeId node_id;
  int node_rank_hint = -1;  // -1: no hint
  int local_world_size = 1;
  std::string host;
};

struct MemberAssignment {
  NodeId node_id;
  int group_rank = 0;
  int local_world_size = 0;
  int rank_offset = 0;  // global rank of the node's local rank 0
  std::string host;
};

// The outcome of a completed rendezvous.
struct World {
  std::vector<MemberAssignment> members;  // in group-rank order
  std::vector<NodeId> surplus;            // participants not chosen, in rank order
  int world_size = 0;                     // sum of the members' local world sizes

  int num_nodes() const { return static_cast<int>(members.size()); }
  // The member with this id, or nullptr. O(1): by an index built on first use
  // and again after `members` grew or was replaced (the job master asks for
  // each node of a status, a failure's new world and each progress report; a
  // scan made those O(nodes^2) at 10,000 nodes). `members` must change only
  // by push_back or as a whole (not by overwriting an element in place), and
  // one World must not be searched from two threads at once.
  const MemberAssignment* Find(const NodeId& node_id) const;

 private:
  // A copy starts without one (it would be rebuilt for the copy's members
  // anyway); a move keeps it (the members' buffer moves with it).
  struct Index {
    absl::flat_hash_map<NodeId, size_t> positions;  // node id -> position in members
    size_t size = 0;                                 // members.size() when built
    const MemberAssignment* data = nullptr;          // members.data() then
    Index() = default;
    Index(const Index&) {}
    Index& operator=(const Index&) {
      positions.clear();
      size = 0;
      data = nullptr;
      return *this;
    }
    Index(Index&&) = default;
    Index& operator=(Index&&) = default;
  };
  mutable Index index_;
};

class Rendezvous {
 public:
  explicit Rendezvous(RendezvousConfig config);

  // Adds a node and restarts the last-call timer (returns true), or refreshes
  // the info of a node that is already a participant, keeping its place in
  // join order and leaving the timer alone (returns false): a reconnecting
  // agent does not lose its place.
  bool Join(const NodeSpec& node, double now);
  // Removes a participant (lost or left). Returns false if it was not one.
  bool Remove(const NodeId& node_id);
  bool Contains(const NodeId& node_id) const;
  int size() const { return static_cast<int>(entries_.size()); }

  // The largest valid world from `n` nodes: min(n, MAX) rounded down to a
  // multiple of node_unit, or 0 when that is below MIN.
  int RoundedNodes(int n) const;
  // RoundedNodes(size()): the nodes a round formed now would have (0: none).
  int UsableNodes() const { return RoundedNodes(size()); }

  // Whether a round may form now: a valid world exists and either MAX nodes
  // joined or last_call_s passed since the last new join.
  bool Ready(double now) const;
  // Seconds until Ready() turns true if nothing changes; 0 when ready now,
  // nullopt when more nodes are needed first.
  std::optional<double> SecondsUntilReady(double now) const;

  // The world formed from all participants; nullopt when below MIN.
  std::optional<World> Form() const;
  // The world formed from the participants named in `candidates` only (e.g.
  // the current members, for a restart in place); every other participant is
  // surplus. nullopt when the candidates are below MIN.
  std::optional<World> FormFrom(const std::vector<NodeId>& candidates) const;

  // Participants in rank order.
  std::vector<NodeSpec> Ordered() const;
  // Their ids, in rank order.
  std::vector<NodeId> OrderedIds() const;
  // Participants in the order they joined (a reconnect keeps its place): the
  // longest-waiting first.
  std::vector<NodeId> JoinOrder() const;
  double last_join_time() const { return last_join_time_; }
  const RendezvousConfig& config() const { return config_; }

 private:
  struct Entry {
    NodeSpec spec;
    uint64_t seq = 0;  // join order
  };
  std::vector<const Entry*> OrderedEntries() const;
  // The world of `ordered_candidates`; the other participants of `ordered`
  // (every participant, in rank order) are its surplus.
  std::optional<World> FormImpl(const std::vector<const Entry*>& ordered_candidates,
                                const std::vector<const Entry*>& ordered) const;

  RendezvousConfig config_;
  std::vector<Entry> entries_;  // in join order
  absl::flat_hash_set<NodeId> ids_;  // entries_' node ids: a join is O(1), not a pass over every entry
  uint64_t next_seq_ = 0;
  double last_join_time_ = 0;
};

}  // namespace ballast::master
