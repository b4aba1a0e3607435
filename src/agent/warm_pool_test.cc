// Warm interpreters with a real /usr/bin/python3 (no torch preload, so the
// tests stay fast): what the script sees, when the pool falls back to a cold
// start, and the worker group's use of it.
#include "agent/warm_pool.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/worker_group.h"
#include "common/net.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace ballast::agent {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kPython[] = "/usr/bin/python3";

class WarmPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("warm_" + RandomHex(6));
    fs::create_directories(dir_ / "pkg");
    // Writes what a script sees of its start to <out>.
    std::ofstream(dir_ / "probe.py") << R"(import json, os, sys
import signal
json.dump({"name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
           "x": os.environ.get("X"), "rank": os.environ.get("RANK"), "warm_fd": os.environ.get("BALLAST_WARM_FD"),
           "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
           "has_bootstrap_names": "_ballast_warm" in globals()},
          open(sys.argv[1], "w"))
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
)";
    std::ofstream(dir_ / "pkg" / "__init__.py") << "";
    std::ofstream(dir_ / "pkg" / "mod.py") << "import json, sys\n"
                                                "json.dump({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0]},"
                                                " open(sys.argv[1], 'w'))\n";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::map<std::string, std::string> Env(const std::string& x) {
    std::map<std::string, std::string> env = CurrentEnvironment();
    env["X"] = x;
    env["RANK"] = "0";
    return env;
  }
  nlohmann::json ReadJson(const fs::path& p, double timeout_s = 20) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      if (fs::exists(p) && fs::file_size(p) > 0) {
        std::ifstream in(p);
        nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
        if (!j.is_discarded()) return j;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return nullptr;
  }
  WarmPool Pool(std::vector<std::string> modules = {"json"}) { return WarmPool(WarmOptions{kPython, modules}); }
  // Polls until the interpreter of lr said ready, then takes it.
  std::optional<WarmProcess> TakeWhenReady(WarmPool& pool, int lr, const std::map<std::string, std::string>& env,
                                           std::string* why) {
    for (int i = 0; i < 1000 && !pool.ready(lr) && !pool.disabled(); ++i) {
      pool.Poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return pool.Take(lr, env, why);
  }
  // Polls the group until its workers ended; whether that was every worker
  // succeeding. Stops the group.
  bool EndsWithAllSucceeded(WorkerGroup& group) {
    std::vector<WorkerEvent> events;
    for (int i = 0; i < 500 && events.empty(); ++i) {
      events = group.Poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    group.Stop(0);
    return events.size() == 1 && events[0].kind == WorkerEvent::Kind::kAllSucceeded;
  }
  fs::path dir_;
};

TEST(WarmPoolEnv, FirstDifferenceNamesTheVariable) {
  EXPECT_EQ(FirstDifference({{"A", "1"}, {"B", "2"}}, {{"A", "1"}, {"B", "3"}}), "B changed");
  EXPECT_EQ(FirstDifference({{"A", "1"}}, {{"A", "1"}, {"NCCL_DEBUG", "INFO"}}), "NCCL_DEBUG is set now");
  EXPECT_EQ(FirstDifference({{"A", "1"}}, {}), "A is unset now");
  EXPECT_EQ(FirstDifference({{"A", "1"}}, {{"A", "1"}}), "");
}

TEST(WorkerEnvironment, WhatTheAgentSetsPerRoundOrRankIsNotPartOfTheInterpreterEnvironment) {
  WorkerSpec spec;
  spec.base_env = {{"USER_VAR", "u"}, {"OMP_NUM_THREADS", ""}};
  spec.node_id = "n0";
  spec.local_rank_env = {{{"BALLAST_CKPT_SHM", "s0"}, {"BALLAST_CKPT_REPLICAS", "r1"}}};
  RoundSpec round;
  round.round = 4;
  round.rank_offset = 2;
  round.world_size = 6;
  round.master_addr = "10.0.0.1";
  round.master_port = 29400;
  const std::map<std::string, std::string> interp = InterpreterEnvironment(spec);
  EXPECT_EQ(interp.at("USER_VAR"), "u");
  EXPECT_EQ(interp.at("OMP_NUM_THREADS"), "1");  // torchrun's default for an empty value
  EXPECT_EQ(interp.at("BALLAST_NODE_ID"), "n0");
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                        "BALLAST_ROUND", "BALLAST_CKPT_SHM", "BALLAST_CKPT_REPLICAS"}) {
    EXPECT_EQ(interp.count(v), 0u) << v;
  }
  const std::map<std::string, std::string> full = WorkerEnvironment(spec, round, 0);
  EXPECT_EQ(full.at("RANK"), "2");
  EXPECT_EQ(full.at("BALLAST_ROUND"), "4");
  EXPECT_EQ(full.at("BALLAST_CKPT_REPLICAS"), "r1");
  // Every variable of the interpreter environment is in the worker's, unchanged.
  for (const auto& [k, v] : interp) EXPECT_EQ(full.at(k), v) << k;
}

