// ReplicaCoordinator over real stores and replica channels on 127.0.0.1 and a
// map standing in for the master's KV store: a node's steps reach its ring
// successor, and the replacement of a lost node copies them back before its
// workers start.
#include "agent/replica_coordinator.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "agent/fake_kv.h"
#include "ckpt/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using ckpt::test_util::BuildImage;
using ckpt::test_util::State;
using ckpt::test_util::UniqueShmName;

std::unique_ptr<ckpt::SlotStore> NewStore(const std::string& tag) {
  auto s = ckpt::SlotStore::Create(UniqueShmName(tag));
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

// A round of two nodes: `self` at group rank `group_rank`, one rank each.
v1::StartRound Round(int64_t round, const std::string& n0, const std::string& n1, int group_rank) {
  v1::StartRound s;
  s.set_round(round);
  s.set_group_rank(group_rank);
  s.set_group_world_size(2);
  s.set_rank_offset(group_rank);
  s.set_world_size(2);
  int g = 0;
  for (const std::string& id : {n0, n1}) {
    v1::RoundMember* m = s.add_members();
    m->set_node_id(id);
    m->set_group_rank(g);
    m->set_rank_offset(g);
    m->set_local_world_size(1);
    m->set_host("127.0.0.1");
    ++g;
  }
  return s;
}

std::unique_ptr<ReplicaCoordinator> Node(const std::string& id, ckpt::SlotStore* store, FakeKv* kv) {
  ReplicaOptions o;
  o.node_id = id;
  o.host = "127.0.0.1";
  o.token = "tok";
  o.store_prefix = UniqueShmName(id);
  o.replicas = 1;
  auto c = ReplicaCoordinator::Start(o, {store}, kv->Setter(), kv->Getter(), [id] { return "node=" + id; });
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

TEST(ReplicaCoordinator, TheReplacementOfALostNodeCopiesItsRanksStepFromTheRingSuccessor) {
  FakeKv kv;
  auto a0 = NewStore("coord-a");
  auto b0 = NewStore("coord-b");
  auto c0 = NewStore("coord-c");
  auto a = Node("node-a", a0.get(), &kv);
  auto b = Node("node-b", b0.get(), &kv);
  a->BeforeRound(Round(1, "node-a", "node-b", 0));
  b->BeforeRound(Round(1, "node-a", "node-b", 1));
  EXPECT_TRUE(b->HeldStores().empty());
  // Rank 0 saves step 5 on node a; its sender puts it on node b (ring successor).
  State st;
  st.Add("w", ckpt::DType::kFloat32, {1024}, 5);
  const std::vector<uint8_t> image = BuildImage(5, st.views);
  auto w = a0->BeginSave(5, image.size());
  ASSERT_TRUE(w.ok()) << w.status();
  std::memcpy(w->image(), image.data(), image.size());
  ASSERT_TRUE(a0->Commit(&*w, image.size()).ok());
  std::string record;
  for (int i = 0; i < 500 && record.empty(); ++i) {
    if (auto v = kv.Getter()(ReplicaKey(0, 0)); v.ok()) record = *v;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_THAT(record, ::testing::StartsWith("node-b 127.0.0.1:"));
  EXPECT_EQ(b->HeldStores().size(), 1u);  // for the workers: BALLAST_CKPT_REPLICAS

  // Node a is lost with its memory; node c takes its place at group rank 0.
  a.reset();
  a0.reset();
  auto c = Node("node-c", c0.get(), &kv);
  c->BeforeRound(Round(2, "node-c", "node-b", 0));
  c->JoinCopies();
  bool restored = false;
  for (const ckpt::SlotInfo& info : c0->Inspect()) {
    restored |= info.state == ckpt::SlotState::kCommitted && info.step == 5 && info.origin == ckpt::SlotOrigin::kReplica;
  }
  EXPECT_TRUE(restored);
}

}  // namespace
}  // namespace ballast::agent
