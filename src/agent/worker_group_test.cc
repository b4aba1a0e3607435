#include "agent/worker_group.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() : path_(fs::path(::testing::TempDir()) / ("wg_" + RandomHex(6))) { fs::create_directories(path_); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool WaitForFile(const std::string& path, double timeout_s = 10) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    if (fs::exists(path) && fs::file_size(path) > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Polls until an event arrives (or timeout).
std::vector<WorkerEvent> PollUntilEvent(WorkerGroup& g, double timeout_s = 20) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    auto events = g.Poll();
    if (!events.empty()) return events;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return {};
}

// Worker output goes to a file the test reads back.
struct Console {
  explicit Console(const std::string& path) : path(path) {
    fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  }
  ~Console() { close(fd); }
  std::string path;
  int fd;
};

WorkerSpec ShellSpec(const std::string& script, int console_fd) {
  WorkerSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.base_env = CurrentEnvironment();
  spec.node_id = "node-a";
  spec.console_stdout_fd = console_fd;
  spec.console_stderr_fd = console_fd;
  return spec;
}

RoundSpec Round(int nproc) {
  RoundSpec r;
  r.round = 7;
  r.group_rank = 1;
  r.group_world_size = 2;
  r.rank_offset = 4;
  r.world_size = 8;
  r.local_world_size = nproc;
  r.restart_count = 2;
  r.max_restarts = 3;
  r.run_id = "run42";
  r.master_addr = "10.1.2.3";
  r.master_port = 29511;
  return r;
}

std::map<std::string, std::string> ParseEnvFile(const std::string& text) {
  std::map<std::string, std::string> env;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    auto eq = line.find('=');
    if (eq != absl::string_view::npos) env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return env;
}

TEST(WorkerGroup, SetsTheTorchrunEnvironment) {
  TempDir dir;
  Console console(dir / "console");
  WorkerSpec spec = ShellSpec(absl::StrCat("env > ", dir / "env_", "$LOCAL_RANK"), console.fd);
  spec.role = "trainer";
  spec.base_env.erase("OMP_NUM_THREADS");
  WorkerGroup g(spec);
  ASSERT_TRUE(g.Start(Round(2)).ok());
  auto events = PollUntilEvent(g);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, WorkerEvent::Kind::kAllSucceeded);
  EXPECT_EQ(events[0].round, 7);
  g.Stop(1);
  for (int lr = 0; lr < 2; ++lr) {
    auto env = ParseEnvFile(ReadFile(absl::StrCat(dir / "env_", lr)));
    EXPECT_EQ(env["RANK"], absl::StrCat(4 + lr));
    EXPECT_EQ(env["LOCAL_RANK"], absl::StrCat(lr));
    EXPECT_EQ(env["WORLD_SIZE"], "8");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["GROUP_RANK"], "1");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(env["ROLE_RANK"], absl::StrCat(4 + lr));
    EXPECT_EQ(env["ROLE_NAME"], "trainer");
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "8");
    EXPECT_EQ(env["MASTER_ADDR"], "10.1.2.3");
    EXPECT_EQ(env["MASTER_PORT"], "29511");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "2");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "3");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "run42");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "False");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(env["BALLAST_NODE_ID"], "node-a");
    EXPECT_EQ(env["BALLAST_ROUND"], "7");
    EXPECT_EQ(env["PYTHONUNBUFFERED"], "1");
    EXPECT_EQ(env["PATH"], CurrentEnvironment()["PATH"]);  // the agent's env is inherited
  }
}

TEST(WorkerGroup, KeepsAUserChosenOmpNumThreads) {
  WorkerSpec spec;
  spec.base_env = {{"OMP_NUM_THREADS", "4"}};
  auto env = WorkerEnvironment(spec, Round(1), 0);
  EXPECT_EQ(env["OMP_NUM_THREADS"], "4");
}

TEST(WorkerGroup, ReportsAFailingWorkerWithExitCodeAndStderrTail) {
  TempDir dir;
  Console console(dir / "console");
  // Rank 0 succeeds; rank 1 writes 30 lines to stderr and exits 3.
  WorkerGroup g(ShellSpec(
      "if [ $LOCAL_RANK = 1 ]; then i=0; while [ $i -lt 30 ]; do echo err$i >&2; i=$((i+1)); done; exit 3; fi",
      console.fd));
  ASSERT_TRUE(g.Start(Round(2)).ok());
  std::vector<WorkerEvent> failures;
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (failures.empty() && std::chrono::steady_clock::now() < end) {
    for (auto& e : g.Poll())
      if (e.kind == WorkerEvent::Kind::kFailed) failures.push_back(e);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].local_rank, 1);
  EXPECT_EQ(failures[0].global_rank, 5);
  EXPECT_EQ(failures[0].status.exit_code, 3);
  EXPECT_EQ(failures[0].status.signal, 0);
  // The last 20 lines (Tunables stderr_tail_lines), complete.
  std::string expected;
  for (int i = 10; i < 30; ++i) absl::StrAppend(&expected, i == 10 ? "" : "\n", "err", i);
  EXPECT_EQ(failures[0].stderr_tail, expected);
  // Reported once, and no "all succeeded" for a round with a failure.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(g.Poll().empty());
  auto workers = g.Workers();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].state, WorkerState::kSucceeded);
  EXPECT_EQ(workers[1].state, WorkerState::kFailed);
  g.Stop(1);
  // Raw lines on the console by default.
  EXPECT_THAT(ReadFile(console.path), HasSubstr("err29\n"));
}

