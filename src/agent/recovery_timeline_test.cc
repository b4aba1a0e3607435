#include "agent/recovery_timeline.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using ::testing::HasSubstr;
constexpr uint64_t kMs = 1'000'000;

TEST(RecoveryTimeline, WaitsForEveryWorkersFirstStepThenLogsTheStagesFromTheFailure) {
  RecoveryTimeline t;
  t.FailureSeen(1000 * kMs);
  t.DecisionArrived(1004 * kMs);
  t.OldWorkersStopped(1040 * kMs);
  t.WorkersStarted(1041 * kMs);
  ASSERT_TRUE(t.pending());
  // One worker stepped, the other not yet; both process groups up.
  RecoveryTimeline::Progress p = t.Track({{1.090, true}, {1.088, false}}, 1100 * kMs, 2, true, "warm (2 of 2)");
  EXPECT_TRUE(p.all_pg_up);
  EXPECT_FALSE(p.line.has_value());
  // The last init_process_group call (its imports done) comes into the line.
  p = t.Track({{1.090, true, 1.060}, {1.088, true, 1.052}}, 1104 * kMs, 2, true, "warm (2 of 2)");
  ASSERT_TRUE(p.line.has_value());
  EXPECT_EQ(*p.line,
            "recovery timeline (round 2, warm (2 of 2) start): worker failure seen 0 ms, round decision +4 ms, old "
            "workers stopped +40 ms, new workers started +41 ms, init_process_group called +60 ms, process group up "
            "+90 ms, first step +104 ms");
  ASSERT_TRUE(p.record.has_value());
  EXPECT_TRUE(p.record->failure_seen());
  EXPECT_TRUE(p.record->recovery());
  EXPECT_EQ(p.record->start(), "warm (2 of 2)");
  EXPECT_DOUBLE_EQ(p.record->first_step_ms(), 104);
  EXPECT_FALSE(t.pending());
  // Done: later polls give nothing.
  EXPECT_FALSE(t.Track({{1.090, true}}, 2000 * kMs, 2, true, "warm (2 of 2)").line.has_value());
}

TEST(RecoveryTimeline, FirstStartCountsFromTheDecisionWithoutProcessGroupTimes) {
  RecoveryTimeline t;
  t.DecisionArrived(50 * kMs);
  t.OldWorkersStopped(50 * kMs);
  t.WorkersStarted(52 * kMs);
  RecoveryTimeline::Progress p = t.Track({{-1, true}}, 2050 * kMs, 1, false, "cold");
  EXPECT_FALSE(p.all_pg_up);
  ASSERT_TRUE(p.line.has_value());
  EXPECT_EQ(*p.line, "start timeline (round 1, cold start): round decision 0 ms, old workers stopped +0 ms, new "
                     "workers started +2 ms, first step +2000 ms");
  EXPECT_EQ(p.record->pg_up_ms(), 0);  // unknown: not set
}

TEST(RecoveryTimeline, AFailureLeftFromARoundThatNeverSteppedIsReplacedByTheNextOne) {
  RecoveryTimeline t;
  t.WorkersStarted(10 * kMs);
  t.FailureSeen(20 * kMs);  // round 1 fails before its first step
  t.DecisionArrived(21 * kMs);
  t.WorkersStarted(30 * kMs);
  t.FailureSeen(40 * kMs);  // round 2 fails too: its failure counts, not round 1's
  t.FailureSeen(45 * kMs);  // a second failure of the same round does not
  t.DecisionArrived(46 * kMs);
  t.OldWorkersStopped(47 * kMs);
  t.WorkersStarted(50 * kMs);
  RecoveryTimeline::Progress p = t.Track({{0.055, true}}, 60 * kMs, 3, true, "warm (1 of 1)");
  ASSERT_TRUE(p.line.has_value());
  EXPECT_THAT(*p.line, HasSubstr("round decision +6 ms"));
  EXPECT_THAT(*p.line, HasSubstr("first step +20 ms"));
}

TEST(RecoveryTimeline, NoRunningWorkerNoTimeline) {
  RecoveryTimeline t;
  t.WorkersStarted(1);
  EXPECT_FALSE(t.Track({}, 5, 1, false, "cold").line.has_value());
  EXPECT_TRUE(t.pending());
}

}  // namespace
}  // namespace ballast::agent
