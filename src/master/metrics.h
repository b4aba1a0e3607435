// The job's metrics in the Prometheus text exposition format (version
// 0.0.4), for GET /metrics. Names follow Prometheus conventions: base units
// (seconds, ratios), `_total` for counters, one metric family per quantity
// with labels for its parts.
#pragma once

#include <map>
#include <string>

#include "ballast/v1/master.pb.h"
#include "master/failure_log.h"

namespace ballast::master {

struct MetricsInput {
  const v1::JobStatus* status = nullptr;
  const Histogram* recovery = nullptr;                // FailureLog::recovery()
  const std::map<std::string, int>* restarts = nullptr;  // by cause (failure kind)
  const Histogram* ckpt_save = nullptr;               // seconds each checkpoint save blocked a worker
};

std::string PrometheusText(const MetricsInput& in);

// The states ballast_nodes is labelled with (every one is always exported,
// 0 when no node is in it, so a series never vanishes).
inline constexpr const char* kNodeStates[] = {"waiting", "training", "checking", "done",
                                              "excluded", "dead", "left"};

}  // namespace ballast::master
