// FailureArbiter: when a worker-failure report is decided, and which of the
// reports decided together is blamed; one component of the JobMaster
// (job_master.h), which applies the fault policy to what it hands back.
//
// A report is held (instead of decided at once) when the round has more than
// one member, for failure_settle_s (hang_settle_s for a hang), and while
// another member's Watch stream is closed: a worker that failed because
// another node died is part of that node's loss (a membership change, no
// restart), and the hang reports of the other nodes arrive. Once every member
// has reported, nothing more is awaited and the settle time ends. Reports of an
// older round are dropped when a world change came first. Of the reports
// decided together, hangs are blamed before crashes, the hung rank outside a
// collective before those waiting in one, and a crash that says a collective
// lost its peer after any other crash (OrderForBlame).
//
// Threading: no lock of its own; runs under the JobMaster's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ballast/v1/master.pb.h"
#include "common/ids.h"

namespace ballast::master {

class FailureArbiter {
 public:
  struct Held {
    v1::FailureReport report;
    std::string host;
    double reported_at = 0;  // the master's clock
  };

  FailureArbiter(double failure_settle_s, double hang_settle_s)
      : failure_settle_s_(failure_settle_s), hang_settle_s_(hang_settle_s) {}

  // How long a report is held in a round of `members` nodes (0: decided at once).
  double SettleSeconds(const v1::FailureReport& report, size_t members) const;
  // Whether another report can be held (common/limits.h bounds them).
  bool CanHold() const;
  void Hold(Held held) { held_.push_back(std::move(held)); }
  const std::vector<Held>& held() const { return held_; }
  void Clear() { held_.clear(); }
  // Drops the reports of rounds other than `round` and returns them: a node
  // loss re-formed the world meanwhile, so they use up no restart.
  std::vector<Held> DropStale(Round round);
  // The held reports, in blame order (OrderForBlame), once the settle time of
  // every one of them passed since the first arrived, or every member of the
  // round reported, and no member other than the first report's node is
  // disconnected; else nothing (they stay held).
  std::vector<Held> TakeDue(double now, size_t members,
                            const std::function<bool(const NodeId& except)>& other_member_disconnected);

  // Puts the report to blame first: hangs before crashes, in a hang the rank
  // outside a collective, the lowest step, the longest idle. The blamed
  // report's stderr tail then names the other hung ranks; returns a line that
  // says who was blamed among whom ("" when at most one hung).
  static std::string OrderForBlame(std::vector<Held>* reports);
  // From the last sign of health to now: a hang since the worker's last
  // progress, an exit since the agent saw it, plus the time it was held.
  static double DetectionSeconds(const v1::FailureReport& report, double held_s);

 private:
  const double failure_settle_s_;
  const double hang_settle_s_;
  std::vector<Held> held_;
};

// The failure kind of a hang report (health::FailureKind::kHang's name).
bool IsHangReport(const v1::FailureReport& report);

}  // namespace ballast::master
