#include "health/oom.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace ballast::health {
namespace {

class OomTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() / ("ballast-oom-" + std::to_string(getpid()));
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void Write(const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root_ + "/" + rel).parent_path());
    std::ofstream(root_ + "/" + rel) << text;
  }
  std::string root_;
};

TEST_F(OomTest, ReadsCgroupV2MemoryEvents) {
  Write("proc", "0::/job/agent\n");
  Write("cg/job/agent/memory.events", "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n");
  EXPECT_EQ(CgroupOomKills(root_ + "/proc", root_ + "/cg"), 2);
}

TEST_F(OomTest, ReadsCgroupV1OomControl) {
  Write("proc", "9:name=systemd:/\n4:memory:/process_api/x\n3:cpu,cpuacct:/\n0::/\n");
  Write("cg/memory/process_api/x/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n");
  EXPECT_EQ(CgroupOomKills(root_ + "/proc", root_ + "/cg"), 5);
}

TEST_F(OomTest, UnknownWhenNothingReadable) {
  Write("proc", "0::/nowhere\n");
  EXPECT_EQ(CgroupOomKills(root_ + "/proc", root_ + "/cg"), std::nullopt);
  EXPECT_EQ(CgroupOomKills(root_ + "/missing", root_ + "/cg"), std::nullopt);
  Write("cg/nowhere/memory.events", "oom 1\n");  // an old kernel without oom_kill
  EXPECT_EQ(CgroupOomKills(root_ + "/proc", root_ + "/cg"), std::nullopt);
}

}  // namespace
}  // namespace ballast::health