TEST(WorkerGroup, ReportsTheSignalOfAKilledWorker) {
  TempDir dir;
  Console console(dir / "console");
  WorkerGroup g(ShellSpec("echo dying >&2; kill -9 $$", console.fd));
  ASSERT_TRUE(g.Start(Round(1)).ok());
  auto events = PollUntilEvent(g);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, WorkerEvent::Kind::kFailed);
  EXPECT_EQ(events[0].status.signal, SIGKILL);
  EXPECT_EQ(events[0].status.Describe(), "killed by SIGKILL (signal 9)");
  EXPECT_EQ(events[0].stderr_tail, "dying");
}

TEST(WorkerGroup, StopKillsAWorkerThatIgnoresSigtermAfterTheGrace) {
  TempDir dir;
  Console console(dir / "console");
  std::string ready = dir / "ready";
  WorkerGroup g(ShellSpec(absl::StrCat("trap '' TERM; echo $$ > ", ready, "; while true; do sleep 0.05; done"),
                          console.fd));
  ASSERT_TRUE(g.Start(Round(1)).ok());
  ASSERT_TRUE(WaitForFile(ready));
  pid_t pid = g.Workers()[0].pid;
  ASSERT_TRUE(ProcessAlive(pid));
  auto t0 = std::chrono::steady_clock::now();
  g.Stop(0.5);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.5);
  EXPECT_LT(took, 3.0);
  EXPECT_FALSE(ProcessAlive(pid));
  EXPECT_FALSE(g.AnyRunning());
  EXPECT_EQ(g.Workers()[0].state, WorkerState::kStopped);
}

TEST(WorkerGroup, StopEndsAtOnceWhenKillNowIsSet) {
  TempDir dir;
  Console console(dir / "console");
  std::string ready = dir / "ready";
  WorkerGroup g(ShellSpec(absl::StrCat("trap '' TERM; echo $$ > ", ready, "; while true; do sleep 0.05; done"),
                          console.fd));
  ASSERT_TRUE(g.Start(Round(1)).ok());
  ASSERT_TRUE(WaitForFile(ready));
  std::atomic<bool> kill_now{false};
  std::thread second_signal([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    kill_now = true;
  });
  auto t0 = std::chrono::steady_clock::now();
  g.Stop(30, &kill_now);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  second_signal.join();
  EXPECT_LT(took, 5.0);
  EXPECT_FALSE(g.AnyRunning());
}

TEST(WorkerGroup, NoChildRemainsAfterStop) {
  TempDir dir;
  Console console(dir / "console");
  // Each worker starts a grandchild (same process group) and waits for it.
  WorkerGroup g(ShellSpec(absl::StrCat("sleep 300 & echo $! > ", dir / "child_", "$LOCAL_RANK; wait"), console.fd));
  ASSERT_TRUE(g.Start(Round(2)).ok());
  std::vector<pid_t> pids;
  for (int lr = 0; lr < 2; ++lr) {
    std::string f = absl::StrCat(dir / "child_", lr);
    ASSERT_TRUE(WaitForFile(f));
    int child = 0;
    ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(f)), &child));
    pids.push_back(child);
  }
  for (const auto& w : g.Workers()) pids.push_back(w.pid);
  for (pid_t p : pids) EXPECT_TRUE(ProcessAlive(p)) << p;
  g.Stop(2);
  // Orphaned grandchildren are reaped by init asynchronously: allow a moment.
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (pid_t p : pids) {
    while (ProcessAlive(p) && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_FALSE(ProcessAlive(p)) << p;
  }
}

TEST(WorkerGroup, TeePrefixesConsoleLinesAndWritesLogFiles) {
  TempDir dir;
  Console console(dir / "console");
  WorkerSpec spec = ShellSpec("echo out$LOCAL_RANK; echo err$LOCAL_RANK >&2", console.fd);
  spec.tee = "3";
  spec.log_dir = dir / "logs";
  WorkerGroup g(spec);
  ASSERT_TRUE(g.Start(Round(2)).ok());
  ASSERT_EQ(PollUntilEvent(g).size(), 1u);
  g.Stop(1);
  std::string text = ReadFile(console.path);
  EXPECT_THAT(text, HasSubstr("[default4]:out0\n"));
  EXPECT_THAT(text, HasSubstr("[default5]:err1\n"));
  std::string attempt = dir / "logs/run42/attempt_2";
  EXPECT_EQ(g.attempt_log_dir(), attempt);
  EXPECT_EQ(ReadFile(attempt + "/0/stdout.log"), "out0\n");
  EXPECT_EQ(ReadFile(attempt + "/1/stderr.log"), "err1\n");
}

