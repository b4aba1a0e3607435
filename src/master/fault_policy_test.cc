#include "master/fault_policy.h"

#include "absl/strings/match.h"
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

}  // namespace
}  // namespace ballast::master
