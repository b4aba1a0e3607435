#include "master/status_view.h"

#include "common/replica_record.h"
#include "gtest/gtest.h"

namespace ballast::master::status_view {
namespace {

TEST(StatusView, NodeStateTextPrefersExcludedThenCheckingThenSpare) {
  EXPECT_EQ(NodeStateText(master::NodeState::kWaiting, true, true, true), "excluded");
  EXPECT_EQ(NodeStateText(master::NodeState::kWaiting, false, true, true), "checking");
  EXPECT_EQ(NodeStateText(master::NodeState::kWaiting, false, false, true), "spare");
  EXPECT_EQ(NodeStateText(master::NodeState::kTraining, false, false, false), "training");
}

TEST(StatusView, AddNodeKeepsARestoredNodesHeartbeatAgeAtZero) {
  NodeRecord rec;
  rec.spec.node_id = "n1"_node;
  rec.spec.host = "h1";
  rec.group_rank = 2;
  rec.last_heartbeat = 15;  // restored: ahead of now
  v1::JobStatus st;
  AddNode(rec, "training", "", 10, 0.5, true, /*disconnected=*/false, &st);
  ASSERT_EQ(st.nodes_size(), 1);
  EXPECT_EQ(st.nodes(0).node_id(), "n1");
  EXPECT_EQ(st.nodes(0).state(), "training");
  EXPECT_EQ(st.nodes(0).group_rank(), 2);
  EXPECT_EQ(st.nodes(0).last_heartbeat_age_s(), 0);
  EXPECT_EQ(st.nodes(0).step_time_s(), 0.5);
  EXPECT_TRUE(st.nodes(0).straggler());
}

TEST(StatusView, GoodputIsUnknownWithAReasonUntilAStepIsReported) {
  GoodputAccountant::Breakdown b;
  b.wall_s = 10;
  v1::Goodput g;
  FillGoodput(b, &g);
  EXPECT_FALSE(g.known());
  EXPECT_NE(g.note().find("ballast.step()"), std::string::npos);
  EXPECT_EQ(g.parts_size(), GoodputAccountant::kNumParts);
}

TEST(StatusView, ReplicaLocationsComeFromReplicaRecordsOnlyInRankOrder) {
  std::map<std::string, std::string> kv;
  ReplicaRecord a;
  a.holder = "node-b";
  a.addr = "h:9";
  a.step = 7;
  a.world = 4;
  ReplicaRecord b = a;
  b.holder = "node-c";
  kv[ReplicaKey(3, 1)] = a.ToKvValue();
  kv[ReplicaKey(1, 1)] = b.ToKvValue();
  kv["round/1/endpoint"] = "h:1";
  kv[std::string(kReplicaKeyPrefix) + "garbage"] = "x";
  v1::JobStatus st;
  AddReplicaLocations(kv, &st);
  ASSERT_EQ(st.replicas_size(), 2);
  EXPECT_EQ(st.replicas(0).rank(), 1);
  EXPECT_EQ(st.replicas(0).holder(), "node-c");
  EXPECT_EQ(st.replicas(1).rank(), 3);
  EXPECT_EQ(st.replicas(1).step(), 7);
}

}  // namespace
}  // namespace ballast::master::status_view