TEST_F(WarmPoolTest, ScriptRunsAsMainWithTheJobsArgvEnvAndCwd) {
  WarmPool pool = Pool();
  ASSERT_TRUE(pool.Prepare(0, Env("warm")).ok());
  std::string why;
  std::optional<WarmProcess> w = TakeWhenReady(pool, 0, Env("warm"), &why);
  ASSERT_TRUE(w.has_value()) << why;
  EXPECT_GT(w->ready_at_s, 0);
  std::map<std::string, std::string> env = Env("warm");
  env["RANK"] = "5";  // a round variable: the job brings it
  const std::string out = (dir_ / "out.json").string();
  ASSERT_TRUE(WarmPool::Hand(&*w, env, dir_.string(), {"probe.py", out, "7"}, false).ok());
  auto status = w->process.Wait(20);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->exit_code, 7);  // sys.exit passes through
  nlohmann::json j = ReadJson(out);
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["name"], "__main__");
  EXPECT_EQ(j["argv"], nlohmann::json::array({"probe.py", out, "7"}));
  EXPECT_EQ(j["cwd"], dir_.string());
  EXPECT_EQ(j["path0"], fs::canonical(dir_).string());  // the script's directory, as for `python probe.py`
  EXPECT_EQ(j["file"], "probe.py");
  EXPECT_EQ(j["x"], "warm");
  EXPECT_EQ(j["rank"], "5");
  EXPECT_TRUE(j["warm_fd"].is_null());  // the bootstrap's own variables are gone
  EXPECT_TRUE(j["sigint"].get<bool>());
  EXPECT_FALSE(j["has_bootstrap_names"].get<bool>());
}

TEST_F(WarmPoolTest, ModuleRunsWithMinusMSemantics) {
  WarmPool pool = Pool();
  ASSERT_TRUE(pool.Prepare(0, Env("m")).ok());
  std::string why;
  std::optional<WarmProcess> w = TakeWhenReady(pool, 0, Env("m"), &why);
  ASSERT_TRUE(w.has_value()) << why;
  const std::string out = (dir_ / "mod.json").string();
  ASSERT_TRUE(WarmPool::Hand(&*w, Env("m"), dir_.string(), {"pkg.mod", out}, true).ok());
  ASSERT_TRUE(w->process.Wait(20).has_value());
  nlohmann::json j = ReadJson(out);
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["name"], "__main__");
  EXPECT_EQ(j["argv"][0], (fs::canonical(dir_) / "pkg" / "mod.py").string());
  EXPECT_EQ(j["argv"][1], out);
  EXPECT_EQ(j["path0"], dir_.string());  // python -m puts the cwd first
}

