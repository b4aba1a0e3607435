#include "master/precheck_coordinator.h"

#include <set>

#include "gtest/gtest.h"

namespace ballast::master {
namespace {

std::vector<PrecheckNode> Nodes(int n) {
  std::vector<PrecheckNode> out;
  for (int i = 0; i < n; ++i) out.push_back({NodeId("n" + std::to_string(i)), 1});
  return out;
}

// Answers every decision: nodes in `bad` fail, the rest pass in 1 s.
void Answer(PrecheckCoordinator& c, const CheckDecisions& ds, const std::set<NodeId>& bad) {
  for (const auto& [id, rc] : ds) {
    v1::CheckResult r;
    r.set_node_id(id.str());
    r.set_check_id(rc.check_id());
    r.set_ok(bad.count(id) == 0);
    r.set_time_s(1.0);
    if (!r.ok()) r.set_error("exit code 1");
    ASSERT_TRUE(c.Record(r).ok());
  }
}

TEST(PrecheckCoordinator, PairTimesBecomeReferenceTimes) {
  PrecheckCoordinator c;
  CheckDecisions d = c.Begin(Nodes(2), 0);
  Answer(c, d, {});
  auto s = c.Advance(0);
  ASSERT_TRUE(s.outcome.has_value());
  EXPECT_EQ(s.outcome->best_times.size(), 2u);
  EXPECT_DOUBLE_EQ(s.outcome->best_times.at("n1"_node), 1.0);
}

TEST(PrecheckCoordinator, FourNodesOneFailingIsFoundInRoundTwo) {
  PrecheckCoordinator c;
  CheckDecisions d1 = c.Begin(Nodes(4), 0);
  ASSERT_EQ(d1.size(), 4u);
  EXPECT_EQ(d1[1].second.group_id(), 0);
  EXPECT_EQ(d1[1].second.group_rank(), 1);
  EXPECT_EQ(d1[1].second.world_size(), 2);
  EXPECT_FALSE(c.RoundComplete(0));
  Answer(c, d1, {"n1"_node});
  ASSERT_TRUE(c.RoundComplete(0));
  auto s1 = c.Advance(0);
  ASSERT_FALSE(s1.outcome.has_value());
  ASSERT_EQ(s1.next.size(), 4u);
  EXPECT_EQ(c.check_round(), 2);
  Answer(c, s1.next, {"n1"_node});
  auto s2 = c.Advance(0);
  ASSERT_TRUE(s2.outcome.has_value());
  EXPECT_EQ(s2.outcome->faulty, std::vector<NodeId>{"n1"_node});
  EXPECT_FALSE(c.active());
}

TEST(PrecheckCoordinator, FiveNodesSuspectRoundClearsThePartner) {
  PrecheckCoordinator c;
  CheckDecisions d = c.Begin(Nodes(5), 0);
  for (int round = 1; round <= 3; ++round) {
    Answer(c, d, {"n3"_node});
    auto s = c.Advance(0);
    if (s.outcome.has_value()) {
      EXPECT_EQ(round, 3);
      EXPECT_EQ(s.outcome->faulty, std::vector<NodeId>{"n3"_node});
      return;
    }
    d = s.next;
  }
  FAIL() << "no verdict after 3 rounds";
}

TEST(PrecheckCoordinator, ThreeNodesWithAFailureAllFail) {
  PrecheckCoordinator c;
  Answer(c, c.Begin(Nodes(3), 0), {"n2"_node});
  auto s = c.Advance(0);
  ASSERT_TRUE(s.outcome.has_value());
  EXPECT_TRUE(s.outcome->verdict.all_failed);
  EXPECT_NE(s.outcome->verdict.message.find("cannot be localized"), std::string::npos);
}

TEST(PrecheckCoordinator, SilentNodeFailsAtTheDeadlineAndStaleResultsAreAborted) {
  PrecheckOptions o;
  o.timeout_s = 10;
  o.grace_s = 5;
  PrecheckCoordinator c(o);
  CheckDecisions d = c.Begin(Nodes(2), 0);
  v1::CheckResult r;
  r.set_node_id("n0");
  r.set_check_id(d[0].second.check_id() + 7);
  EXPECT_EQ(c.Record(r).code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(c.RoundComplete(14.9));
  EXPECT_TRUE(c.RoundComplete(15.0));
  auto s = c.Advance(15.0);
  ASSERT_TRUE(s.outcome.has_value());
  EXPECT_TRUE(s.outcome->verdict.all_failed);
  EXPECT_NE(s.outcome->errors.at("n1"_node).find("no result"), std::string::npos);
}

TEST(PrecheckCoordinator, OneJoinerIsCheckedAloneAndAFailureIsItsOwn) {
  PrecheckCoordinator c;
  CheckDecisions d = c.Begin(Nodes(1), 0, /*joiners=*/true, {1.0, 1.0});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].second.world_size(), 1);
  Answer(c, d, {"n0"_node});
  auto s = c.Advance(0);
  ASSERT_TRUE(s.outcome.has_value());
  EXPECT_FALSE(s.outcome->verdict.all_failed);
  EXPECT_EQ(s.outcome->faulty, std::vector<NodeId>{"n0"_node});
  EXPECT_TRUE(s.outcome->joiners);
}

TEST(PrecheckCoordinator, TwoJoinersFailedPairIsSplitByCheckingAlone) {
  PrecheckCoordinator c;
  CheckDecisions d1 = c.Begin(Nodes(2), 0, /*joiners=*/true, {});
  Answer(c, d1, {"n1"_node});
  auto s1 = c.Advance(0);
  ASSERT_FALSE(s1.outcome.has_value());
  ASSERT_EQ(s1.next.size(), 2u);  // both failed as a pair; each runs alone
  for (const auto& [id, rc] : s1.next) EXPECT_EQ(rc.world_size(), 1) << id;
  Answer(c, s1.next, {"n1"_node});
  auto s2 = c.Advance(0);
  ASSERT_TRUE(s2.outcome.has_value());
  EXPECT_EQ(s2.outcome->faulty, std::vector<NodeId>{"n1"_node});
  EXPECT_NE(s2.outcome->verdict.message.find("failed when checked alone"), std::string::npos)
      << s2.outcome->verdict.message;
}

TEST(PrecheckCoordinator, JoinerPassingIsTimedAgainstTheMembers) {
  PrecheckCoordinator c;
  CheckDecisions d = c.Begin(Nodes(1), 0, /*joiners=*/true, {0.2, 0.2, 0.2});
  Answer(c, d, {});  // 1.0 s against members' 0.2 s
  auto s = c.Advance(0);
  ASSERT_TRUE(s.outcome.has_value());
  EXPECT_TRUE(s.outcome->faulty.empty());
  EXPECT_EQ(s.outcome->stragglers, std::vector<NodeId>{"n0"_node});
  EXPECT_TRUE(s.outcome->best_times.empty());  // timed alone: no reference for later checks
  EXPECT_NE(s.outcome->verdict.message.find("1 joining node(s)"), std::string::npos) << s.outcome->verdict.message;
}

}  // namespace
}  // namespace ballast::master
