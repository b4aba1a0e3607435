#include "master/fault_policy.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;

v1::FailureReport Report(int64_t round, int exit_code = 1, int signal = 0) {
  v1::FailureReport r;
  r.set_node_id("node-7");
  r.set_round(round);
  r.set_local_rank(1);
  r.set_global_rank(5);
  r.set_exit_code(exit_code);
  r.set_signal(signal);
  r.set_stderr_tail("Traceback (most recent call last):\nRuntimeError: boom\n");
  return r;
}

TEST(FaultPolicy, RestartsWhileRestartsRemain) {
  FaultPolicy p(2);
  EXPECT_EQ(p.OnFailure(Report(1), "h", 0).action, FailureAction::kRestart);
  EXPECT_EQ(p.OnFailure(Report(2), "h", 1).action, FailureAction::kRestart);
  EXPECT_EQ(p.OnFailure(Report(3), "h", 2).action, FailureAction::kFailJob);
}

TEST(FaultPolicy, ZeroMaxRestartsFailsAtFirstFailure) {
  FaultPolicy p(0);
  EXPECT_EQ(p.OnFailure(Report(1), "h", 0).action, FailureAction::kFailJob);
}

TEST(FaultPolicy, OnlyFirstReportOfRoundDecides) {
  FaultPolicy p(0);
  EXPECT_EQ(p.OnFailure(Report(4), "h", 0).action, FailureAction::kFailJob);
  FailureVerdict later = p.OnFailure(Report(4, 0, 6), "h", 0);
  EXPECT_EQ(later.action, FailureAction::kIgnore);
  EXPECT_THAT(later.message, HasSubstr("round 4"));
}

TEST(FaultPolicy, FailureMessageNamesNodeHostRanksCauseRestartsAndEndsWithStderr) {
  FaultPolicy p(3);
  FailureVerdict v = p.OnFailure(Report(9, 3), "gpu-host-2", 3);
  ASSERT_EQ(v.action, FailureAction::kFailJob);
  EXPECT_THAT(v.message, HasSubstr("node-7"));
  EXPECT_THAT(v.message, HasSubstr("host gpu-host-2"));
  EXPECT_THAT(v.message, HasSubstr("worker rank 5"));
  EXPECT_THAT(v.message, HasSubstr("local rank 1"));
  EXPECT_THAT(v.message, HasSubstr("exit code 3"));
  EXPECT_THAT(v.message, HasSubstr("used 3 of 3 restarts"));
  EXPECT_THAT(v.message, EndsWith("Traceback (most recent call last):\nRuntimeError: boom"));
}

TEST(FaultPolicy, CauseNamesSignal) {
  v1::FailureReport r = Report(1, 0, 9);
  EXPECT_EQ(FaultPolicy::DescribeCause(r), "killed by SIGKILL");
  r.set_cause("SIGKILL");  // the agent's classification adds nothing new
  EXPECT_EQ(FaultPolicy::DescribeCause(r), "killed by SIGKILL");
  r.set_cause("hang: no progress for 600 s");
  EXPECT_EQ(FaultPolicy::DescribeCause(r), "killed by SIGKILL (hang: no progress for 600 s)");
}

TEST(FaultPolicy, AgentClassificationReplacesPlainCauseWhenItSaysMore) {
  v1::FailureReport r = Report(1, 1);
  r.set_cause("out of GPU memory (exit code 1): torch.cuda.OutOfMemoryError: CUDA out of memory");
  EXPECT_EQ(FaultPolicy::DescribeCause(r), r.cause());
}

TEST(FaultPolicy, ReportWithoutExitStatusIsDescribedByItsCauseAlone) {
  v1::FailureReport r = Report(1, 0);
  r.set_cause("node rank 1 cannot reach the round's MASTER_ADDR host1:29500");
  EXPECT_EQ(FaultPolicy::DescribeCause(r), r.cause());
}

