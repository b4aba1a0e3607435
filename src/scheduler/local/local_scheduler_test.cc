#include "scheduler/local/local_scheduler.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace ballast::scheduler {
namespace {

NodeSpec Sh(const std::string& name, const std::string& script) {
  return NodeSpec{name, {"/bin/sh", "-c", script}, {}};
}

std::vector<NodeExit> WaitForExits(LocalScheduler& s, size_t n) {
  std::vector<NodeExit> all;
  for (int i = 0; i < 500 && all.size() < n; ++i) {
    auto e = s.PollExited();
    all.insert(all.end(), e.begin(), e.end());
    if (all.size() < n) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return all;
}

TEST(LocalScheduler, ReportsExitedNodeWithStatus) {
  LocalScheduler s;
  ASSERT_TRUE(s.LaunchNode(Sh("node-0", "exit 7")).ok());
  auto exits = WaitForExits(s, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].name, "node-0");
  EXPECT_EQ(exits[0].status.exit_code, 7);
  EXPECT_TRUE(s.RunningNodes().empty());
}

TEST(LocalScheduler, RefusesDuplicateName) {
  LocalScheduler s;
  ASSERT_TRUE(s.LaunchNode(Sh("n", "sleep 30")).ok());
  EXPECT_EQ(s.LaunchNode(Sh("n", "sleep 30")).code(), absl::StatusCode::kAlreadyExists);
}

TEST(LocalScheduler, ExtraEnvironmentReachesNode) {
  LocalScheduler s;
  NodeSpec spec = Sh("n", "test \"$BALLAST_X\" = yes");
  spec.env["BALLAST_X"] = "yes";
  ASSERT_TRUE(s.LaunchNode(spec).ok());
  auto exits = WaitForExits(s, 1);
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].status.exit_code, 0);
}

TEST(LocalScheduler, StopAllLeavesNoProcess) {
  pid_t a, b;
  {
    LocalScheduler s;
    ASSERT_TRUE(s.LaunchNode(Sh("a", "trap '' TERM; sleep 60")).ok());
    ASSERT_TRUE(s.LaunchNode(Sh("b", "sleep 60")).ok());
    a = s.PidOf("a");
    b = s.PidOf("b");
    EXPECT_EQ(s.RunningNodes().size(), 2u);
    s.StopAll(0.2);
    EXPECT_TRUE(s.RunningNodes().empty());
  }
  EXPECT_FALSE(ProcessAlive(a));
  EXPECT_FALSE(ProcessAlive(b));
}

TEST(LocalScheduler, StopUnknownNodeIsNotFound) {
  LocalScheduler s;
  EXPECT_EQ(s.StopNode("ghost", 0).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ballast::scheduler
