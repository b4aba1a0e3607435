#include "master/rendezvous.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using ::testing::ElementsAre;

NodeSpec Node(const std::string& id, int hint = -1, int lws = 1) {
  return NodeSpec{NodeId(id), hint, lws, id + ".host"};
}

std::vector<std::string> MemberIds(const World& w) {
  std::vector<std::string> ids;
  for (const auto& m : w.members) ids.push_back(m.node_id.str());
  return ids;
}

std::vector<std::string> Ids(const std::vector<NodeId>& ids) {
  std::vector<std::string> out;
  for (const auto& id : ids) out.push_back(id.str());
  return out;
}

TEST(Rendezvous, CompletesAtMaxNodesImmediately) {
  Rendezvous r({/*min=*/2, /*max=*/3, /*unit=*/1, /*last_call_s=*/10});
  r.Join(Node("a"), 0);
  r.Join(Node("b"), 0);
  EXPECT_FALSE(r.Ready(0));
  r.Join(Node("c"), 0);
  EXPECT_TRUE(r.Ready(0));
  auto w = r.Form();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->num_nodes(), 3);
  EXPECT_TRUE(w->surplus.empty());
}

TEST(Rendezvous, CompletesAtMinNodesAfterLastCall) {
  Rendezvous r({2, 4, 1, 5.0});
  r.Join(Node("a"), 100);
  EXPECT_FALSE(r.Ready(200));  // below min, however long we wait
  EXPECT_FALSE(r.SecondsUntilReady(200).has_value());
  r.Join(Node("b"), 201);
  EXPECT_FALSE(r.Ready(201));
  EXPECT_FALSE(r.Ready(205.9));
  EXPECT_DOUBLE_EQ(*r.SecondsUntilReady(203), 3.0);
  EXPECT_TRUE(r.Ready(206));
  EXPECT_EQ(r.Form()->num_nodes(), 2);
}

TEST(Rendezvous, NewJoinRestartsLastCall) {
  Rendezvous r({2, 4, 1, 5.0});
  r.Join(Node("a"), 0);
  r.Join(Node("b"), 0);
  r.Join(Node("c"), 4);
  EXPECT_FALSE(r.Ready(6));
  EXPECT_TRUE(r.Ready(9));
  // A re-join of a known node does not restart the timer.
  r.Join(Node("a"), 8);
  EXPECT_TRUE(r.Ready(9));
}

TEST(Rendezvous, TenNodesMinEightMaxTwelveUnitFourFormsEightWithTwoWaiting) {
  Rendezvous r({8, 12, 4, 1.0});
  for (int i = 0; i < 10; ++i) r.Join(Node("n" + std::to_string(i)), 0);
  EXPECT_EQ(r.UsableNodes(), 8);
  EXPECT_FALSE(r.Ready(0.5));
  ASSERT_TRUE(r.Ready(1.0));
  auto w = r.Form();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->num_nodes(), 8);
  EXPECT_THAT(Ids(w->surplus), ElementsAre("n8", "n9"));
  EXPECT_EQ(w->members[7].node_id, "n7"_node);
}

TEST(Rendezvous, RoundingBelowMinKeepsWaiting) {
  Rendezvous r({3, 8, 4, 0.0});
  for (int i = 0; i < 3; ++i) r.Join(Node("n" + std::to_string(i)), 0);
  EXPECT_EQ(r.UsableNodes(), 0);  // 3 rounds down to 0 < min 3
  EXPECT_FALSE(r.Ready(100));
  EXPECT_FALSE(r.Form().has_value());
  r.Join(Node("n3"), 100);
  EXPECT_TRUE(r.Ready(100));
  EXPECT_EQ(r.Form()->num_nodes(), 4);
}

