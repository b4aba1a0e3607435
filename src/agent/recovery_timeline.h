// The recovery timeline of one (re)start: when this node saw a worker fail,
// when the round's decision came, when the old workers were stopped and the
// new ones started, when the last of them called init_process_group (its
// imports done), when their process groups were up and when every worker
// made its first step. The agent logs it once the first step is seen and
// sends the last one with its progress reports (`ballast status`).
//
// Pure bookkeeping over CLOCK_MONOTONIC nanoseconds given by the caller, so
// it is tested without workers or sleeping.
//
// Threading: not thread-safe; the agent's main loop owns it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ballast/v1/master.pb.h"

namespace ballast::agent {

class RecoveryTimeline {
 public:
  // A worker of the current round failed (only the first failure of a
  // round counts; one left from a round whose first step never came is
  // replaced).
  void FailureSeen(uint64_t now_ns);
  void DecisionArrived(uint64_t now_ns) { decision_ns_ = now_ns; }
  void OldWorkersStopped(uint64_t now_ns) { stopped_ns_ = now_ns; }
  // The new workers were started (exec'd or handed to warm interpreters):
  // from now on the timeline waits for their first step.
  void WorkersStarted(uint64_t now_ns);
  bool pending() const { return pending_; }
  uint64_t started_ns() const { return started_ns_; }

  // What the agent sees of one running worker.
  struct Worker {
    double pg_up_s = -1;  // CLOCK_MONOTONIC seconds its process group was up (-1: not known)
    bool stepped = false;  // made a step since the workers started
    // When it called init_process_group (-1: not known): from the start to
    // here the interpreter finished its imports (a warm one those it had not
    // preloaded when it was taken) and the script ran up to its process group.
    double pg_call_s = -1;
  };
  struct Progress {
    bool all_pg_up = false;  // every running worker's process group is up
    // Set once, when every running worker stepped: the line to log and the
    // record for the progress reports.
    std::optional<std::string> line;
    std::optional<v1::StartTimeline> record;
  };
  // Called every poll while pending(): `workers` are the running ones
  // (none: nothing to judge yet). `round`, `recovery` (a restart, not the
  // job's first start) and `start` ("warm (2 of 2)") go into the record.
  Progress Track(const std::vector<Worker>& workers, uint64_t now_ns, int64_t round, bool recovery,
                 const std::string& start);
  // Whether a failure was seen for the current start (a recovery).
  bool failure_seen() const { return failure_ns_ != 0; }

 private:
  uint64_t failure_ns_ = 0;  // this node saw a worker fail
  uint64_t decision_ns_ = 0;
  uint64_t stopped_ns_ = 0;
  uint64_t started_ns_ = 0;
  bool pending_ = false;
};

}  // namespace ballast::agent
