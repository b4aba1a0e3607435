#include "health/health_policy.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ballast::health {

const char* OnNanName(OnNan mode) {
  switch (mode) {
    case OnNan::kRollback: return "rollback";
    case OnNan::kFail: return "fail";
    case OnNan::kIgnore: return "ignore";
  }
  return "rollback";
}

absl::StatusOr<OnNan> ParseOnNan(absl::string_view text) {
  for (OnNan m : {OnNan::kRollback, OnNan::kFail, OnNan::kIgnore}) {
    if (text == OnNanName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat("--on-nan must be rollback, fail or ignore, got \"", text, "\""));
}

absl::Status Validate(const HealthPolicy& policy) {
  if (policy.max_rollbacks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-rollbacks must be >= 0 (0: a bad loss fails the job), got ", policy.max_rollbacks));
  }
  if (policy.replica_check_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--replica-check-every must be >= 0 steps (0: no fingerprint checks), got ", policy.replica_check_every));
  }
  if (policy.loss_spike_z != 0 && !(policy.loss_spike_z >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--loss-spike must be a z-score >= 1 (e.g. 6: a loss 6 robust deviations above the recent median), or 0 "
        "for off; got ",
        policy.loss_spike_z));
  }
  return absl::OkStatus();
}

std::string Describe(const HealthPolicy& policy) {
  return absl::StrCat("--on-nan ", OnNanName(policy.on_nan), " --max-rollbacks ", policy.max_rollbacks,
                      " --loss-spike ", policy.loss_spike_z > 0 ? absl::StrCat(policy.loss_spike_z) : "off",
                      policy.skip_data ? "" : " --no-skip-data", " --replica-check-every ",
                      policy.replica_check_every);
}

absl::StatusOr<SampleRange> ParseSampleRange(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  SampleRange r;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &r.epoch) || !absl::SimpleAtoi(parts[1], &r.begin) ||
      !absl::SimpleAtoi(parts[2], &r.end) || r.epoch < 0 || r.begin < 0 || r.end <= r.begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad sample range \"", text, "\": expected epoch:begin:end with 0 <= begin < end"));
  }
  return r;
}

std::string FormatSampleRange(const SampleRange& range) {
  return absl::StrCat(range.epoch, ":", range.begin, ":", range.end);
}

std::string AddSampleRange(absl::string_view list, const SampleRange& range) {
  const std::string item = FormatSampleRange(range);
  for (absl::string_view have : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    if (have == item) return std::string(list);
  }
  return list.empty() ? item : absl::StrCat(list, ",", item);
}

}  // namespace ballast::health
