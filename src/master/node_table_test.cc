#include "master/node_table.h"

#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

NodeSpec Node(const std::string& id) { return NodeSpec{NodeId(id), -1, 2, id + ".host"}; }

TEST(NodeTable, SilentNodePastTimeoutIsReportedDead) {
  FakeClock clock;
  NodeTable t(&clock, 5.0);
  bool added = false;
  t.Upsert(Node("a"), 11, &added);
  EXPECT_TRUE(added);
  clock.Advance(5.0);
  EXPECT_THAT(t.SilentNodes(), IsEmpty());  // exactly at the timeout: still alive
  clock.Advance(0.1);
  EXPECT_THAT(t.ExpireSilent(), ElementsAre("a"_node));
  EXPECT_FALSE(t.IsAlive("a"_node));
  ASSERT_EQ(t.gone().size(), 1u);
  EXPECT_EQ(t.gone()[0].state, NodeState::kDead);
  EXPECT_EQ(t.gone()[0].gone_reason, "heartbeat timeout");
  EXPECT_EQ(t.Heartbeat("a"_node).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.Heartbeat("a"_node).message(), "unknown node a: join again");
}

TEST(NodeTable, HeartbeatInTimeKeepsNodeAlive) {
  FakeClock clock;
  NodeTable t(&clock, 5.0);
  t.Upsert(Node("a"), 1);
  t.Upsert(Node("b"), 2);
  for (int i = 0; i < 10; ++i) {
    clock.Advance(4.0);
    ASSERT_TRUE(t.Heartbeat("a"_node).ok());
  }
  EXPECT_THAT(t.ExpireSilent(), ElementsAre("b"_node));
  EXPECT_TRUE(t.IsAlive("a"_node));
}

TEST(NodeTable, UnknownNodeHeartbeatIsNotFound) {
  FakeClock clock;
  NodeTable t(&clock, 5.0);
  EXPECT_EQ(t.Heartbeat("ghost"_node).code(), absl::StatusCode::kNotFound);
}

TEST(NodeTable, UpsertRefreshesKnownNodeAndKeepsState) {
  FakeClock clock;
  NodeTable t(&clock, 5.0);
  t.Upsert(Node("a"), 1).state = NodeState::kTraining;
  clock.Advance(4.0);
  bool added = true;
  NodeRecord& rec = t.Upsert(Node("a"), 1, &added);
  EXPECT_FALSE(added);
  EXPECT_EQ(rec.state, NodeState::kTraining);
  EXPECT_DOUBLE_EQ(rec.last_heartbeat, clock.Now());
}

TEST(NodeTable, LeftNodeIsRememberedAndRejoinRevivesIt) {
  FakeClock clock;
  NodeTable t(&clock, 5.0);
  t.Upsert(Node("a"), 1);
  EXPECT_TRUE(t.Remove("a"_node, NodeState::kLeft, "left: done"));
  EXPECT_FALSE(t.Remove("a"_node, NodeState::kLeft, "again"));
  ASSERT_EQ(t.gone().size(), 1u);
  EXPECT_EQ(NodeStateName(t.gone()[0].state), "left");
  bool added = false;
  EXPECT_EQ(t.Upsert(Node("a"), 1, &added).state, NodeState::kWaiting);
  EXPECT_TRUE(added);
  EXPECT_THAT(t.gone(), IsEmpty());
}

// Find goes through a hash index beside the ordered table: it must follow
// every join, removal and re-join.
TEST(NodeTable, FindFollowsJoinsRemovalsAndRejoins) {
  FakeClock clock;
  NodeTable t(&clock, 5.0);
  const uint64_t v0 = t.version();
  t.Upsert(Node("a"), 1);
  t.Upsert(Node("b"), 2);
  EXPECT_EQ(t.version(), v0 + 2);
  ASSERT_NE(t.Find("a"_node), nullptr);
  EXPECT_EQ(t.Find("b"_node)->pid, 2);
  t.Upsert(Node("b"), 3);  // a refresh: the same record, no new version
  EXPECT_EQ(t.Find("b"_node)->pid, 3);
  EXPECT_EQ(t.version(), v0 + 2);
  ASSERT_TRUE(t.Remove("a"_node, NodeState::kDead, "heartbeat timeout"));
  EXPECT_EQ(t.version(), v0 + 3);
  EXPECT_EQ(t.Find("a"_node), nullptr);
  EXPECT_FALSE(t.Heartbeat("a"_node).ok());
  EXPECT_TRUE(t.Heartbeat("b"_node).ok());
  t.Upsert(Node("a"), 4);
  ASSERT_NE(t.Find("a"_node), nullptr);
  EXPECT_EQ(t.Find("a"_node)->pid, 4);
  EXPECT_EQ(&t.alive().at("a"_node), t.Find("a"_node));
  EXPECT_EQ(t.alive().size(), 2u);
}

