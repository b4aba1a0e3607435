#include "master/fault_policy.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/subprocess.h"

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

FailureVerdict FaultPolicy::OnFailure(const v1::FailureReport& report, const std::string& host,
                                      int restarts_used) {
  if (report.round() <= decided_round_) {
    return {FailureAction::kIgnore,
            absl::StrCat("ignored: round ", report.round(),
                         " already had its failure decision (", DescribeWorker(report, host),
                         ")")};
  }
  decided_round_ = report.round();
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
