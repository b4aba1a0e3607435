#include "agent/health_watch.h"

#include "absl/strings/str_cat.h"
#include "health/failure_class.h"
#include "health/health_policy.h"

namespace ballast::agent {

v1::FailureReport HealthFailureReport(const HealthRecord& bad, const std::string& node_id, int64_t round,
                                      int local_rank, int global_rank) {
  v1::FailureReport r;
  r.set_node_id(node_id);
  r.set_round(round);
  r.set_local_rank(local_rank);
  r.set_global_rank(global_rank);
  const bool spike = bad.kind == HealthKind::kSpike;
  r.set_kind(health::FailureKindName(spike ? health::FailureKind::kLossSpike : health::FailureKind::kNonFiniteLoss));
  r.set_max_retries(-1);  // the master's --max-rollbacks applies
  r.set_cause(spike ? absl::StrCat("loss spike at step ", bad.step, ": ", bad.value, ", ", absl::SixDigits(bad.z),
                                   " robust deviations above the recent median ", bad.median)
                    : absl::StrCat("non-finite loss (", bad.value, ") at step ", bad.step));
  r.set_health_step(static_cast<int64_t>(bad.step));
  r.set_health_value(bad.value);
  if (bad.end > bad.begin) {
    r.set_health_data(health::FormatSampleRange(health::SampleRange{
        static_cast<int64_t>(bad.epoch), static_cast<int64_t>(bad.begin), static_cast<int64_t>(bad.end)}));
  }
  return r;
}

}  // namespace ballast::agent
