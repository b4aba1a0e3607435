#include "master/node_table.h"

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

}  // namespace
}  // namespace ballast::master