TEST_F(WarmPoolTest, ChangedEnvironmentFallsBackToColdNamingTheVariable) {
  WarmPool pool = Pool();
  ASSERT_TRUE(pool.Prepare(0, Env("a")).ok());
  std::map<std::string, std::string> changed = Env("a");
  changed["OMP_NUM_THREADS"] = "7";
  std::string why;
  EXPECT_FALSE(pool.Take(0, changed, &why).has_value());
  EXPECT_THAT(why, HasSubstr("OMP_NUM_THREADS"));
  EXPECT_FALSE(pool.disabled());  // only this start is cold
  std::string why2;
  EXPECT_FALSE(pool.Take(0, Env("a"), &why2).has_value());  // the stale interpreter is gone
  EXPECT_THAT(why2, HasSubstr("no warm interpreter"));
}

TEST_F(WarmPoolTest, FailedPreloadTurnsWarmStartsOffSayingWhy) {
  WarmPool pool = Pool({"json", "no_such_module_for_ballast"});
  ASSERT_TRUE(pool.Prepare(0, Env("f")).ok());
  for (int i = 0; i < 500 && !pool.disabled(); ++i) {
    pool.Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(pool.disabled());
  EXPECT_THAT(pool.disabled_reason(), HasSubstr("could not import no_such_module_for_ballast"));
  EXPECT_THAT(pool.disabled_reason(), HasSubstr("ModuleNotFoundError"));
  std::string why;
  EXPECT_FALSE(pool.Take(0, Env("f"), &why).has_value());
  EXPECT_TRUE(pool.Prepare(0, Env("f")).ok());  // a no-op now
}

TEST_F(WarmPoolTest, WorkerGroupStartsWarmAndForwardsOutput) {
  WarmPool pool = Pool();
  const std::string console_path = (dir_ / "console.txt").string();
  int console = open(console_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  std::ofstream(dir_ / "hello.py") << "import os, sys\nprint('hello from rank', os.environ['RANK'])\n"
                                      "sys.exit(0)\n";
  WorkerSpec spec;
  spec.argv = {kPython, "-u", (dir_ / "hello.py").string()};
  spec.base_env = CurrentEnvironment();
  spec.console_stdout_fd = console;
  spec.console_stderr_fd = console;
  spec.warm = &pool;
  spec.script_argv = {(dir_ / "hello.py").string()};
  WorkerGroup group(spec);
  ASSERT_TRUE(pool.Prepare(0, group.InterpreterEnvironment()).ok());
  for (int i = 0; i < 1000 && !pool.ready(0); ++i) {
    pool.Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(pool.ready(0));
  RoundSpec round;
  round.round = 1;
  round.rank_offset = 3;
  ASSERT_TRUE(group.Start(round).ok());
  EXPECT_EQ(group.start_summary(), "warm (1 of 1)");
  EXPECT_TRUE(group.Workers()[0].warm);
  EXPECT_TRUE(EndsWithAllSucceeded(group));
  // The worker was a fork: the interpreter stays, and the next start is warm too.
  round.round = 2;
  round.rank_offset = 4;
  ASSERT_TRUE(group.Start(round).ok());
  EXPECT_EQ(group.start_summary(), "warm (1 of 1)");
  EXPECT_TRUE(EndsWithAllSucceeded(group));
  close(console);
  std::ifstream in(console_path);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_THAT(ss.str(), HasSubstr("hello from rank 3"));
  EXPECT_THAT(ss.str(), HasSubstr("hello from rank 4"));
}

// Without forks the interpreter is handed out itself: the next start finds
// none waiting, starts cold, and says so.
TEST_F(WarmPoolTest, WithoutForksTheNextStartIsColdAndSaysWhy) {
  WarmOptions wo{kPython, {"json"}};
  wo.fork = false;
  WarmPool pool(wo);
  std::ofstream(dir_ / "ok.py") << "pass\n";
  WorkerSpec spec;
  spec.argv = {kPython, "-u", (dir_ / "ok.py").string()};
  spec.base_env = CurrentEnvironment();
  spec.warm = &pool;
  spec.script_argv = {(dir_ / "ok.py").string()};
  WorkerGroup group(spec);
  ASSERT_TRUE(pool.Prepare(0, group.InterpreterEnvironment()).ok());
  RoundSpec round;
  round.round = 1;
  ASSERT_TRUE(group.Start(round).ok());
  EXPECT_EQ(group.start_summary(), "warm (1 of 1)");
  group.Stop(0);
  round.round = 2;
  ASSERT_TRUE(group.Start(round).ok());
  EXPECT_THAT(group.start_summary(), HasSubstr("cold (local rank 0: no warm interpreter was ready)"));
  group.Stop(0);
}

// A fork is this process's child (waitpid reaps it, its exit code comes
// through), leads its own process group, writes to its own pipes, has what
// the interpreter imported and a random generator of its own; the
// interpreter stays ready, and forks again.
TEST_F(WarmPoolTest, AForkIsTheAgentsChildWithItsOwnPipesAndTheInterpreterStays) {
  WarmPool pool(WarmOptions{kPython, {"json"}, false, {"fractions"}});
  std::ofstream(dir_ / "fork.py") << R"(import json, os, random, sys
print("out of", os.getpid())
print("err of", os.getpid(), file=sys.stderr)
json.dump({"ppid": os.getppid(), "pgid": os.getpgid(0), "pid": os.getpid(), "fractions": "fractions" in sys.modules,
           "random": random.random(),
           "fds": {fd: os.readlink("/proc/self/fd/" + fd) for fd in os.listdir("/proc/self/fd")
                   if os.path.exists("/proc/self/fd/" + fd) and 2 < int(fd) < 512}},
          open(sys.argv[1], "w"))
sys.exit(int(sys.argv[2]))
)";
  // What any child of this process inherits (descriptors without
  // close-on-exec), but fd 3: a warm interpreter's control socket took it
  // (and moved it out of the way), for a fork as before forks.
  nlohmann::json inherited = nlohmann::json::object();
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    const int fd = std::stoi(e.path().filename().string());
    if (fd > 2 && fd != kControlFd && fd < 512 && (fcntl(fd, F_GETFD) & FD_CLOEXEC) == 0)
      inherited[e.path().filename().string()] = fs::read_symlink(e.path()).string();
  }
  std::vector<nlohmann::json> seen;
  int template_pid = -1;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(pool.Prepare(0, Env("k")).ok());  // a no-op the second time: it stayed
    std::string why;
    std::optional<WarmProcess> w = TakeWhenReady(pool, 0, Env("k"), &why);
    ASSERT_TRUE(w.has_value()) << why;
    std::vector<WarmPool::TakenState> taken = pool.TakeTakenStates();
    ASSERT_EQ(taken.size(), 1u);
    EXPECT_TRUE(taken[0].forked);
    EXPECT_THAT(taken[0].Describe(), HasSubstr("forked, json imported, DDP/FSDP modules preloaded"));
    EXPECT_TRUE(pool.ready(0));  // the interpreter stays
    const std::string out = (dir_ / ("fork" + std::to_string(i) + ".json")).string();
    ASSERT_TRUE(WarmPool::Hand(&*w, Env("k"), dir_.string(), {(dir_ / "fork.py").string(), out, "5"}, false).ok());
    auto status = w->process.Wait(20);
    ASSERT_TRUE(status.has_value());
    EXPECT_EQ(status->exit_code, 5);
    nlohmann::json j = ReadJson(out);
    ASSERT_FALSE(j.is_null());
    EXPECT_EQ(j["ppid"], getpid());
    EXPECT_EQ(j["pid"], w->process.pid());
    EXPECT_EQ(j["pgid"], w->process.pid());
    EXPECT_TRUE(j["fractions"].get<bool>());  // imported by the interpreter before the fork
    EXPECT_EQ(j["fds"], inherited) << "a fork has what a cold start has: what this process passes on";
    char buf[256] = {};
    ssize_t n = read(w->process.stdout_fd(), buf, sizeof(buf) - 1);
    EXPECT_EQ(std::string(buf, n > 0 ? n : 0), absl::StrCat("out of ", w->process.pid(), "\n"));
    n = read(w->process.stderr_fd(), buf, sizeof(buf) - 1);
    EXPECT_EQ(std::string(buf, n > 0 ? n : 0), absl::StrCat("err of ", w->process.pid(), "\n"));
    seen.push_back(j);
    EXPECT_NE(j["pid"].get<int>(), template_pid);
    template_pid = taken[0].pid;
  }
  EXPECT_NE(seen[0]["pid"], seen[1]["pid"]);
  EXPECT_NE(seen[0]["random"], seen[1]["random"]);  // reseeded in each fork
}