TEST(FaultPolicy, OutOfMemoryIsNotRetriedForever) {
  FaultPolicy p(10);
  v1::FailureReport oom = Report(1, 1);
  oom.set_kind("out-of-memory");
  oom.set_max_retries(1);
  EXPECT_EQ(p.OnFailure(oom, "h", 0).action, FailureAction::kRestart);
  // An unrelated failure in between does not reset the count.
  EXPECT_EQ(p.OnFailure(Report(2), "h", 1).action, FailureAction::kRestart);
  oom.set_round(3);
  FailureVerdict v = p.OnFailure(oom, "h", 2);
  EXPECT_EQ(v.action, FailureAction::kFailJob);
  EXPECT_THAT(v.message, HasSubstr("out-of-memory failures are retried at most 1 time(s)"));
}

TEST(FaultPolicy, EmptyStderrIsSaidSo) {
  v1::FailureReport r = Report(1);
  r.clear_stderr_tail();
  EXPECT_THAT(FaultPolicy::JobFailureMessage(r, "h", 0, 0), EndsWith("its stderr was empty"));
}


v1::FailureReport BadLoss(int64_t round, int64_t step, const char* kind = "nan") {
  v1::FailureReport r = Report(round, 0, 0);
  r.set_kind(kind);
  r.set_cause(absl::StrCat("non-finite loss (nan) at step ", step));
  r.set_health_step(step);
  r.set_max_retries(-1);
  return r;
}

TEST(FaultPolicy, BadLossRollsBackUpToMaxRollbacksThenFailsNamingRankStepAndNode) {
  health::HealthPolicy hp;
  hp.max_rollbacks = 2;
  FaultPolicy p(5, hp);
  FailureVerdict v = p.OnFailure(BadLoss(1, 17), "h7", 0);
  EXPECT_EQ(v.action, FailureAction::kRollback);
  EXPECT_THAT(v.message, HasSubstr("rollback 1 of 2"));
  EXPECT_THAT(v.message, HasSubstr("before step 17"));
  EXPECT_EQ(p.OnFailure(BadLoss(2, 30, "loss-spike"), "h7", 1).action, FailureAction::kRollback);
  EXPECT_EQ(p.rollbacks(), 2);
  FailureVerdict last = p.OnFailure(BadLoss(3, 31), "h7", 2);
  EXPECT_EQ(last.action, FailureAction::kFailJob);
  EXPECT_THAT(last.message, HasSubstr("2 of 2 rollbacks"));
  EXPECT_THAT(last.message, HasSubstr("worker rank 5"));
  EXPECT_THAT(last.message, HasSubstr("node node-7 (host h7)"));
  EXPECT_THAT(last.message, HasSubstr("at step 31"));
  EXPECT_THAT(last.message, HasSubstr("--max-rollbacks"));
}

TEST(FaultPolicy, RollbacksDoNotUseUpMaxRestarts) {
  FaultPolicy p(1);
  EXPECT_EQ(p.OnFailure(BadLoss(1, 5), "h", 0).action, FailureAction::kRollback);
  EXPECT_EQ(p.OnFailure(BadLoss(2, 9), "h", 1).action, FailureAction::kRollback);
  // Two restarts so far, both rollbacks: the one crash restart is still there.
  FailureVerdict crash = p.OnFailure(Report(3), "h", 2);
  EXPECT_EQ(crash.action, FailureAction::kRestart);
  EXPECT_THAT(crash.message, HasSubstr("restart 1 of 1"));
  EXPECT_EQ(p.OnFailure(Report(4), "h", 3).action, FailureAction::kFailJob);
}

TEST(FaultPolicy, OnNanFailAndIgnore) {
  health::HealthPolicy fail;
  fail.on_nan = health::OnNan::kFail;
  FaultPolicy pf(3, fail);
  FailureVerdict v = pf.OnFailure(BadLoss(1, 4), "h", 0);
  EXPECT_EQ(v.action, FailureAction::kFailJob);
  EXPECT_THAT(v.message, HasSubstr("--on-nan fail"));
  health::HealthPolicy ignore;
  ignore.on_nan = health::OnNan::kIgnore;
  FaultPolicy pi(3, ignore);
  EXPECT_EQ(pi.OnFailure(BadLoss(1, 4), "h", 0).action, FailureAction::kIgnore);
  // Ignoring it decided nothing: a crash of the same round still restarts.
  EXPECT_EQ(pi.OnFailure(Report(1), "h", 0).action, FailureAction::kRestart);
}

}  // namespace
}  // namespace ballast::master
