#include "master/decision_outbox.h"

#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace ballast::master {
namespace {

class RecordingSink : public DecisionOutboxes::Sink {
 public:
  void Deliver(const v1::Decision& d) override { delivered.push_back(d); }
  void End(const absl::Status& s) override { ended = s; }
  std::vector<v1::Decision> delivered;
  absl::Status ended;
};

v1::Decision Wait(const std::string& why) {
  v1::Decision d;
  d.mutable_wait()->set_reason(why);
  return d;
}

v1::Decision Stop() {
  v1::Decision d;
  d.mutable_stop_workers();
  return d;
}

TEST(DecisionOutboxes, NewStreamStartsWithTheCurrentStateNotATransition) {
  DecisionOutboxes ob;
  ob.Add(NodeId("a"));
  EXPECT_TRUE(ob.Push(NodeId("a"), Wait("first")));
  EXPECT_TRUE(ob.Push(NodeId("a"), Stop()));
  EXPECT_FALSE(ob.Push(NodeId("nobody"), Wait("x")));
  auto sink = std::make_shared<RecordingSink>();
  bool replaced = true;
  auto h = ob.Open(NodeId("a"), sink, &replaced);
  ASSERT_TRUE(h.ok());
  EXPECT_FALSE(replaced);
  ASSERT_EQ(sink->delivered.size(), 1u);
  EXPECT_EQ(sink->delivered[0].wait().reason(), "first");
  ob.Push(NodeId("a"), Stop());
  ASSERT_EQ(sink->delivered.size(), 2u);
  EXPECT_TRUE(sink->delivered[1].has_stop_workers());
  EXPECT_EQ(ob.pushed(), 3u);
}

TEST(DecisionOutboxes, NewerWatchCancelsTheOlderAndGoneNodeEndsWithNotFound) {
  DecisionOutboxes ob;
  absl::Mutex mu;
  ob.Add(NodeId("a"));
  bool replaced = false;
  auto first = ob.Open(NodeId("a"), nullptr, &replaced);
  ASSERT_TRUE(first.ok());
  auto sink = std::make_shared<RecordingSink>();
  auto second = ob.Open(NodeId("a"), sink, &replaced);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(replaced);
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(absl::IsCancelled(ob.Next(*first, 0, &mu).status()));
  }
  ob.Remove(NodeId("a"), "heartbeat timeout");
  EXPECT_TRUE(absl::IsNotFound(sink->ended));
  EXPECT_NE(sink->ended.message().find("heartbeat timeout"), std::string::npos);
  EXPECT_FALSE(ob.Contains(NodeId("a")));
  EXPECT_TRUE(absl::IsNotFound(ob.Open(NodeId("a"), nullptr, &replaced).status()));
}

TEST(DecisionOutboxes, QueueStreamDrainsInOrderAndTimesOut) {
  DecisionOutboxes ob;
  absl::Mutex mu;
  ob.Add(NodeId("a"));
  bool replaced = false;
  auto h = ob.Open(NodeId("a"), nullptr, &replaced);
  ASSERT_TRUE(h.ok());
  ob.Push(NodeId("a"), Wait("1"));
  ob.Push(NodeId("a"), Wait("2"));
  absl::MutexLock lock(&mu);
  EXPECT_EQ((*ob.Next(*h, 0, &mu))->wait().reason(), "1");
  EXPECT_EQ((*ob.Next(*h, 0, &mu))->wait().reason(), "2");
  auto none = ob.Next(*h, 0.01, &mu);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  ob.Shutdown();
  EXPECT_TRUE(absl::IsUnavailable(ob.Next(*h, 0, &mu).status()));
}

TEST(DecisionOutboxes, DisconnectionAndFinalDecisionsAreTracked) {
  DecisionOutboxes ob;
  ob.Add(NodeId("a"));
  ob.Add(NodeId("b"));
  EXPECT_TRUE(ob.AllFinalSent()) << "no open stream";
  bool replaced = false;
  auto h = ob.Open(NodeId("a"), nullptr, &replaced);
  ASSERT_TRUE(h.ok());
  EXPECT_FALSE(ob.AllFinalSent());
  ob.MarkFinalSent(*h);
  EXPECT_TRUE(ob.AllFinalSent());
  ob.Close(*h, 10.0);
  EXPECT_TRUE(ob.Disconnected(NodeId("a")));
  EXPECT_FALSE(ob.Disconnected(NodeId("b")));
  EXPECT_TRUE(ob.DisconnectedFor(11.0, 2.0).empty());
  EXPECT_EQ(ob.DisconnectedFor(12.0, 2.0), std::vector<NodeId>{NodeId("a")});
  // A restored node counts until its agent reconnected and got JobFinished.
  ob.Restore(NodeId("b"), Wait("resumed"));
  EXPECT_FALSE(ob.AllFinalSent());
  auto hb = ob.Open(NodeId("b"), nullptr, &replaced);
  ASSERT_TRUE(hb.ok());
  ob.MarkFinalSent(*hb);
  EXPECT_TRUE(ob.AllFinalSent());
}

// AnyDisconnected (a count kept as streams open and close and nodes come and
// go) says what asking every node's Disconnected would.
TEST(DecisionOutboxes, AnyDisconnectedFollowsEveryNode) {
  DecisionOutboxes ob;
  const std::vector<NodeId> ids = {NodeId("a"), NodeId("b"), NodeId("c")};
  auto any = [&] {
    for (const NodeId& id : ids) {
      if (ob.Disconnected(id)) return true;
    }
    return false;
  };
  std::map<NodeId, DecisionOutboxes::Handle> handles;
  bool replaced = false;
  for (int step = 0; step < 300; ++step) {
    const NodeId& id = ids[static_cast<size_t>(step * 7 % 3)];
    switch (step * 13 % 5) {
      case 0:
        ob.Add(id);  // a fresh outbox (a re-join replaces the old one)
        break;
      case 1:
      case 2:
        if (auto h = ob.Open(id, nullptr, &replaced); h.ok()) handles[id] = *h;
        break;
      case 3:
        if (handles.count(id) > 0) ob.Close(handles[id], static_cast<double>(step));
        break;
      case 4:
        if (step % 3 == 0) ob.Remove(id, "lost");
        break;
    }
    ASSERT_EQ(ob.AnyDisconnected(), any()) << "step " << step;
  }
}

}  // namespace
}  // namespace ballast::master