// With forks a node keeps one interpreter, whatever its local world size:
// every local rank's worker is a fork of it, at a job's first start too (the
// forks wait for its imports, under way since it was prepared), so the
// node imports what the workers need once.
TEST_F(WarmPoolTest, OneInterpreterForksEveryLocalRanksWorkerAtTheFirstStartToo) {
  // Its import takes 1 s and leaves a line per importing process.
  std::ofstream(dir_ / "slowimport.py") << "import os, time\ntime.sleep(1)\n"
                                           "open(os.environ['IMPORTS'], 'a').write('%d\\n' % os.getpid())\n";
  std::ofstream(dir_ / "rank.py") << "import json, os, sys\n"
                                     "json.dump({'rank': os.environ['RANK'], 'slow': 'slowimport' in sys.modules, "
                                     "'ppid': os.getppid()}, open(sys.argv[1] + os.environ['RANK'], 'w'))\n";
  WarmPool pool = Pool({"json", "slowimport"});
  const std::string imports = (dir_ / "imports.txt").string();
  WorkerSpec spec;
  spec.base_env = CurrentEnvironment();
  spec.base_env["PYTHONPATH"] = dir_.string();
  spec.base_env["IMPORTS"] = imports;
  spec.warm = &pool;
  for (int round_no = 1; round_no <= 2; ++round_no) {
    const std::string out = (dir_ / absl::StrCat("r", round_no, "_")).string();
    spec.argv = {kPython, "-u", (dir_ / "rank.py").string(), out};
    spec.script_argv = {(dir_ / "rank.py").string(), out};
    WorkerGroup group(spec);
    // What WarmStarter::PrepareNow does: one Prepare per local rank.
    for (int lr = 0; lr < 3; ++lr) ASSERT_TRUE(pool.Prepare(lr, group.InterpreterEnvironment()).ok());
    if (round_no == 1) {
      EXPECT_FALSE(pool.ready(0));  // still importing slowimport
    }
    RoundSpec round;
    round.round = round_no;
    round.local_world_size = 3;
    round.world_size = 3;
    ASSERT_TRUE(group.Start(round).ok());
    EXPECT_EQ(group.start_summary(), "warm (3 of 3)");
    std::vector<WarmPool::TakenState> taken = pool.TakeTakenStates();
    ASSERT_EQ(taken.size(), 3u);
    for (const WarmPool::TakenState& t : taken) {
      EXPECT_TRUE(t.forked) << t.local_rank;
      EXPECT_TRUE(t.imported) << t.local_rank;
    }
    EXPECT_TRUE(EndsWithAllSucceeded(group));
    for (int rank = 0; rank < 3; ++rank) {
      nlohmann::json j = ReadJson(out + std::to_string(rank));
      ASSERT_FALSE(j.is_null()) << rank;
      EXPECT_TRUE(j["slow"].get<bool>()) << rank;
      EXPECT_EQ(j["ppid"], getpid()) << rank;
    }
    EXPECT_TRUE(pool.ready(2));  // the one interpreter serves every local rank
  }
  std::ifstream in(imports);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  EXPECT_EQ(lines, 1) << "one interpreter imported slowimport, for six workers";
}

