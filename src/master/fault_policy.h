// FaultPolicy: what the job master does when a worker fails. It restarts the
// round in place while restarts remain (restart_count < max_restarts) and
// fails the job after that, and it writes the failure message users read.
//
// Only the first failure report of a round drives a decision: when one rank
// dies, the collective breaks and the other ranks die too, and those later
// reports say nothing new. They get kIgnore.
//
// Membership changes (scale up/down) are not failures and never reach here,
// so they do not use up restarts. A failure kind with its own retry limit
// (the agent's classification, e.g. out of memory: retrying the same batch on
// the same memory fails the same way) fails the job once that many restarts
// went to it, even if --max-restarts allows more.
//
// Ownership: plain value type. Thread safety: none; the owner (JobMaster)
// serializes access.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "ballast/v1/master.pb.h"
#include "health/health_policy.h"

namespace ballast::master {

enum class FailureAction {
  kIgnore,    // a later report for a round that already had its decision
  kRestart,   // restart the round in place (new round, restart_count + 1)
  kFailJob,   // max_restarts used up: the job fails with `message`
  kRollback,  // a bad loss (health_policy.h): restart every rank from the step before it
};

struct FailureVerdict {
  FailureAction action = FailureAction::kIgnore;
  std::string message;  // for kFailJob the job's failure message; else a log line
};

class FaultPolicy {
 public:
  explicit FaultPolicy(int max_restarts, health::HealthPolicy health = {})
      : max_restarts_(max_restarts), health_(health) {}

  // Decides on `report` (already checked to be for the current round).
  // `host` is the failed node's host, `restarts_used` the job's restart count
  // (rollbacks included: they are restarts of the workers, but use up
  // --max-rollbacks, not --max-restarts).
  FailureVerdict OnFailure(const v1::FailureReport& report, const std::string& host,
                           int restarts_used);

  int max_restarts() const { return max_restarts_; }
  const health::HealthPolicy& health() const { return health_; }
  // Rollbacks so far (failures of kind "nan", "loss-spike" and "sdc" rolled back).
  int rollbacks() const;
  // Whether a report is a bad loss or a diverged replica (kind "nan", "loss-spike", "sdc").
  static bool IsHealthReport(const v1::FailureReport& report);
  // Its state, for the master's journal, and back from it.
  int64_t decided_round() const { return decided_round_; }
  const std::map<std::string, int>& restarts_by_kind() const { return restarts_by_kind_; }
  void Restore(int64_t decided_round, std::map<std::string, int> restarts_by_kind) {
    decided_round_ = decided_round;
    restarts_by_kind_ = std::move(restarts_by_kind);
  }

  // "exit code 1" or "killed by SIGKILL"; the agent's own classification
  // instead when it says more (e.g. "out of GPU memory (exit code 1): ..."),
  // or added in parentheses when it says something else (e.g. "hang").
  static std::string DescribeCause(const v1::FailureReport& report);
  // "worker rank 3 (local rank 1) on node n1 (host h1) failed in round 2: exit code 1"
  static std::string DescribeWorker(const v1::FailureReport& report, const std::string& host);
  // The job's failure message: who failed, why, the restarts used and, last,
  // the tail of the worker's stderr.
  static std::string JobFailureMessage(const v1::FailureReport& report, const std::string& host,
                                       int restarts_used, int max_restarts);

 private:
  FailureVerdict OnBadLoss(const v1::FailureReport& report, const std::string& host);

  int max_restarts_;
  health::HealthPolicy health_;
  int64_t decided_round_ = -1;  // the last round a report decided on
  std::map<std::string, int> restarts_by_kind_;  // restarts spent on each failure kind
};

}  // namespace ballast::master
