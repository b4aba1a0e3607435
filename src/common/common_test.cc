#include <signal.h>
#include <algorithm>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/node_range.h"
#include "common/save_every.h"
#include "common/thread_priority.h"
#include "common/subprocess.h"
#include "common/tunables.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace ballast {
namespace {

TEST(SaveEvery, CountsAutoAndABound) {
  for (const char* ok : {"1", "25", "auto", "auto:200", " auto "}) EXPECT_TRUE(ValidateSaveEvery(ok, "--save-every").ok()) << ok;
  for (const char* bad : {"", "0", "-3", "2.5", "auto:", "auto:0", "auto:x", "every", "autox"}) {
    absl::Status s = ValidateSaveEvery(bad, "--save-every");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--save-every auto:200"), std::string::npos) << s.message();
  }
}

TEST(ParseDurationSeconds, UnitsAndErrors) {
  EXPECT_DOUBLE_EQ(*ParseDurationSeconds("90", "--mtbf"), 90);
  EXPECT_DOUBLE_EQ(*ParseDurationSeconds("90s", "--mtbf"), 90);
  EXPECT_DOUBLE_EQ(*ParseDurationSeconds("30m", "--mtbf"), 1800);
  EXPECT_DOUBLE_EQ(*ParseDurationSeconds("1.5h", "--mtbf"), 5400);
  EXPECT_DOUBLE_EQ(*ParseDurationSeconds("2d", "--mtbf"), 172800);
  for (const char* bad : {"", "h", "0", "-1h", "1w", "nan", "inf", "1 h x"}) {
    absl::StatusOr<double> d = ParseDurationSeconds(bad, "--mtbf");
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_NE(d.status().message().find("--mtbf 90m"), std::string::npos) << d.status().message();
  }
}

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

TEST(PickFreePort, StaysBelowTheEphemeralRange) {
  // Outgoing connections take their local ports from the ephemeral range: a
  // port picked there could be gone before its user binds it.
  const int low = EphemeralPortLow();
  ASSERT_GT(low, kLowestPickedPort + 100) << "this machine's ephemeral range starts too low for the test";
  for (int i = 0; i < 50; ++i) {
    auto port = PickFreePort("127.0.0.1");
    ASSERT_TRUE(port.ok());
    EXPECT_GE(*port, kLowestPickedPort);
    EXPECT_LT(*port, low);
  }
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

TEST(Tunables, NegativeValuesAndTheFormerlyStrayOnesAreCheckedToo) {
  setenv("BALLAST_PRECHECK_TIMEOUT_S", "-3", 1);
  setenv("BALLAST_CKPT_COPY_THREADS", "4", 1);
  setenv("BALLAST_PRECHECK_MATMUL_SIZE", "big", 1);
  std::vector<std::string> errors = Tunables::Validate();
  Tunables t = Tunables::FromEnv(nullptr);
  EXPECT_EQ(t.ckpt_copy_threads, 4);
  EXPECT_DOUBLE_EQ(t.precheck_timeout_s, 120.0);  // the bad value is not taken
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("BALLAST_PRECHECK_TIMEOUT_S='-3' is not a value >= 0"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("unset it for the default 120.0"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("BALLAST_PRECHECK_MATMUL_SIZE='big' is not a valid int"), std::string::npos) << errors[1];
  unsetenv("BALLAST_PRECHECK_TIMEOUT_S");
  unsetenv("BALLAST_CKPT_COPY_THREADS");
  unsetenv("BALLAST_PRECHECK_MATMUL_SIZE");
  EXPECT_TRUE(Tunables::Validate().empty());
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

// A subreaper gets its descendants' orphans as children; ReapStrayChildren
// reaps the ones that ended and leaves a Subprocess's own child alone.
TEST(Subprocess, ASubreaperReapsOrphansButNotWhatASubprocessOwns) {
  ASSERT_TRUE(BecomeChildSubreaper().ok());
  auto o = Sh("sleep 0.2 & echo $!");  // the shell exits at once, its child 0.2 s later
  o.pipe_stdout = true;
  auto p = Subprocess::Spawn(o);
  ASSERT_TRUE(p.ok());
  auto owned = Subprocess::Spawn(Sh("exit 3"));  // ends at once; its owner reaps it
  ASSERT_TRUE(owned.ok());
  char buf[64] = {};
  ssize_t n = read(p->stdout_fd(), buf, sizeof(buf) - 1);
  ASSERT_GT(n, 0);
  const pid_t orphan = std::stoi(std::string(buf, n));
  ASSERT_TRUE(p->Wait(10).has_value());
  int reaped = 0;
  for (int i = 0; i < 300 && reaped == 0; ++i) {
    reaped += ReapStrayChildren();
    if (reaped == 0) usleep(10000);
  }
  EXPECT_EQ(reaped, 1);
  EXPECT_FALSE(ProcessAlive(orphan));
  EXPECT_EQ(kill(orphan, 0), -1);  // reaped: no zombie left
  auto st = owned->Wait(10);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->exit_code, 3);  // its status was left to it
}

TEST(ProcNetTcp, ListenerAndAcceptedPeersOfOnePort) {
  // 127.0.0.1:33713 listening; accepted from 10.0.0.2:40000 and 127.0.0.1;
  // a client socket of port 33713 elsewhere and another local port ignored.
  const char* v4 =
      "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
      "   0: 00000000:83B1 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
      "   1: 0100007F:83B1 0200000A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n"
      "   2: 0100007F:83B1 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 3 1\n"
      "   3: 0100007F:9C41 0100007F:83B1 01 00000000:00000000 00:00000000 00000000     0        0 4 1\n"
      "   4: 0100007F:1F90 0300000A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 5 1\n"
      "   5: garbage\n";
  TcpPortUse use;
  ParseProcNetTcp(v4, /*ipv6=*/false, 0x83B1, &use);
  EXPECT_TRUE(use.listening);
  EXPECT_EQ(use.accepted_peers, (std::vector<std::string>{"10.0.0.2", "127.0.0.1"}));
  // tcp6: an IPv4-mapped peer (::ffff:10.0.0.3) and a real IPv6 one (::1).
  const char* v6 =
      "  sl  local_address                         remote_address                        st\n"
      "   0: 0000000000000000FFFF00000100007F:83B1 0000000000000000FFFF00000300000A:9C40 01 0 0 0 0 0 0 0 0\n"
      "   1: 00000000000000000000000001000000:83B1 00000000000000000000000001000000:9C42 01 0 0 0 0 0 0 0 0\n";
  TcpPortUse use6;
  ParseProcNetTcp(v6, /*ipv6=*/true, 0x83B1, &use6);
  EXPECT_FALSE(use6.listening);
  EXPECT_EQ(use6.accepted_peers, (std::vector<std::string>{"10.0.0.3", "::1"}));
}

TEST(ProbeListener, AcceptsConnectionsUntilDestroyed) {
  auto probe = ProbeListener::Start();
  ASSERT_TRUE(probe.ok()) << probe.status();
  int port = (*probe)->port();
  EXPECT_TRUE(CheckTcpConnect("127.0.0.1", port, 2.0).ok());
  auto use = LocalTcpPortUse(port);
  ASSERT_TRUE(use.ok());
  EXPECT_TRUE(use->listening);
  probe->reset();
  absl::Status s = CheckTcpConnect("127.0.0.1", port, 2.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(s.message()).find(absl::StrCat("127.0.0.1:", port)), std::string::npos) << s;
}

// A stop wakes a waiting thread at once: with a fallback timeout of a minute,
// a wait that missed the stop would hang this test until ctest's timeout.
TEST(StopSignal, WakesAWaitAtOnceAndStaysStopped) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  StopSignal stop;
  ASSERT_TRUE(write(fds[1], "x", 1) == 1);
  EXPECT_TRUE(stop.WaitReadable(fds[0], 60000));  // readable: true
  char c;
  ASSERT_EQ(read(fds[0], &c, 1), 1);
  bool woke = true;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread waiter([&] { woke = stop.WaitReadable(fds[0], 60000); });
  stop.Stop();
  waiter.join();
  EXPECT_FALSE(woke);
  // Not a timing target: a wait that missed the stop ends only at the fallback.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  EXPECT_TRUE(stop.stopped());
  // Stopped before the wait, and with the fd readable too: false at once.
  ASSERT_TRUE(write(fds[1], "x", 1) == 1);
  EXPECT_FALSE(stop.WaitReadable(fds[0], 60000));
  close(fds[0]);
  close(fds[1]);
}

TEST(CheckTcpConnect, UnresolvableNameIsNotFoundNamingIt) {
  absl::Status s = CheckTcpConnect("no-such-host.invalid", 80, 1.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(s.message()).find("cannot resolve 'no-such-host.invalid'"), std::string::npos) << s;
}

TEST(LocalAddressToward, LoopbackMasterGivesLoopbackAndNumericResolution) {
  EXPECT_EQ(*LocalAddressToward("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(LocalAddressToward("no-such-host.invalid").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(InterfaceWithAddress("127.0.0.1"), "lo");
  EXPECT_EQ(*ResolveNumeric("127.0.0.1"), (std::vector<std::string>{"127.0.0.1"}));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
}

TEST(DeferLogs, LinesLoggedInsideAreWrittenWhenTheOutermostScopeEnds) {
  std::ostringstream out;
  spdlog::logger logger("defer-test", DeferringSink(std::make_shared<spdlog::sinks::ostream_sink_mt>(out)));
  logger.set_pattern("%v");
  logger.info("before");
  EXPECT_EQ(out.str(), "before\n");
  {
    DeferLogs outer;
    logger.info("one");
    {
      DeferLogs inner;
      logger.warn("two");
    }
    EXPECT_EQ(out.str(), "before\n") << "nothing written while a scope is open";
    // Another thread is not deferred.
    std::thread([&] { logger.info("other thread"); }).join();
    EXPECT_EQ(out.str(), "before\nother thread\n");
  }
  EXPECT_EQ(out.str(), "before\nother thread\none\ntwo\n");
  logger.info("after");
  EXPECT_EQ(out.str(), "before\nother thread\none\ntwo\nafter\n");
}

}  // namespace
}  // namespace ballast

TEST(LowerThisThread, NicesOnlyTheCallingThreadAndLowersItsIoNeverRaisesIt) {
  const int base = ballast::ThisThreadNice();
  int nice = -100, nicer_kept = -100, io_class = -1, io_level = -1;
  std::thread t([&] {
    ballast::NameThisThread("ckpt-test-thread-long-name");
    ASSERT_TRUE(ballast::LowerThisThread(10).ok());
    nice = ballast::ThisThreadNice();
    io_class = ballast::ThisThreadIoPriority(&io_level);
    ASSERT_TRUE(ballast::LowerThisThread(5).ok());  // a nicer thread stays as nice
    nicer_kept = ballast::ThisThreadNice();
  });
  t.join();
  EXPECT_EQ(nice, std::max(base, 10));
  EXPECT_EQ(nicer_kept, nice);
  EXPECT_EQ(io_class, 2);  // best effort
  EXPECT_EQ(io_level, 7);  // its lowest level
  EXPECT_EQ(ballast::ThisThreadNice(), base);  // the caller's other threads keep theirs
  EXPECT_TRUE(ballast::LowerThisThread(0).ok());
  EXPECT_EQ(ballast::ThisThreadNice(), base);
}
