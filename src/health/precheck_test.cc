#include "health/precheck.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::health {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(PrecheckGroups, FourNodesInOrderThenFastestWithSlowest) {
  EXPECT_EQ(GroupInOrder(4), (Groups{{0, 1}, {2, 3}}));
  // Times: node 2 fastest, then 0, 3, 1.
  EXPECT_EQ(GroupFastestWithSlowest({2.0, 4.0, 1.0, 3.0}), (Groups{{2, 1}, {0, 3}}));
}

TEST(PrecheckGroups, FiveNodesOddJoinsLastGroup) {
  EXPECT_EQ(GroupInOrder(5), (Groups{{0, 1}, {2, 3, 4}}));
  // Sorted: 4,3,2,1,0 -> {4,0}, {3,1} and the middle (2) joins the last group.
  EXPECT_EQ(GroupFastestWithSlowest({5, 4, 3, 2, 1}), (Groups{{4, 0}, {3, 1, 2}}));
}

TEST(PrecheckGroups, FailedNodesCountAsSlowestTiesByIndex) {
  EXPECT_EQ(GroupFastestWithSlowest({kInf, kInf, 1.0, 2.0}), (Groups{{2, 1}, {3, 0}}));
}

std::vector<NodeResult> Results(const std::vector<double>& times) {
  std::vector<NodeResult> r;
  for (double t : times) r.push_back(std::isinf(t) ? NodeResult{} : NodeResult{true, t});
  return r;
}

// Runs both rounds for n nodes where `bad` fails every check it is in.
Verdict Simulate(int n, int bad, std::vector<double> times) {
  auto raw = Results(times);
  raw[bad] = NodeResult{};
  auto r1 = ApplyGroupFailure(GroupInOrder(n), raw);
  std::vector<double> t1;
  for (auto& r : r1) t1.push_back(r.time_s);
  auto r2 = ApplyGroupFailure(GroupFastestWithSlowest(t1), raw);
  Verdict v = Judge(r1, r2);
  if (v.suspects.empty()) return v;
  std::vector<double> best;
  for (size_t i = 0; i < r1.size(); ++i) best.push_back(std::min(r1[i].time_s, r2[i].time_s));
  Groups g3 = GroupSuspectsWithHealthy(v, best);
  return RefineWithSuspectRound(v, g3, ApplyGroupFailure(g3, raw));
}

TEST(PrecheckJudge, FourNodesIsolateTheFaultyOne) {
  for (int bad = 0; bad < 4; ++bad) {
    Verdict v = Simulate(4, bad, {1, 1.1, 1.2, 1.3});
    EXPECT_THAT(v.faulty, ElementsAre(bad)) << "bad " << bad;
    EXPECT_FALSE(v.all_failed);
  }
}

TEST(PrecheckJudge, FiveNodesIsolateTheFaultyOne) {
  for (int bad = 0; bad < 5; ++bad) {
    Verdict v = Simulate(5, bad, {1, 1.1, 1.2, 1.3, 1.4});
    EXPECT_THAT(v.faulty, ElementsAre(bad)) << "bad " << bad;
  }
}

TEST(PrecheckJudge, FiveNodesBadInTheTripleNeedsASuspectRound) {
  auto raw = Results({1, 1.1, 1.2, 1.3, 1.4});
  raw[3] = NodeResult{};
  auto r1 = ApplyGroupFailure(GroupInOrder(5), raw);
  std::vector<double> t1;
  for (auto& r : r1) t1.push_back(r.time_s);
  auto r2 = ApplyGroupFailure(GroupFastestWithSlowest(t1), raw);
  Verdict v = Judge(r1, r2);
  EXPECT_THAT(v.suspects, ElementsAre(2, 3));  // failed together twice
  Groups g3 = GroupSuspectsWithHealthy(v, {1, 1.1, kInf, kInf, kInf});
  EXPECT_EQ(g3, (Groups{{0, 2}, {1, 3}}));
  Verdict final_v = RefineWithSuspectRound(v, g3, ApplyGroupFailure(g3, raw));
  EXPECT_THAT(final_v.faulty, ElementsAre(3));
  EXPECT_TRUE(final_v.suspects.empty());
}

TEST(PrecheckJudge, ThreeNodesWithAFailureAllFailWithReason) {
  Verdict v = Simulate(3, 1, {1, 1, 1});
  EXPECT_TRUE(v.all_failed);
  EXPECT_THAT(v.faulty, ElementsAre(0, 1, 2));
  EXPECT_THAT(v.message, HasSubstr("cannot be localized"));
}

TEST(PrecheckJudge, StragglerAboveTwiceTheMedian) {
  auto r1 = Results({1.0, 1.1, 3.5, 0.9});
  Verdict v = Judge(r1, {});
  EXPECT_TRUE(v.faulty.empty());
  EXPECT_THAT(v.stragglers, ElementsAre(2));
  EXPECT_THAT(v.message, HasSubstr("straggler"));
}

TEST(PrecheckJudge, AllPass) {
  Verdict v = Judge(Results({1.0, 1.1, 1.2, 0.9}), {});
  EXPECT_TRUE(v.faulty.empty());
  EXPECT_TRUE(v.stragglers.empty());
  EXPECT_THAT(v.message, HasSubstr("all 4 nodes passed"));
}

TEST(PrecheckJudge, ReferenceTimesSetTheMedianForJoiners) {
  // One joiner alone: 2.5 s is no straggler on its own, but the members
  // checked earlier took about 1 s.
  EXPECT_TRUE(Judge(Results({2.5}), {}, 2.0).stragglers.empty());
  Verdict v = Judge(Results({2.5}), {}, 2.0, {1.0, 1.1, 0.9});
  EXPECT_THAT(v.stragglers, ElementsAre(0));
}

TEST(PrecheckJudge, JoinersCheckedAloneFindTheOneThatFailsAlone) {
  auto raw = Results({1.0, 1.1});
  raw[1] = NodeResult{};
  auto r1 = ApplyGroupFailure(GroupInOrder(2), raw);  // both failed together
  EXPECT_EQ(GroupAlone({0, 1}), (Groups{{0}, {1}}));
  auto alone = ApplyGroupFailure(GroupAlone({0, 1}), raw);
  Verdict v = JudgeWithAloneRound(r1, alone, 2.0, {1.0});
  EXPECT_THAT(v.faulty, ElementsAre(1));
  EXPECT_FALSE(v.all_failed);
}

TEST(PrecheckJudge, JoinersFailingOnlyTogetherAreAllFaulty) {
  std::vector<NodeResult> r1(2);                   // the pair failed
  std::vector<NodeResult> alone = Results({1.0, 1.0});  // each passed alone
  Verdict v = JudgeWithAloneRound(r1, alone, 2.0, {});
  EXPECT_THAT(v.faulty, ElementsAre(0, 1));
  EXPECT_THAT(v.message, HasSubstr("network path between them"));
}

TEST(PrecheckJudge, EveryNodeFailingFailsTheJobInsteadOfExcludingAll) {
  std::vector<NodeResult> r1(4), r2(4);  // all failed twice
  Verdict v = Judge(r1, r2);
  EXPECT_TRUE(v.all_failed);
  EXPECT_THAT(v.faulty, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(v.message, HasSubstr("not in one node"));
}

}  // namespace
}  // namespace ballast::health
