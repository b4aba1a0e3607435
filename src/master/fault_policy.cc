#include "master/fault_policy.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/subprocess.h"
#include "health/failure_class.h"

namespace ballast::master {

std::string FaultPolicy::DescribeCause(const v1::FailureReport& report) {
  // No exit status: the agent's own verdict (e.g. an unreachable MASTER_ADDR
  // before any worker started, a process group that never formed).
  if (report.signal() == 0 && report.exit_code() == 0 && !report.cause().empty()) return report.cause();
  std::string cause = report.signal() != 0 ? absl::StrCat("killed by ", SignalName(report.signal()))
                                           : absl::StrCat("exit code ", report.exit_code());
  if (report.cause().empty() || absl::StrContains(cause, report.cause())) return cause;
  if (absl::StrContains(report.cause(), cause)) return report.cause();
  return absl::StrCat(cause, " (", report.cause(), ")");
}

std::string FaultPolicy::DescribeWorker(const v1::FailureReport& report, const std::string& host) {
  return absl::StrCat("worker rank ", report.global_rank(), " (local rank ", report.local_rank(),
                      ") on node ", report.node_id(), " (host ", host, ") failed in round ",
                      report.round(), ": ", DescribeCause(report));
}

std::string FaultPolicy::JobFailureMessage(const v1::FailureReport& report,
                                           const std::string& host, int restarts_used,
                                           int max_restarts) {
  std::string msg = absl::StrCat("job failed: ", DescribeWorker(report, host), "; used ",
                                 restarts_used, " of ", max_restarts, " restarts");
  if (restarts_used >= max_restarts) {
    absl::StrAppend(&msg, " (raise --max-restarts to allow more)");
  }
  absl::string_view tail = absl::StripTrailingAsciiWhitespace(report.stderr_tail());
  if (tail.empty()) {
    absl::StrAppend(&msg, "\nits stderr was empty");
  } else {
    absl::StrAppend(&msg, "\nlast lines of its stderr:\n", tail);
  }
  return msg;
}

bool FaultPolicy::IsHealthReport(const v1::FailureReport& report) {
  return report.kind() == health::FailureKindName(health::FailureKind::kNonFiniteLoss) ||
         report.kind() == health::FailureKindName(health::FailureKind::kLossSpike) ||
         report.kind() == health::FailureKindName(health::FailureKind::kSilentCorruption);
}

int FaultPolicy::rollbacks() const {
  int n = 0;
  for (health::FailureKind k : {health::FailureKind::kNonFiniteLoss, health::FailureKind::kLossSpike,
                                health::FailureKind::kSilentCorruption}) {
    auto it = restarts_by_kind_.find(health::FailureKindName(k));
    if (it != restarts_by_kind_.end()) n += it->second;
  }
  return n;
}

FailureVerdict FaultPolicy::OnBadLoss(const v1::FailureReport& report, const std::string& host) {
  const std::string who = absl::StrCat("worker rank ", report.global_rank(), " (local rank ", report.local_rank(),
                                       ") on node ", report.node_id(), " (host ", host, ") in round ", report.round(),
                                       ": ", DescribeCause(report));
  const bool sdc = report.kind() == health::FailureKindName(health::FailureKind::kSilentCorruption);
  switch (sdc ? health::OnNan::kRollback : health_.on_nan) {  // --on-nan is about losses
    case health::OnNan::kIgnore:
      return {FailureAction::kIgnore, absl::StrCat("bad loss ignored (--on-nan ignore): ", who)};
    case health::OnNan::kFail:
      return {FailureAction::kFailJob, absl::StrCat("job failed: bad loss (--on-nan fail): ", who)};
    case health::OnNan::kRollback:
      break;
  }
  const int used = rollbacks();
  if (used >= health_.max_rollbacks) {
    return {FailureAction::kFailJob,
            absl::StrCat("job failed: ", sdc ? "silent data corruption" : "bad loss", " after ", used, " of ",
                         health_.max_rollbacks, " rollbacks: ", who,
                         sdc ? "; (raise --max-rollbacks to allow more)"
                             : "; the loss keeps going bad after rolling back: look at the data and the learning "
                               "rate near that step (raise --max-rollbacks to allow more)")};
  }
  ++restarts_by_kind_[report.kind()];
  return {FailureAction::kRollback,
          absl::StrCat("rolling back (rollback ", used + 1, " of ", health_.max_rollbacks,
                       ") to the newest checkpoint before step ", report.health_step(), ": ", who)};
}

FailureVerdict FaultPolicy::OnFailure(const v1::FailureReport& report, const std::string& host,
                                      int restarts_used) {
  if (report.round() <= decided_round_) {
    return {FailureAction::kIgnore,
            absl::StrCat("ignored: round ", report.round(),
                         " already had its failure decision (", DescribeWorker(report, host),
                         ")")};
  }
  if (IsHealthReport(report)) {
    FailureVerdict v = OnBadLoss(report, host);
    if (v.action != FailureAction::kIgnore) decided_round_ = report.round();
    return v;
  }
  decided_round_ = report.round();
  if (report.kind() == health::FailureKindName(health::FailureKind::kStraggler)) {
    // A membership change, as for a lost node: no restart used up.
    ++restarts_by_kind_[report.kind()];
    return {FailureAction::kRestart,
            absl::StrCat("excluding node ", report.node_id(), " (host ", host, "): ", report.cause(),
                         "; the others restart without it (not counted against --max-restarts)")};
  }
  // Rollbacks have a limit of their own; straggler exclusions change the membership.
  restarts_used -= rollbacks() + restarts_by_kind_[health::FailureKindName(health::FailureKind::kStraggler)];
  if (report.max_retries() >= 0 && !report.kind().empty() &&
      restarts_by_kind_[report.kind()] >= report.max_retries()) {
    return {FailureAction::kFailJob,
            absl::StrCat(JobFailureMessage(report, host, restarts_used, max_restarts_), "\n(",
                         report.kind(), " failures are retried at most ", report.max_retries(),
                         " time(s): the same failure is likely to repeat)")};
  }
  if (restarts_used < max_restarts_) {
    ++restarts_by_kind_[report.kind()];
    return {FailureAction::kRestart,
            absl::StrCat("restarting in place (restart ", restarts_used + 1, " of ",
                         max_restarts_, "): ", DescribeWorker(report, host))};
  }
  return {FailureAction::kFailJob,
          JobFailureMessage(report, host, restarts_used, max_restarts_)};
}

}  // namespace ballast::master