// The agent sets BALLAST_CKPT_REPLICAS when a round starts (the replicas the
// node holds then): that reaches a warm worker with its job, and the start
// stays warm.
TEST_F(WarmPoolTest, VariablesTheAgentSetsPerRoundKeepTheStartWarm) {
  WarmPool pool = Pool();
  std::ofstream(dir_ / "env.py") << "import json, os, sys\n"
                                    "json.dump({k: os.environ.get(k) for k in ('RANK', 'BALLAST_CKPT_SHM', "
                                    "'BALLAST_CKPT_REPLICAS')}, open(sys.argv[1], 'w'))\n";
  const std::string out = (dir_ / "env.json").string();
  WorkerSpec spec;
  spec.argv = {kPython, "-u", (dir_ / "env.py").string(), out};
  spec.base_env = CurrentEnvironment();
  spec.local_rank_env = {{{"BALLAST_CKPT_SHM", "store-0"}}};
  spec.warm = &pool;
  spec.script_argv = {(dir_ / "env.py").string(), out};
  WorkerGroup group(spec);
  ASSERT_TRUE(pool.Prepare(0, group.InterpreterEnvironment()).ok());
  // The round brings the replicas this node holds now.
  group.set_local_rank_env({{{"BALLAST_CKPT_SHM", "store-0"}, {"BALLAST_CKPT_REPLICAS", "peer-a,peer-b"}}});
  RoundSpec round;
  round.round = 2;
  round.rank_offset = 1;
  round.world_size = 2;
  ASSERT_TRUE(group.Start(round).ok());
  EXPECT_EQ(group.start_summary(), "warm (1 of 1)");
  nlohmann::json j = ReadJson(out);
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["RANK"], "1");
  EXPECT_EQ(j["BALLAST_CKPT_SHM"], "store-0");
  EXPECT_EQ(j["BALLAST_CKPT_REPLICAS"], "peer-a,peer-b");
  group.Stop(0);
}

