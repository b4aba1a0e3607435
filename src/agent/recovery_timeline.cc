#include "agent/recovery_timeline.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ballast::agent {

void RecoveryTimeline::FailureSeen(uint64_t now_ns) {
  if (failure_ns_ == 0 || failure_ns_ < started_ns_) failure_ns_ = now_ns;
}

void RecoveryTimeline::WorkersStarted(uint64_t now_ns) {
  started_ns_ = now_ns;
  pending_ = true;
}

RecoveryTimeline::Progress RecoveryTimeline::Track(const std::vector<Worker>& workers, uint64_t now_ns,
                                                   int64_t round, bool recovery, const std::string& start) {
  Progress out;
  if (!pending_ || workers.empty()) return out;  // exited before a step: no timeline
  double pg_up_s = -1;
  double pg_call_s = -1;
  bool all_stepped = true;
  out.all_pg_up = true;
  for (const Worker& w : workers) {
    pg_up_s = std::max(pg_up_s, w.pg_up_s);
    pg_call_s = std::max(pg_call_s, w.pg_call_s);
    out.all_pg_up = out.all_pg_up && w.pg_up_s > 0;
    all_stepped = all_stepped && w.stepped;
  }
  if (!all_stepped) return out;
  pending_ = false;
  const bool failed = failure_ns_ != 0;
  const uint64_t t0 = failed ? failure_ns_ : decision_ns_;
  auto rel_ms = [&](uint64_t t) { return (static_cast<double>(t) - static_cast<double>(t0)) / 1e6; };
  auto ms = [&](uint64_t t) { return absl::StrCat("+", static_cast<int64_t>(rel_ms(t)), " ms"); };
  const uint64_t pg_up_ns = pg_up_s > 0 ? static_cast<uint64_t>(pg_up_s * 1e9) : 0;
  const uint64_t pg_call_ns = pg_call_s > 0 ? static_cast<uint64_t>(pg_call_s * 1e9) : 0;
  std::string line;
  if (failed) absl::StrAppend(&line, "worker failure seen 0 ms, ");
  absl::StrAppend(&line, "round decision ", failed ? ms(decision_ns_) : "0 ms", ", old workers stopped ",
                  ms(stopped_ns_), ", new workers started ", ms(started_ns_));
  if (pg_call_ns > 0) absl::StrAppend(&line, ", init_process_group called ", ms(pg_call_ns));
  if (pg_up_ns > 0) absl::StrAppend(&line, ", process group up ", ms(pg_up_ns));
  absl::StrAppend(&line, ", first step ", ms(now_ns));
  v1::StartTimeline tl;
  tl.set_round(round);
  tl.set_recovery(recovery || failed);
  tl.set_start(start);
  tl.set_failure_seen(failed);
  tl.set_decision_ms(rel_ms(decision_ns_));
  tl.set_stopped_ms(rel_ms(stopped_ns_));
  tl.set_started_ms(rel_ms(started_ns_));
  if (pg_up_ns > 0) tl.set_pg_up_ms(rel_ms(pg_up_ns));
  tl.set_first_step_ms(rel_ms(now_ns));
  out.line = absl::StrCat(tl.recovery() ? "recovery" : "start", " timeline (round ", round, ", ", start,
                          " start): ", line);
  out.record = std::move(tl);
  failure_ns_ = 0;
  return out;
}

}  // namespace ballast::agent
