#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "common/clock.h"
#include "common/net.h"
#include "common/node_range.h"
#include "common/subprocess.h"
#include "common/tunables.h"
#include "gtest/gtest.h"

namespace ballast {
namespace {

TEST(ParseEndpoint, HostAndPort) {
  auto ep = ParseEndpoint("node-1:29400");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->host, "node-1");
  EXPECT_EQ(ep->port, 29400);
  EXPECT_EQ(ep->ToString(), "node-1:29400");
}

TEST(ParseEndpoint, Ipv6Brackets) {
  auto ep = ParseEndpoint("[::1]:80");
  ASSERT_TRUE(ep.ok());
  EXPECT_EQ(ep->host, "::1");
  EXPECT_EQ(ep->ToString(), "[::1]:80");
}

TEST(ParseEndpoint, DefaultPortOnlyWhenAllowed) {
  EXPECT_EQ(ParseEndpoint("h", 29400)->port, 29400);
  EXPECT_EQ(ParseEndpoint("h").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseEndpoint, RejectsBadPort) {
  auto ep = ParseEndpoint("h:99999");
  EXPECT_EQ(ep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(ep.status().message()).find("HOST:PORT"), std::string::npos);
  EXPECT_FALSE(ParseEndpoint(":80").ok());
}

TEST(ParseNodeRange, SingleNumber) {
  auto r = ParseNodeRange("3", "--nodes");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->min, 3);
  EXPECT_EQ(r->max, 3);
}

TEST(ParseNodeRange, MinMax) {
  auto r = ParseNodeRange("1:4", "--nodes");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->min, 1);
  EXPECT_EQ(r->max, 4);
}

TEST(ParseNodeRange, RejectsInvertedAndGarbageNamingTheFlag) {
  for (const char* bad : {"4:1", "0", "x", "1:", ":2", "-1:2"}) {
    auto r = ParseNodeRange(bad, "--nnodes");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(r.status().message()).find("--nnodes"), std::string::npos) << bad;
  }
}

TEST(PickFreePort, ReturnsUsablePort) {
  auto port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  EXPECT_GT(*port, 0);
}

TEST(RandomHex, LengthAndAlphabet) {
  std::string h = RandomHex(16);
  EXPECT_EQ(h.size(), 32u);
  EXPECT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(h, RandomHex(16));
}

TEST(Tunables, EnvOverrideAndBadValue) {
  setenv("BALLAST_HEARTBEAT_TIMEOUT_S", "2.5", 1);
  setenv("BALLAST_STDERR_TAIL_LINES", "zz", 1);
  std::vector<std::string> errors;
  Tunables t = Tunables::FromEnv(&errors);
  EXPECT_DOUBLE_EQ(t.heartbeat_timeout_s, 2.5);
  EXPECT_EQ(t.stderr_tail_lines, 20);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("BALLAST_STDERR_TAIL_LINES"), std::string::npos);
  unsetenv("BALLAST_HEARTBEAT_TIMEOUT_S");
  unsetenv("BALLAST_STDERR_TAIL_LINES");
}

TEST(FakeClock, Advances) {
  FakeClock c(10);
  c.Advance(2.5);
  EXPECT_DOUBLE_EQ(c.Now(), 12.5);
}

SpawnOptions Sh(const std::string& script) {
  SpawnOptions o;
  o.argv = {"/bin/sh", "-c", script};
  o.env = CurrentEnvironment();
  return o;
}

TEST(Subprocess, ReportsExitCode) {
  auto p = Subprocess::Spawn(Sh("exit 3"));
  ASSERT_TRUE(p.ok()) << p.status();
  auto st = p->Wait(10);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->exit_code, 3);
  EXPECT_EQ(st->signal, 0);
  EXPECT_EQ(st->Describe(), "exit code 3");
}

TEST(Subprocess, ReportsSignal) {
  auto p = Subprocess::Spawn(Sh("kill -9 $$"));
  ASSERT_TRUE(p.ok());
  auto st = p->Wait(10);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->signal, SIGKILL);
  EXPECT_EQ(st->ShellCode(), 137);
  EXPECT_EQ(st->Describe(), "killed by SIGKILL (signal 9)");
}

TEST(Subprocess, MissingProgramIsNotFound) {
  SpawnOptions o;
  o.argv = {"/nonexistent/program"};
  auto p = Subprocess::Spawn(o);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound);
}

TEST(Subprocess, PipesStdout) {
  auto o = Sh("echo hello");
  o.pipe_stdout = true;
  auto p = Subprocess::Spawn(o);
  ASSERT_TRUE(p.ok());
  char buf[64] = {};
  ssize_t n = read(p->stdout_fd(), buf, sizeof(buf) - 1);
  EXPECT_EQ(std::string(buf, n > 0 ? n : 0), "hello\n");
  EXPECT_TRUE(p->Wait(10)->ok());
}

TEST(Subprocess, TerminateKillsWholeGroup) {
  // The shell starts a grandchild; terminating the group must reach it too.
  auto o = Sh("sleep 300 & echo $!; wait");
  o.pipe_stdout = true;
  auto p = Subprocess::Spawn(o);
  ASSERT_TRUE(p.ok());
  char buf[64] = {};
  ssize_t n = read(p->stdout_fd(), buf, sizeof(buf) - 1);
  ASSERT_GT(n, 0);
  pid_t grandchild = std::stoi(std::string(buf, n));
  p->Terminate(2.0);
  // The grandchild is reparented; give init a moment to reap it.
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = !ProcessAlive(grandchild);
    if (!gone) usleep(10000);
  }
  EXPECT_TRUE(gone) << "grandchild " << grandchild << " survived";
}

}  // namespace
}  // namespace ballast