// The hints (what DDP/FSDP import) are imported after the modules, each
// skipped when it fails, before the interpreter counts as ready; Take says
// what the interpreter it hands out had.
TEST_F(WarmPoolTest, HintsArePreloadedAndTheTakenStateSaysSo) {
  WarmPool pool(WarmOptions{kPython, {"json"}, false, {"fractions", "no_such_module_for_ballast"}});
  ASSERT_TRUE(pool.Prepare(0, Env("h")).ok());
  std::string why;
  std::optional<WarmProcess> w = TakeWhenReady(pool, 0, Env("h"), &why);
  ASSERT_TRUE(w.has_value()) << why;
  EXPECT_FALSE(pool.disabled());  // a hint that fails is skipped
  std::vector<WarmPool::TakenState> taken = pool.TakeTakenStates();
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].local_rank, 0);
  EXPECT_EQ(taken[0].pid, w->process.pid());
  EXPECT_TRUE(taken[0].imported);
  EXPECT_TRUE(taken[0].hints_done);
  EXPECT_THAT(taken[0].Describe(), HasSubstr("json imported, DDP/FSDP modules preloaded, 0 of 0 learned modules"));
  EXPECT_TRUE(pool.TakeTakenStates().empty());  // handed out once
  const std::string out = (dir_ / "hints.json").string();
  std::ofstream(dir_ / "mods.py") << "import json, sys\njson.dump({'fractions': 'fractions' in sys.modules}, "
                                     "open(sys.argv[1], 'w'))\n";
  ASSERT_TRUE(WarmPool::Hand(&*w, Env("h"), dir_.string(), {(dir_ / "mods.py").string(), out}, false).ok());
  nlohmann::json j = ReadJson(out);
  ASSERT_FALSE(j.is_null());
  EXPECT_TRUE(j["fractions"].get<bool>());
  w->process.Wait();
}