TEST(Rendezvous, CapsAtMaxWithSurplus) {
  Rendezvous r({1, 2, 1, 0.0});
  r.Join(Node("a"), 0);
  r.Join(Node("b"), 0);
  r.Join(Node("c"), 0);
  EXPECT_TRUE(r.Ready(0));
  auto w = r.Form();
  EXPECT_THAT(MemberIds(*w), ElementsAre("a", "b"));
  EXPECT_THAT(Ids(w->surplus), ElementsAre("c"));
}

TEST(Rendezvous, RanksHonourHintsThenJoinOrderWithPrefixSumOffsets) {
  Rendezvous r({4, 4, 1, 0.0});
  r.Join(Node("x", -1, 2), 0);  // no hint, joined first
  r.Join(Node("y", 1, 3), 0);
  r.Join(Node("z", -1, 4), 0);  // no hint, joined third
  r.Join(Node("w", 0, 1), 0);
  auto w = r.Form();
  ASSERT_TRUE(w.has_value());
  EXPECT_THAT(MemberIds(*w), ElementsAre("w", "y", "x", "z"));
  std::vector<int> ranks, offsets;
  for (const auto& m : w->members) {
    ranks.push_back(m.group_rank);
    offsets.push_back(m.rank_offset);
  }
  EXPECT_THAT(ranks, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(offsets, ElementsAre(0, 1, 4, 6));
  EXPECT_EQ(w->world_size, 10);
  EXPECT_EQ(w->members[1].host, "y.host");
}

TEST(Rendezvous, EqualHintsTieByJoinOrder) {
  Rendezvous r({3, 3, 1, 0.0});
  r.Join(Node("b", 5), 0);
  r.Join(Node("a", 5), 0);
  r.Join(Node("c", 2), 0);
  EXPECT_THAT(MemberIds(*r.Form()), ElementsAre("c", "b", "a"));
}

TEST(Rendezvous, RanksAreDeterministicAcrossIdenticalRuns) {
  auto run = [] {
    Rendezvous r({3, 3, 1, 0.0});
    r.Join(Node("q", -1, 2), 0);
    r.Join(Node("p", 3, 1), 0);
    r.Join(Node("o", -1, 3), 0);
    return MemberIds(*r.Form());
  };
  EXPECT_EQ(run(), run());
}

TEST(Rendezvous, SurplusChoosesFirstInRankOrder) {
  Rendezvous r({1, 2, 1, 0.0});
  r.Join(Node("a"), 0);
  r.Join(Node("b"), 0);
  r.Join(Node("c", 0), 0);  // a hint beats join order
  auto w = r.Form();
  EXPECT_THAT(MemberIds(*w), ElementsAre("c", "a"));
  EXPECT_THAT(Ids(w->surplus), ElementsAre("b"));
}

TEST(Rendezvous, RejoinKeepsPlaceAndUpdatesInfo) {
  Rendezvous r({2, 2, 1, 0.0});
  EXPECT_TRUE(r.Join(Node("a"), 0));
  EXPECT_TRUE(r.Join(Node("b"), 0));
  NodeSpec a2 = Node("a");
  a2.host = "new.host";
  EXPECT_FALSE(r.Join(a2, 1));
  auto w = r.Form();
  EXPECT_THAT(MemberIds(*w), ElementsAre("a", "b"));
  EXPECT_EQ(w->members[0].host, "new.host");
}

TEST(Rendezvous, RemoveDropsParticipant) {
  Rendezvous r({2, 3, 1, 0.0});
  r.Join(Node("a"), 0);
  r.Join(Node("b"), 0);
  EXPECT_TRUE(r.Remove("a"_node));
  EXPECT_FALSE(r.Remove("a"_node));
  EXPECT_FALSE(r.Contains("a"_node));
  EXPECT_EQ(r.UsableNodes(), 0);
}

TEST(Rendezvous, ANodeRemovedAndJoiningAgainIsLastInJoinOrder) {
  Rendezvous r({1, 3, 1, 0.0});
  EXPECT_TRUE(r.Join(Node("a"), 0));
  EXPECT_TRUE(r.Join(Node("b"), 0));
  EXPECT_TRUE(r.Remove("a"_node));
  EXPECT_FALSE(r.Contains("a"_node));
  EXPECT_TRUE(r.Join(Node("a"), 1));  // new again: the last call restarts
  EXPECT_TRUE(r.Contains("a"_node));
  EXPECT_FALSE(r.Join(Node("a"), 2));
  EXPECT_EQ(r.last_join_time(), 1);
  EXPECT_THAT(r.JoinOrder(), ElementsAre("b"_node, "a"_node));
  EXPECT_EQ(r.size(), 2);
}

TEST(Rendezvous, FormFromRestrictsMembersToCandidates) {
  Rendezvous r({2, 4, 1, 0.0});
  r.Join(Node("a"), 0);
  r.Join(Node("b"), 0);
  r.Join(Node("c", 0), 0);
  auto w = r.FormFrom({"a"_node, "b"_node});
  ASSERT_TRUE(w.has_value());
  EXPECT_THAT(MemberIds(*w), ElementsAre("a", "b"));
  EXPECT_THAT(Ids(w->surplus), ElementsAre("c"));
  EXPECT_FALSE(r.FormFrom({"a"_node}).has_value());  // below min
}

// World::Find answers from an index: it must follow members as the journal
// restore and Form build them (push_back), a copy, a move and a whole new list.
TEST(World, FindFollowsMembersThroughGrowthCopyAndReplacement) {
  World w;
  EXPECT_EQ(w.Find("a"_node), nullptr);
  w.members.push_back(MemberAssignment{"a"_node, 0, 2, 0, "a.host"});
  ASSERT_NE(w.Find("a"_node), nullptr);
  EXPECT_EQ(w.Find("a"_node)->group_rank, 0);
  for (int i = 1; i < 100; ++i) w.members.push_back(MemberAssignment{NodeId("n" + std::to_string(i)), i, 2, 2 * i, ""});
  ASSERT_NE(w.Find("n57"_node), nullptr);
  EXPECT_EQ(w.Find("n57"_node), &w.members[57]);  // the element itself, after the vector reallocated
  EXPECT_EQ(w.Find("n100"_node), nullptr);

  World copy = w;  // its own index over its own members
  EXPECT_EQ(copy.Find("n57"_node), &copy.members[57]);
  World moved = std::move(copy);
  EXPECT_EQ(moved.Find("n99"_node), &moved.members[99]);
  World assigned;  // indexed over other members first, then assigned over
  assigned.members = {MemberAssignment{"n57"_node, 0, 1, 0, ""}};
  ASSERT_EQ(assigned.Find("n57"_node), &assigned.members[0]);
  assigned = moved;
  EXPECT_EQ(assigned.Find("n57"_node), &assigned.members[57]);
  EXPECT_EQ(assigned.Find("n99"_node), &assigned.members[99]);

  w.members = {MemberAssignment{"z"_node, 0, 1, 0, ""}, MemberAssignment{"a"_node, 1, 1, 1, ""}};
  EXPECT_EQ(w.Find("n57"_node), nullptr);
  ASSERT_NE(w.Find("a"_node), nullptr);
  EXPECT_EQ(w.Find("a"_node)->group_rank, 1);
  w = World{};
  EXPECT_EQ(w.Find("a"_node), nullptr);
}

TEST(World, FormedWorldFindsEveryMemberAndNoSurplus) {
  Rendezvous r({/*min=*/1, /*max=*/3, /*unit=*/1, /*last_call_s=*/0});
  for (const char* id : {"a", "b", "c", "d"}) r.Join(Node(id), 0);
  auto w = r.Form();
  ASSERT_TRUE(w.has_value());
  for (const auto& m : w->members) EXPECT_EQ(w->Find(m.node_id), &m);
  ASSERT_EQ(w->surplus.size(), 1u);
  EXPECT_EQ(w->Find(w->surplus[0]), nullptr);
}

}  // namespace
}  // namespace ballast::master
