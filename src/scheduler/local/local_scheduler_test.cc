#include "scheduler/local/local_scheduler.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace ballast::scheduler {
namespace {

// Each node runs the shell script named by its request's name (name -> script).
LocalScheduler Sh(std::map<std::string, std::string> scripts) {
  return LocalScheduler([scripts](const NodeRequest& r) {
    auto it = scripts.find(r.name);
    return LocalCommand{{"/bin/sh", "-c", it == scripts.end() ? "exit 0" : it->second},
                        {{"BALLAST_X", "yes"}}};
  });
}

NodeRequest Req(const std::string& name, int rank = 0) { return NodeRequest{name, rank, 1, {}}; }

std::vector<NodeEvent> WaitForExits(LocalScheduler& s, size_t n) {
  std::vector<NodeEvent> all;
  for (int i = 0; i < 500; ++i) {
    for (auto& e : s.Poll()) {
      if (e.kind == NodeEvent::Kind::kExited) all.push_back(e);
    }
    if (all.size() >= n) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return all;
}

TEST(LocalScheduler, ReportsStartedThenExitedNodeWithStatus) {
  LocalScheduler s = Sh({{"node-0", "exit 7"}});
  ASSERT_TRUE(s.LaunchNode(Req("node-0")).ok());
  std::vector<NodeEvent> first = s.Poll();  // the exit may be in it already
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first[0].kind, NodeEvent::Kind::kStarted);
  EXPECT_EQ(first[0].host, "localhost");
  std::vector<NodeEvent> exits;
  for (const NodeEvent& e : first) {
    if (e.kind == NodeEvent::Kind::kExited) exits.push_back(e);
  }
  if (exits.empty()) exits = WaitForExits(s, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].name, "node-0");
  EXPECT_EQ(exits[0].status.exit_code, 7);
  EXPECT_TRUE(s.RunningNodes().empty());
}

TEST(LocalScheduler, RefusesDuplicateName) {
  LocalScheduler s = Sh({{"n", "sleep 30"}});
  ASSERT_TRUE(s.LaunchNode(Req("n")).ok());
  EXPECT_EQ(s.LaunchNode(Req("n")).code(), absl::StatusCode::kAlreadyExists);
}

TEST(LocalScheduler, CommandEnvironmentAndNodeIdReachTheNode) {
  LocalScheduler s = Sh({{"n7", "test \"$BALLAST_X\" = yes && test \"$BALLAST_NODE_ID\" = n7"}});
  ASSERT_TRUE(s.LaunchNode(Req("n7")).ok());
  auto exits = WaitForExits(s, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].status.exit_code, 0);
}

TEST(LocalScheduler, StopAllLeavesNoProcess) {
  pid_t a, b;
  {
    LocalScheduler s = Sh({{"a", "trap '' TERM; sleep 60"}, {"b", "sleep 60"}});
    ASSERT_TRUE(s.LaunchNode(Req("a")).ok());
    ASSERT_TRUE(s.LaunchNode(Req("b")).ok());
    a = s.PidOf("a");
    b = s.PidOf("b");
    EXPECT_EQ(s.RunningNodes().size(), 2u);
    s.StopAll(0.2);
    EXPECT_TRUE(s.RunningNodes().empty());
  }
  EXPECT_FALSE(ProcessAlive(a));
  EXPECT_FALSE(ProcessAlive(b));
}

TEST(LocalScheduler, ReleaseStopsTheNodeAndUnknownIsNotFound) {
  LocalScheduler s = Sh({{"a", "sleep 60"}});
  ASSERT_TRUE(s.LaunchNode(Req("a")).ok());
  pid_t a = s.PidOf("a");
  EXPECT_TRUE(s.ReleaseNode("a", "test", 0.2).ok());
  EXPECT_FALSE(ProcessAlive(a));
  EXPECT_TRUE(s.RunningNodes().empty());
  EXPECT_EQ(s.ReleaseNode("ghost", "test", 0).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ballast::scheduler