// A job that comes while the preload is under way runs as soon as the
// import in progress is done, with what is loaded; the script imports the
// rest itself (a restart right after another one, or early in a job, does
// not wait for a whole list).
TEST_F(WarmPoolTest, AJobThatComesWhileThePreloadIsUnderWayRunsWithWhatIsLoaded) {
  fs::create_directories(dir_ / "slow");
  std::vector<std::string> slow;
  for (int i = 0; i < 40; ++i) {
    slow.push_back("ballast_slow" + std::to_string(i));
    // Each import says it began, then takes 0.25 s: 10 s for the list.
    std::ofstream(dir_ / "slow" / (slow.back() + ".py"))
        << "import os, time\nopen(os.path.join(os.path.dirname(__file__), __name__ + '.began'), 'w').close()\n"
           "time.sleep(0.25)\n";
  }
  WarmPool pool = Pool();
  pool.Preload(slow);
  std::map<std::string, std::string> env = Env("s");
  env["PYTHONPATH"] = (dir_ / "slow").string();
  ASSERT_TRUE(pool.Prepare(0, env).ok());
  for (int i = 0; i < 2000 && !fs::exists(dir_ / "slow" / "ballast_slow0.began"); ++i) {
    pool.Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(fs::exists(dir_ / "slow" / "ballast_slow0.began"));
  EXPECT_FALSE(pool.ready(0));  // its preload is not done
  std::string why;
  std::optional<WarmProcess> w = pool.Take(0, env, &why);
  ASSERT_TRUE(w.has_value()) << why;  // taken all the same
  std::vector<WarmPool::TakenState> taken = pool.TakeTakenStates();
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_TRUE(taken[0].imported);
  EXPECT_EQ(taken[0].learned_sent, 40u);
  EXPECT_EQ(taken[0].learned_done, 0u);
  EXPECT_THAT(taken[0].Describe(), HasSubstr("0 of 40 learned modules preloaded"));
  const std::string out = (dir_ / "loaded.json").string();
  std::ofstream(dir_ / "loaded.py") << "import json, sys\n"
                                       "json.dump(sorted(m for m in sys.modules if m.startswith('ballast_slow')), "
                                       "open(sys.argv[1], 'w'))\n";
  ASSERT_TRUE(WarmPool::Hand(&*w, env, dir_.string(), {(dir_ / "loaded.py").string(), out}, false).ok());
  nlohmann::json loaded = ReadJson(out);
  ASSERT_TRUE(loaded.is_array());
  EXPECT_THAT(loaded.get<std::vector<std::string>>(), ::testing::Contains("ballast_slow0"));
  // Cut short: not the 40 (the script ran before the list was done).
  EXPECT_LT(loaded.size(), 40u) << loaded.dump();
  w->process.Wait();
}

TEST(ReadControlLines, WholeLinesOnlyAndEof) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ASSERT_EQ(write(sv[1], "ready 1.5\npg 2", 14), 14);
  std::string buf;
  bool closed = false;
  EXPECT_EQ(ReadControlLines(sv[0], &buf, &closed), std::vector<std::string>{"ready 1.5"});
  EXPECT_FALSE(closed);
  ASSERT_EQ(write(sv[1], " 3\n", 3), 3);
  close(sv[1]);
  EXPECT_EQ(ReadControlLines(sv[0], &buf, &closed), std::vector<std::string>{"pg 2 3"});
  EXPECT_TRUE(closed);
  close(sv[0]);
}

// An interpreter whose imports started Python threads is not forked (the
// copy would lack them): it is handed out itself, as without forks.
TEST_F(WarmPoolTest, AnInterpreterRunningThreadsIsHandedOutNotForked) {
  std::ofstream(dir_ / "threader.py") << "import threading, time\n"
                                         "threading.Thread(target=time.sleep, args=(600,), name='poller', "
                                         "daemon=True).start()\n";
  WarmPool pool(WarmOptions{kPython, {"json"}, false, {"threader"}});
  std::map<std::string, std::string> env = Env("t");
  env["PYTHONPATH"] = dir_.string();
  ASSERT_TRUE(pool.Prepare(0, env).ok());
  std::string why;
  std::optional<WarmProcess> w = TakeWhenReady(pool, 0, env, &why);
  ASSERT_TRUE(w.has_value()) << why;
  std::vector<WarmPool::TakenState> taken = pool.TakeTakenStates();
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_FALSE(taken[0].forked);
  EXPECT_FALSE(pool.ready(0));  // handed out: none waits now
  const std::string out = (dir_ / "t.json").string();
  ASSERT_TRUE(WarmPool::Hand(&*w, env, dir_.string(), {"probe.py", out, "0"}, false).ok());
  auto status = w->process.Wait(20);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->exit_code, 0);
}

}  // namespace
}  // namespace ballast::agent
