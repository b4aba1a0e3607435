#include "master/straggler.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::map<NodeId, double> T(std::initializer_list<std::pair<const char*, double>> times) {
  std::map<NodeId, double> out;
  for (const auto& [id, t] : times) out[NodeId(id)] = t;
  return out;
}

TEST(MedianStepTime, OddEvenAndUnknownValues) {
  EXPECT_DOUBLE_EQ(MedianStepTime(T({{"a", 1.0}, {"b", 3.0}, {"c", 2.0}})), 2.0);
  EXPECT_DOUBLE_EQ(MedianStepTime(T({{"a", 1.0}, {"b", 3.0}})), 2.0);
  EXPECT_DOUBLE_EQ(MedianStepTime(T({{"a", 0.0}, {"b", 3.0}})), 3.0);  // 0 = unknown, left out
  EXPECT_DOUBLE_EQ(MedianStepTime(T({})), 0.0);
}

TEST(Median, MatchesASortedMiddleForOddAndEvenCounts) {
  EXPECT_DOUBLE_EQ(Median({}), 0.0);
  EXPECT_DOUBLE_EQ(Median({5.0}), 5.0);
  EXPECT_DOUBLE_EQ(Median({4.0, 1.0, 3.0, 2.0}), 2.5);
  EXPECT_DOUBLE_EQ(Median({9.0, 1.0, 9.0, 1.0, 5.0}), 5.0);
  EXPECT_DOUBLE_EQ(Median({2.0, 2.0, 7.0, 1.0, 8.0, 3.0}), 2.5);
}

TEST(FindStragglers, FlagsNodesSlowerThanFactorTimesMedian) {
  std::map<NodeId, double> t = T({{"a", 1.0}, {"b", 1.1}, {"c", 0.9}, {"d", 2.5}});
  // median 1.05, limit 2.1
  EXPECT_THAT(FindStragglers(t, 2.0), ElementsAre(NodeId("d")));
  EXPECT_THAT(FindStragglers(t, 3.0), IsEmpty());
}

TEST(FindStragglers, NeedsTwoReportingNodes) {
  EXPECT_THAT(FindStragglers(T({{"a", 5.0}}), 2.0), IsEmpty());
  EXPECT_THAT(FindStragglers(T({{"a", 5.0}, {"b", 0.0}}), 2.0), IsEmpty());
  EXPECT_THAT(FindStragglers(T({{"a", 5.0}, {"b", 1.0}}), 2.0), IsEmpty());  // median 3, limit 6
  EXPECT_THAT(FindStragglers(T({{"a", 9.0}, {"b", 1.0}, {"c", 1.0}}), 2.0), ElementsAre(NodeId("a")));
}

TEST(FindStragglers, OffWithNonPositiveFactor) {
  EXPECT_THAT(FindStragglers(T({{"a", 9.0}, {"b", 1.0}, {"c", 1.0}}), 0.0), IsEmpty());
}

}  // namespace
}  // namespace ballast::master
