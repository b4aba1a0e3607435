// Training health beyond crashes: what the job does when a worker reports a
// bad loss with `ballast.step(step, loss=...)` (python/ballast/health.py).
//
// The worker itself watches its loss (no per-step RPC): a non-finite loss
// always, a spike (more than loss_spike_z robust deviations above the median
// of its recent losses) when asked. It records the bad step in its progress
// cell (common/progress_cell.h) and stops making progress; its agent reports
// a failure of kind "nan" or "loss-spike" (failure_class.h) and the master's
// FaultPolicy decides:
//   rollback  every rank restarts from the newest checkpoint step saved
//             before the bad one: the agents drop the newer steps from
//             memory, replicas and disk first (StartRound.rollback_below),
//             and the bad step's samples are skipped (ElasticSampler reads
//             BALLAST_SKIP_DATA) unless skip_data is off; at most
//             max_rollbacks per job, then the job fails naming rank, step
//             and value. Rollbacks do not use up --max-restarts.
//   fail      the job fails at once with that report.
//   ignore    workers only log the bad loss and go on.
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast::health {

// Worker environment, set by the agent from the master's settings.
inline constexpr char kOnNanEnv[] = "BALLAST_ON_NAN";         // rollback | fail | ignore
inline constexpr char kLossSpikeEnv[] = "BALLAST_LOSS_SPIKE";  // robust z threshold; absent: off
// Per round: "epoch:begin:end,..." sample positions ElasticSampler skips.
inline constexpr char kSkipDataEnv[] = "BALLAST_SKIP_DATA";
// Every this many steps workers fingerprint their parameters (ballast.step(step, model=)).
inline constexpr char kReplicaCheckEveryEnv[] = "BALLAST_REPLICA_CHECK_EVERY";

enum class OnNan { kRollback, kFail, kIgnore };

struct HealthPolicy {
  OnNan on_nan = OnNan::kRollback;
  int max_rollbacks = 3;
  double loss_spike_z = 0;  // 0: spike detection off
  bool skip_data = true;
  // Silent data corruption: every this many steps the ranks that must hold
  // the same parameters compare fingerprints (0: off).
  int replica_check_every = 100;
};

const char* OnNanName(OnNan mode);
// "rollback", "fail" or "ignore"; kInvalidArgument saying what is allowed.
absl::StatusOr<OnNan> ParseOnNan(absl::string_view text);
// max_rollbacks >= 0; loss_spike_z 0 (off) or >= 1. kInvalidArgument naming the flag.
absl::Status Validate(const HealthPolicy& policy);
// "--on-nan rollback --max-rollbacks 3 --loss-spike off", for log lines.
std::string Describe(const HealthPolicy& policy);

// One range of an epoch's sample positions (ElasticSampler's global positions).
struct SampleRange {
  int64_t epoch = 0;
  int64_t begin = 0;
  int64_t end = 0;  // exclusive; > begin
};
// "epoch:begin:end" with 0 <= begin < end; kInvalidArgument otherwise.
absl::StatusOr<SampleRange> ParseSampleRange(absl::string_view text);
std::string FormatSampleRange(const SampleRange& range);
// Adds `range` to a comma-separated list (ranges already there are kept once).
std::string AddSampleRange(absl::string_view list, const SampleRange& range);

}  // namespace ballast::health
