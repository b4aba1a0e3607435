// NodeTable: the nodes of a job, their state and liveness. Alive nodes are
// "waiting" (not in the running round), "training" (a member of it) or "done"
// (its workers of the current round all exited 0). A node that misses
// heartbeats for heartbeat_timeout_s, or leaves, is removed from the alive set
// but remembered (as "dead" or "left") so `ballast status` can still show it.
//
// Time comes from an injected ClockInterface so timeout detection is tested
// with FakeClock.
//
// Ownership: the table owns its records; the clock is borrowed and must
// outlive the table. Thread safety: none; the owner (JobMaster) serializes
// access under its mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "ballast/v1/master.pb.h"
#include "common/clock.h"
#include "master/rendezvous.h"

namespace ballast::master {

enum class NodeState { kWaiting, kTraining, kDone, kDead, kLeft };

// "waiting", "training", "done", "dead", "left" (the JobStatus strings).
std::string_view NodeStateName(NodeState state);

struct NodeRecord {
  NodeSpec spec;
  int64_t pid = 0;
  NodeState state = NodeState::kWaiting;
  int group_rank = -1;  // -1 when not a member of the current round
  double joined_at = 0;
  double last_heartbeat = 0;
  int64_t last_step = 0;
  double last_step_time_s = 0;
  Round progress_round;        // the round last_step/last_step_time_s belong to
  double last_compute_time_s = 0;  // its slowest worker's compute time per forward pass; 0 = unknown
  bool straggler = false;      // flagged at its last progress report (for a one-time warning)
  int straggler_checks = 0;    // consecutive straggler checks that found it a straggler
  std::string gone_reason;  // why a dead/left node is gone
  v1::StartTimeline timeline;  // its workers' last (re)start (from progress reports)
  double step_reached_at = 0;      // master clock: when last_step was reached
  bool first_step_known = false;   // of progress_round: its first step and when every worker had made it
  int64_t first_step = 0;
  double first_step_at = 0;
  // Checkpoint saves of progress_round (ProgressReport.ckpt_*).
  int64_t ckpt_saves = 0;
  double ckpt_stall_max_s = 0;
  double ckpt_stall_sum_s = 0;
};

class NodeTable {
 public:
  // How many dead/left nodes are remembered for status (oldest forgotten first).
  static constexpr size_t kMaxRemembered = 1024;

  NodeTable(ClockInterface* clock, double heartbeat_timeout_s);
  NodeTable(const NodeTable&) = delete;  // index_ points into this one's alive_
  NodeTable& operator=(const NodeTable&) = delete;

  // Adds a node as waiting (sets *added) or refreshes the info of an alive one
  // (its state is kept). Either way its heartbeat is fresh. A node id that was
  // dead or left is alive again (a reconnecting agent).
  NodeRecord& Upsert(const NodeSpec& spec, int64_t pid, bool* added = nullptr);

  NodeRecord* Find(const NodeId& node_id);
  const NodeRecord* Find(const NodeId& node_id) const;
  bool IsAlive(const NodeId& node_id) const { return Find(node_id) != nullptr; }

  // Records a heartbeat. NOT_FOUND "unknown node X: join again" for a node
  // that never joined or was declared dead (it must join again).
  absl::Status Heartbeat(const NodeId& node_id);
  // The same as of time `at` (a master resuming from its journal gives its
  // nodes time to reconnect). A record's last_heartbeat is set only here and
  // by Upsert: the table keeps its nodes in heartbeat order.
  absl::Status Heartbeat(const NodeId& node_id, double at);

  // Alive nodes whose last heartbeat is older than the timeout, in id order.
  // O(silent nodes), not a pass over every node: the alive nodes are kept in
  // heartbeat order (a heartbeat moves its node last, in O(1) while the clock
  // moves forward).
  std::vector<NodeId> SilentNodes() const;
  // SilentNodes(), each moved to the remembered set as dead.
  std::vector<NodeId> ExpireSilent();

  // Moves an alive node to the remembered set with `state` (kDead or kLeft).
  // Returns false if it was not alive.
  bool Remove(const NodeId& node_id, NodeState state, const std::string& reason);

  const std::map<NodeId, NodeRecord>& alive() const { return alive_; }
  std::map<NodeId, NodeRecord>& mutable_alive() { return alive_; }
  const std::deque<NodeRecord>& gone() const { return gone_; }
  double heartbeat_timeout_s() const { return heartbeat_timeout_s_; }
  // Bumped whenever a node becomes alive or stops being alive.
  uint64_t version() const { return version_; }

 private:
  using HeartbeatOrder = std::list<NodeRecord*>;
  struct Slot {
    NodeRecord* rec;
    HeartbeatOrder::iterator by_heartbeat;  // its place in by_heartbeat_
  };
  // Moves a record whose last_heartbeat changed to its place in by_heartbeat_:
  // after every record with an older or equal heartbeat (last, unless the
  // clock stepped back).
  void Place(const Slot& slot);

  ClockInterface* clock_;
  double heartbeat_timeout_s_;
  std::map<NodeId, NodeRecord> alive_;  // in id order (status, silent nodes)
  // alive_ by hash: Find is on every heartbeat, report and member walk, and a
  // tree's string compares were the master's largest cost at 10,000 nodes.
  // Map nodes are stable, so the pointers stay valid until Remove.
  absl::flat_hash_map<NodeId, Slot> index_;
  // alive_'s records by last_heartbeat, oldest first (ties in any order): the
  // silent nodes are a prefix. A scan of every node at each tick once the
  // oldest heartbeat aged was O(nodes) a tick (a simulated job ticks at every
  // event).
  HeartbeatOrder by_heartbeat_;
  uint64_t version_ = 0;
  std::deque<NodeRecord> gone_;  // oldest first
};

}  // namespace ballast::master
