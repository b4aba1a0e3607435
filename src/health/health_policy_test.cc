#include "health/health_policy.h"

#include <gtest/gtest.h>

namespace ballast::health {
namespace {

TEST(HealthPolicy, ParsesTheThreeModesAndRefusesOthers) {
  EXPECT_EQ(*ParseOnNan("rollback"), OnNan::kRollback);
  EXPECT_EQ(*ParseOnNan("fail"), OnNan::kFail);
  EXPECT_EQ(*ParseOnNan("ignore"), OnNan::kIgnore);
  absl::StatusOr<OnNan> bad = ParseOnNan("restart");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("rollback, fail or ignore"), std::string::npos);
}

TEST(HealthPolicy, ValidatesLimits) {
  HealthPolicy p;
  EXPECT_TRUE(Validate(p).ok());
  p.max_rollbacks = -1;
  EXPECT_NE(Validate(p).message().find("--max-rollbacks"), std::string::npos);
  p.max_rollbacks = 0;
  p.loss_spike_z = 0.5;
  EXPECT_NE(Validate(p).message().find("--loss-spike"), std::string::npos);
  p.loss_spike_z = 6;
  EXPECT_TRUE(Validate(p).ok());
  EXPECT_EQ(Describe(p), "--on-nan rollback --max-rollbacks 0 --loss-spike 6 --replica-check-every 100");
  p.replica_check_every = -1;
  EXPECT_NE(Validate(p).message().find("--replica-check-every"), std::string::npos);
}

TEST(HealthPolicy, SampleRangesRoundTripAndAccumulateOnce) {
  absl::StatusOr<SampleRange> r = ParseSampleRange("2:96:128");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->epoch, 2);
  EXPECT_EQ(r->begin, 96);
  EXPECT_EQ(r->end, 128);
  EXPECT_EQ(FormatSampleRange(*r), "2:96:128");
  for (const char* bad : {"", "1:2", "1:5:5", "1:6:5", "-1:0:4", "a:0:4", "1:0:4:5"}) {
    EXPECT_FALSE(ParseSampleRange(bad).ok()) << bad;
  }
  std::string list = AddSampleRange("", *r);
  EXPECT_EQ(list, "2:96:128");
  list = AddSampleRange(list, SampleRange{0, 8, 16});
  EXPECT_EQ(list, "2:96:128,0:8:16");
  EXPECT_EQ(AddSampleRange(list, *r), list);
}

}  // namespace
}  // namespace ballast::health
