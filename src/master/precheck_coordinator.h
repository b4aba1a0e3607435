// PrecheckCoordinator: drives one pre-flight check of a set of nodes through
// its check rounds (health/precheck.h has the grouping and verdict rules):
//   round 1: groups in node-rank order; when every group passed, done;
//   round 2: the fastest with the slowest (only after a failure, >= 4 nodes);
//   round 3: each suspect with a healthy node (only when round 2 left two
//            nodes that failed together twice).
// A check of nodes that join a running job (`joiners`) runs among the joiners
// only, since the members are training; their times are judged against the
// members' earlier check times too (`reference_times`). With 3 joiners or
// fewer a failure is localized by checking the failed ones alone in round 2
// (health::JudgeWithAloneRound) instead of failing everyone; one joiner is
// checked alone from the start.
// Each round hands out one v1::RunCheck per node (its group's small world),
// collects one v1::CheckResult per node (a node silent past the deadline
// failed), applies group failure, and moves on. The JobMaster owns it, feeds
// it results and the clock, and acts on the outcome (exclude, report, start
// training).
//
// Ownership: plain value type. Thread safety: none; the JobMaster serializes
// access under its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "ballast/v1/master.pb.h"
#include "common/ids.h"
#include "health/precheck.h"

namespace ballast::master {

struct PrecheckOptions {
  // Seconds an agent gives one check round (torch import included) before it
  // kills the check and reports a failure. BALLAST_PRECHECK_TIMEOUT_S.
  double timeout_s = 120.0;
  // The master counts a node that sent no result by timeout_s + grace_s as
  // failed. BALLAST_PRECHECK_GRACE_S.
  double grace_s = 30.0;
  // Allreduce payload per worker. BALLAST_PRECHECK_ALLREDUCE_BYTES.
  int64_t allreduce_bytes = 16 << 20;
  // Square matmul size. BALLAST_PRECHECK_MATMUL_SIZE.
  int matmul_size = 1024;
  // A node slower than this x the median is a straggler ...
  double straggler_factor = 2.0;
  // ... and more than this many seconds slower: differences below it are
  // timing noise of a short benchmark. BALLAST_PRECHECK_STRAGGLER_MIN_S.
  double straggler_min_gap_s = 0.1;

  // Defaults overridden by the BALLAST_PRECHECK_* environment variables.
  static PrecheckOptions FromEnv();
};

struct PrecheckNode {
  NodeId node_id;
  int local_world_size = 1;
};

// The result of a finished check, with node ids instead of indices.
struct PrecheckOutcome {
  health::Verdict verdict;
  std::vector<NodeId> nodes;       // checked nodes, in rank order
  std::vector<NodeId> faulty;      // verdict.faulty as node ids
  std::vector<NodeId> stragglers;  // verdict.stragglers as node ids
  std::map<NodeId, std::string> errors;  // node id -> first error it reported
  // node id -> best passing time in a group of several nodes (not alone):
  // the reference for judging later joiners.
  std::map<NodeId, double> best_times;
  bool joiners = false;                       // a check of joining nodes
};

using CheckDecisions = std::vector<std::pair<NodeId, v1::RunCheck>>;

class PrecheckCoordinator {
 public:
  explicit PrecheckCoordinator(PrecheckOptions options = PrecheckOptions{});

  bool active() const { return active_; }
  int check_round() const { return round_; }
  const std::vector<PrecheckNode>& nodes() const { return nodes_; }
  const PrecheckOptions& options() const { return options_; }

  // Starts a check of `nodes` (rank order, >= 1) at `now`; returns round 1's
  // RunCheck decisions. Replaces a running check. `joiners`: the nodes join a
  // running job (see above); `reference_times`: best times of nodes checked
  // before, for the straggler median.
  CheckDecisions Begin(std::vector<PrecheckNode> nodes, double now, bool joiners = false,
                       std::vector<double> reference_times = {});
  bool joiners() const { return joiners_; }
  // Records one node's result: kAborted for another check_id than the current
  // round's (stale), kFailedPrecondition for a node not in this round.
  absl::Status Record(const v1::CheckResult& result);
  // Every node of the round reported, or the deadline passed.
  bool RoundComplete(double now) const;

  struct Step {
    CheckDecisions next;                     // the next round's decisions, or
    std::optional<PrecheckOutcome> outcome;  // the final verdict (check over)
  };
  // Call once RoundComplete: closes the round and starts the next or ends.
  Step Advance(double now);
  // Drops the running check (a node of it was lost).
  void Abort() { active_ = false; }

 private:
  CheckDecisions StartRound(const health::Groups& groups, double now);
  PrecheckOutcome MakeOutcome(const health::Verdict& v) const;

  PrecheckOptions options_;
  bool active_ = false;
  bool joiners_ = false;
  bool alone_round_ = false;  // round 2 checks round 1's failed joiners alone
  std::vector<double> reference_;
  int64_t next_check_id_ = 1;
  int64_t check_id_ = 0;  // the running round's id
  int round_ = 0;         // 1..3 within the check
  double deadline_ = 0;
  std::vector<PrecheckNode> nodes_;
  health::Groups groups_;
  std::set<int> pending_;  // indices that owe a result this round
  std::vector<health::NodeResult> results_;
  std::vector<health::NodeResult> r1_, r2_;
  health::Verdict verdict2_;
  std::map<NodeId, std::string> errors_;
};

}  // namespace ballast::master