TEST(WorkerGroup, RedirectsKeepOutputOffTheConsole) {
  TempDir dir;
  Console console(dir / "console");
  WorkerSpec spec = ShellSpec("echo hidden; echo shown >&2", console.fd);
  spec.redirects = "1";  // stdout only
  spec.log_dir = dir / "logs";
  WorkerGroup g(spec);
  ASSERT_TRUE(g.Start(Round(1)).ok());
  ASSERT_EQ(PollUntilEvent(g).size(), 1u);
  g.Stop(1);
  std::string text = ReadFile(console.path);
  EXPECT_THAT(text, Not(HasSubstr("hidden")));
  EXPECT_THAT(text, HasSubstr("shown\n"));
  EXPECT_EQ(ReadFile(dir / "logs/run42/attempt_2/0/stdout.log"), "hidden\n");
}

TEST(WorkerGroup, PythonWorkerFailureCarriesTheTraceback) {
  ASSERT_TRUE(fs::exists("/usr/bin/python3")) << "no /usr/bin/python3: scripts/install-deps.sh installs python3";
  TempDir dir;
  Console console(dir / "console");
  WorkerSpec spec;
  spec.argv = {"/usr/bin/python3", "-u", "-c", "import os\nraise ValueError('rank ' + os.environ['RANK'])"};
  spec.base_env = CurrentEnvironment();
  spec.console_stdout_fd = console.fd;
  spec.console_stderr_fd = console.fd;
  WorkerGroup g(spec);
  ASSERT_TRUE(g.Start(Round(1)).ok());
  auto events = PollUntilEvent(g);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].status.exit_code, 1);
  EXPECT_THAT(events[0].stderr_tail, HasSubstr("ValueError: rank 4"));
}

TEST(WorkerGroup, StartFailsClearlyForAMissingProgram) {
  WorkerSpec spec;
  spec.argv = {"/nonexistent/python-xyz", "t.py"};
  WorkerGroup g(spec);
  absl::Status s = g.Start(Round(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("/nonexistent/python-xyz"));
  EXPECT_FALSE(g.AnyRunning());
}

TEST(WorkerGroup, RestartsIntoANewRound) {
  TempDir dir;
  Console console(dir / "console");
  WorkerGroup g(ShellSpec(absl::StrCat("echo $BALLAST_ROUND >> ", dir / "rounds", "; sleep 300"), console.fd));
  ASSERT_TRUE(g.Start(Round(1)).ok());
  ASSERT_TRUE(WaitForFile(dir / "rounds"));
  pid_t first = g.Workers()[0].pid;
  g.Stop(1);
  RoundSpec next = Round(1);
  next.round = 8;
  ASSERT_TRUE(g.Start(next).ok());
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ReadFile(dir / "rounds") != "7\n8\n" && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ReadFile(dir / "rounds"), "7\n8\n");
  EXPECT_FALSE(ProcessAlive(first));
  EXPECT_EQ(g.round(), 8);
  g.Stop(1);
}

// The stderr lines a worker writes between StartStderrCapture and
// TakeStderrCapture are returned (a stack dump on SIGUSR1), earlier ones not.
TEST(WorkerGroup, CapturesStderrWrittenAfterStartCapture) {
  TempDir dir;
  Console console(dir / "console");
  WorkerSpec spec = ShellSpec(absl::StrCat("echo before >&2; trap 'echo dump one >&2; echo dump two >&2' USR1; "
                                           "touch ", dir / "ready", "; while :; do sleep 0.05; done"),
                              console.fd);
  WorkerGroup g(spec);
  ASSERT_TRUE(g.Start(Round(1)).ok());
  auto console_has = [&](const std::string& s) {
    for (int i = 0; i < 200; ++i) {
      if (ReadFile(console.path).find(s) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return false;
  };
  ASSERT_TRUE(console_has("before"));
  for (int i = 0; i < 400 && !fs::exists(dir / "ready"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  ASSERT_TRUE(fs::exists(dir / "ready")) << "the trap is set before the file is created";
  g.StartStderrCapture(0);
  kill(g.Workers()[0].pid, SIGUSR1);
  ASSERT_TRUE(console_has("dump two"));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the reader stores after forwarding
  EXPECT_EQ(g.TakeStderrCapture(0), "dump one\ndump two");
  EXPECT_EQ(g.TakeStderrCapture(0), "");  // the capture ended
  EXPECT_EQ(g.TakeStderrCapture(5), "");  // no such worker
  g.Stop(1);
}

}  // namespace
}  // namespace ballast::agent
