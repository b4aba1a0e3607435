// The agent's side of training health (health/health_policy.h): turns a bad
// loss a worker recorded in its progress cell into the failure report the
// master's FaultPolicy decides on (kind "nan" or "loss-spike", the step, the
// value and the bad step's samples).
//
// Thread safety: a pure function.
#pragma once

#include <string>

#include "agent/progress_monitor.h"
#include "ballast/v1/master.pb.h"

namespace ballast::agent {

// The report for worker `global_rank` (local rank `local_rank`) of this node.
v1::FailureReport HealthFailureReport(const HealthRecord& bad, const std::string& node_id, int64_t round,
                                      int local_rank, int global_rank);

}  // namespace ballast::agent