// What SilentNodes must answer: every alive node looked at.
std::vector<NodeId> SilentByFullPass(const NodeTable& t, const FakeClock& clock, double timeout_s) {
  std::vector<NodeId> out;
  for (const auto& [id, rec] : t.alive()) {
    if (clock.Now() - rec.last_heartbeat > timeout_s) out.push_back(id);
  }
  return out;
}

// SilentNodes reads the oldest heartbeats only (the nodes in heartbeat
// order): the order must follow joins, heartbeats, removals and a clock that
// steps back.
TEST(NodeTable, SilentNodesMatchesAFullPassAsHeartbeatsMove) {
  FakeClock clock(100.0);
  NodeTable t(&clock, 5.0);
  auto full_pass = [&] { return SilentByFullPass(t, clock, 5.0); };
  for (int i = 0; i < 8; ++i) t.Upsert(Node("n" + std::to_string(i)), i);
  for (int step = 0; step < 60; ++step) {
    clock.Advance(step % 7 == 0 ? 6.0 : 1.0);
    // Every node but n<step % 8> heartbeats; n0 never after its join.
    for (int i = 1; i < 8; ++i) {
      if (i != step % 8) (void)t.Heartbeat(NodeId("n" + std::to_string(i)));
    }
    ASSERT_EQ(t.SilentNodes(), full_pass()) << "step " << step;
    if (step == 30) clock.Set(90.0);  // a clock stepping back: later heartbeats are older
    if (step == 40) t.Upsert(Node("late"), 99);
  }
  EXPECT_THAT(t.SilentNodes(), ElementsAre("late"_node, "n0"_node));  // neither heartbeat
  EXPECT_THAT(t.ExpireSilent(), ElementsAre("late"_node, "n0"_node));
  EXPECT_THAT(t.SilentNodes(), IsEmpty());
  clock.Advance(5.1);
  EXPECT_EQ(t.SilentNodes().size(), t.alive().size());  // nobody heartbeat since
}

// The heartbeat order under random joins, heartbeats (some at a future
// time, as a master resuming from its journal gives), removals, re-joins and a
// clock that moves both ways: SilentNodes is always the full pass's answer.
TEST(NodeTable, SilentNodesMatchesAFullPassUnderRandomChanges) {
  FakeClock clock(1000.0);
  NodeTable t(&clock, 5.0);
  auto full_pass = [&] { return SilentByFullPass(t, clock, 5.0); };
  std::mt19937 rng(7);
  auto node = [&] { return "n" + std::to_string(rng() % 40); };
  for (int step = 0; step < 5000; ++step) {
    switch (rng() % 10) {
      case 0:
        t.Upsert(Node(node()), step);
        break;
      case 1:
        (void)t.Remove(NodeId(node()), NodeState::kLeft, "left");
        break;
      case 2:
        (void)t.Heartbeat(NodeId(node()), clock.Now() + static_cast<double>(rng() % 8));
        break;
      case 3:
        clock.Advance(-static_cast<double>(rng() % 3));  // a clock stepping back
        break;
      case 4:
      case 5:
        clock.Advance(0.5 * static_cast<double>(rng() % 6));
        break;
      case 6:
        if (rng() % 4 == 0) (void)t.ExpireSilent();
        break;
      default:
        (void)t.Heartbeat(NodeId(node()));
        break;
    }
    ASSERT_EQ(t.SilentNodes(), full_pass()) << "step " << step;
  }
}

}  // namespace
}  // namespace ballast::master
