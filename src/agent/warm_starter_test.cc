// WarmStarter with a real /usr/bin/python3 behind the pool and the worker
// group, and a fake KV store: what a replacement preloads, and what running
// workers teach the next interpreters.
#include "agent/warm_starter.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "agent/fake_kv.h"
#include "common/module_list.h"
#include "common/net.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace ballast::agent {
namespace {

namespace fs = std::filesystem;
using ::testing::Contains;

WarmKv Kv(FakeKv* kv) { return WarmKv{kv->Getter(), kv->Setter()}; }

class WarmStarterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("warm_starter_" + RandomHex(6));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  WorkerSpec Spec(WarmPool* pool, const std::string& script) {
    WorkerSpec spec;
    spec.argv = {"/usr/bin/python3", "-u", script};
    spec.base_env = CurrentEnvironment();
    spec.warm = pool;
    spec.script_argv = {script};
    return spec;
  }
  static uint64_t Now() {
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  fs::path dir_;
};

// A node that joins later preloads what the KV store says the others'
// workers imported, before its first start.
TEST_F(WarmStarterTest, PrepareNowPreloadsTheModulesTheKvStoreHolds) {
  FakeKv kv;
  kv.kv[WarmStarter::kWarmModulesKey] = R"(["fractions", "no_such_module_for_ballast"])";
  WarmPool pool(WarmOptions{"/usr/bin/python3", {"json"}});
  const std::string out = (dir_ / "seen.json").string();
  std::ofstream(dir_ / "probe.py") << "import json, sys\n"
                                      "json.dump({'fractions': 'fractions' in sys.modules}, open(sys.argv[1], 'w'))\n";
  WorkerSpec spec = Spec(&pool, (dir_ / "probe.py").string());
  spec.script_argv.push_back(out);
  WorkerGroup group(spec);
  WarmStarter starter(&pool, &group, 1, Kv(&kv), [] { return std::string("node=test"); });
  starter.PrepareNow();
  EXPECT_EQ(pool.preloaded(), (std::vector<std::string>{"fractions", "no_such_module_for_ballast"}));
  for (int i = 0; i < 1000 && !pool.ready(0); ++i) {  // ready: "json" imported and the preload answered
    starter.Poll(Now(), false);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(pool.ready(0));
  EXPECT_FALSE(pool.disabled());  // a preloaded module that fails is skipped
  RoundSpec round;
  round.round = 1;
  ASSERT_TRUE(group.Start(round).ok());
  EXPECT_EQ(group.start_summary(), "warm (1 of 1)");
  for (int i = 0; i < 500 && !(fs::exists(out) && fs::file_size(out) > 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(out);
  nlohmann::json seen = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(seen.is_discarded());
  EXPECT_TRUE(seen["fractions"].get<bool>());  // imported before the script ran
  group.Stop(0);
}

// Running warm workers are asked what they imported; the names reach the
// waiting interpreters and the KV store (for replacements).
TEST_F(WarmStarterTest, LearnsTheModulesRunningWorkersImportedAndPublishesThem) {
  FakeKv kv;
  WarmPool pool(WarmOptions{"/usr/bin/python3", {"json"}});
  std::ofstream(dir_ / "train.py") << "import decimal, time\ntime.sleep(60)\n";
  WorkerGroup group(Spec(&pool, (dir_ / "train.py").string()));
  WarmStarter starter(&pool, &group, 1, Kv(&kv), [] { return std::string("node=test"); });
  starter.PrepareNow();
  RoundSpec round;
  round.round = 1;
  ASSERT_TRUE(group.Start(round).ok());
  ASSERT_EQ(group.start_summary(), "warm (1 of 1)");
  starter.WorkersStarted(Now());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the script imports decimal
  starter.FirstStep(Now());
  for (int i = 0; i < 500 && kv.Get(WarmStarter::kWarmModulesKey).empty(); ++i) {
    starter.Poll(Now(), true);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(kv.Get(WarmStarter::kWarmModulesKey).empty());
  nlohmann::json published = nlohmann::json::parse(kv.Get(WarmStarter::kWarmModulesKey));
  EXPECT_THAT(published.get<std::vector<std::string>>(), Contains("decimal"));
  EXPECT_THAT(pool.preloaded(), Contains("decimal"));
  // The script's own module is never named (it could do anything at import).
  EXPECT_THAT(pool.preloaded(), ::testing::Not(Contains("__main__")));
  // The next interpreters, prepared at the first step, get the list.
  for (int i = 0; i < 1000 && !pool.ready(0); ++i) {
    starter.Poll(Now(), true);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(pool.ready(0));
  group.Stop(0);
}

// A hot spare prepared its interpreters at its join, before anything was
// published: while it waits without workers it reads the list again and
// preloads what the training nodes' workers imported.
TEST_F(WarmStarterTest, ANodeWithoutWorkersTakesInTheModulesPublishedAfterItsJoin) {
  FakeKv kv;
  WarmPool pool(WarmOptions{"/usr/bin/python3", {"json"}});
  WorkerGroup group(Spec(&pool, (dir_ / "unused.py").string()));
  WarmStarter starter(&pool, &group, 2, Kv(&kv), [] { return std::string("node=spare"); });
  starter.PrepareNow();
  EXPECT_TRUE(pool.preloaded().empty());
  const uint64_t t0 = Now();
  starter.Poll(t0, false);
  kv.kv[WarmStarter::kWarmModulesKey] = R"(["fractions"])";
  starter.Poll(t0 + 1, false);  // read less than kKvAgainNs ago: not yet
  EXPECT_TRUE(pool.preloaded().empty());
  starter.Poll(t0 + WarmStarter::kKvAgainNs, false);
  EXPECT_EQ(pool.preloaded(), (std::vector<std::string>{"fractions"}));
  for (int i = 0; i < 1000 && !(pool.ready(0) && pool.ready(1)); ++i) {
    starter.Poll(t0 + WarmStarter::kKvAgainNs + 1, false);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(pool.ready(0) && pool.ready(1));
  // The list grows: the next read adds only what is new.
  kv.kv[WarmStarter::kWarmModulesKey] = R"(["fractions", "decimal"])";
  starter.Poll(t0 + 3 * WarmStarter::kKvAgainNs, false);
  EXPECT_EQ(pool.preloaded(), (std::vector<std::string>{"fractions", "decimal"}));
  group.Stop(0);
}

// What the workers imported outlives the run: written once they stepped
// (not before: a run that fails earlier would leave a list without what the
// first steps import), read by the next run's first interpreters, which
// preload it before anything was learned or published.
TEST_F(WarmStarterTest, KeepsWhatTheWorkersImportedForTheNextRun) {
  const std::string file = (dir_ / "cache" / "modules.txt").string();
  FakeKv kv;
  WarmPool pool(WarmOptions{"/usr/bin/python3", {"json"}});
  std::ofstream(dir_ / "train.py") << "import decimal, time\ntime.sleep(60)\n";
  WorkerGroup group(Spec(&pool, (dir_ / "train.py").string()));
  WarmStarter starter(&pool, &group, 1, Kv(&kv), [] { return std::string("node=test"); });
  starter.set_module_file(file, "/venv/bin/python", "/job/train.py");
  starter.PrepareNow();
  RoundSpec round;
  round.round = 1;
  ASSERT_TRUE(group.Start(round).ok());
  const uint64_t t0 = Now();  // polled at t0 until the first step: no scheduled ask, no fallback
  starter.WorkersStarted(t0);
  auto has_decimal = [&] {
    const std::vector<std::string>& p = pool.preloaded();
    return std::find(p.begin(), p.end(), "decimal") != p.end();
  };
  // Asked until the script has imported decimal (its start takes a while on a busy machine).
  for (int i = 0; i < 1000 && !has_decimal(); ++i) {
    if (i % 10 == 0) group.RequestModules();
    starter.Poll(t0, true);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_THAT(pool.preloaded(), Contains("decimal"));
  EXPECT_FALSE(fs::exists(file));  // learned, but no step yet
  starter.FirstStep(Now());
  for (int i = 0; i < 500 && !fs::exists(file); ++i) {
    starter.Poll(Now(), true);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  absl::StatusOr<std::vector<std::string>> kept = ReadModuleListFile(file, "/venv/bin/python", "/job/train.py");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_THAT(*kept, Contains("decimal"));
  EXPECT_THAT(*kept, ::testing::Not(Contains("__main__")));
  group.Stop(0);

  // The next run: its first interpreters preload the list at once.
  FakeKv kv2;
  WarmPool pool2(WarmOptions{"/usr/bin/python3", {"json"}});
  WorkerGroup group2(Spec(&pool2, (dir_ / "train.py").string()));
  WarmStarter starter2(&pool2, &group2, 1, Kv(&kv2), [] { return std::string("node=test"); });
  starter2.set_module_file(file, "/venv/bin/python", "/job/train.py");
  starter2.PrepareNow();
  EXPECT_THAT(pool2.preloaded(), Contains("decimal"));
  for (int i = 0; i < 1000 && !pool2.ready(0); ++i) {
    starter2.Poll(Now(), false);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(pool2.ready(0));
  // An earlier run's list is a guess for this node only: the KV store holds
  // what this run's workers imported.
  EXPECT_EQ(kv2.Get(WarmStarter::kWarmModulesKey), "");
  // Another script (or python) has a list of its own.
  WarmPool pool3(WarmOptions{"/usr/bin/python3", {"json"}});
  WarmStarter starter3(&pool3, &group2, 1, Kv(&kv2), [] { return std::string("node=test"); });
  starter3.set_module_file(file, "/venv/bin/python", "/job/other.py");
  starter3.PrepareNow();
  EXPECT_TRUE(pool3.preloaded().empty());
}

// A script that never calls ballast.step() (no first step seen) has its
// list kept once the workers ran for the second scheduled ask (10 s).
TEST_F(WarmStarterTest, KeepsTheListOfAScriptWithoutStepsTenSecondsOn) {
  const std::string file = (dir_ / "cache" / "modules.txt").string();
  FakeKv kv;
  WarmPool pool(WarmOptions{"/usr/bin/python3", {"json"}});
  std::ofstream(dir_ / "train.py") << "import decimal, time\ntime.sleep(60)\n";
  WorkerGroup group(Spec(&pool, (dir_ / "train.py").string()));
  WarmStarter starter(&pool, &group, 1, Kv(&kv), [] { return std::string("node=test"); });
  starter.set_module_file(file, "/usr/bin/python3", "/job/train.py");
  starter.PrepareNow();
  RoundSpec round;
  round.round = 1;
  ASSERT_TRUE(group.Start(round).ok());
  const uint64_t t0 = Now();
  starter.WorkersStarted(t0);
  starter.Poll(t0 + WarmStarter::kPrepareFallbackNs, true);  // prepares; the learning schedule starts
  auto has_decimal = [&] {
    const std::vector<std::string>& p = pool.preloaded();
    return std::find(p.begin(), p.end(), "decimal") != p.end();
  };
  // Asked until the script has imported decimal (its start takes a while on a busy machine).
  for (int i = 0; i < 1000 && !has_decimal(); ++i) {
    if (i % 10 == 0) group.RequestModules();
    starter.Poll(t0 + WarmStarter::kPrepareFallbackNs, true);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_THAT(pool.preloaded(), Contains("decimal"));
  const uint64_t first_ask = t0 + WarmStarter::kPrepareFallbackNs + WarmStarter::kLearnAgainNs[0];
  starter.Poll(first_ask, true);
  EXPECT_FALSE(fs::exists(file));  // 2 s on: not yet
  starter.Poll(first_ask + WarmStarter::kLearnAgainNs[1], true);  // 10 s on
  absl::StatusOr<std::vector<std::string>> kept = ReadModuleListFile(file, "/usr/bin/python3", "/job/train.py");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_THAT(*kept, Contains("decimal"));
  group.Stop(0);
}

// The interpreters for the next restart start as soon as this start took
// the waiting ones when they wait at SCHED_IDLE (a fault soon after a start
// finds them importing, not absent); at normal priority they wait for the
// first step (or kPrepareFallbackNs), not to slow this start.
TEST_F(WarmStarterTest, TheNextInterpretersStartWithTheWorkersWhenTheyWaitAtIdlePriority) {
  for (bool low : {true, false}) {
    SCOPED_TRACE(low ? "SCHED_IDLE" : "normal priority");
    if (low && !CanRestoreNormalPriority()) {
      GTEST_LOG_(INFO) << "this process may not restore SCHED_OTHER (no CAP_SYS_NICE): SCHED_IDLE case not run";
      continue;
    }
    FakeKv kv;
    // Without forks: the start takes the interpreter itself, and the next
    // one is prepared. (With forks it stays; the next start forks it again.)
    WarmPool pool(WarmOptions{"/usr/bin/python3", {"json"}, low, {}, /*fork=*/false});
    std::ofstream(dir_ / "train.py") << "import time\ntime.sleep(60)\n";
    WorkerGroup group(Spec(&pool, (dir_ / "train.py").string()));
    WarmStarter starter(&pool, &group, 1, Kv(&kv), [] { return std::string("node=test"); });
    starter.PrepareNow();
    RoundSpec round;
    round.round = 1;
    ASSERT_TRUE(group.Start(round).ok());
    ASSERT_EQ(group.start_summary(), "warm (1 of 1)");
    const uint64_t t0 = Now();
    starter.WorkersStarted(t0);
    starter.Poll(t0 + 1, true);
    std::string why;
    std::optional<WarmProcess> next = pool.Take(0, group.InterpreterEnvironment(), &why);
    if (low) {
      ASSERT_TRUE(next.has_value()) << why;
      next->process.Terminate(0);
    } else {
      EXPECT_FALSE(next.has_value());
      EXPECT_EQ(why, "no warm interpreter was ready");
      starter.Poll(t0 + WarmStarter::kPrepareFallbackNs, true);
      next = pool.Take(0, group.InterpreterEnvironment(), &why);
      ASSERT_TRUE(next.has_value()) << why;
      next->process.Terminate(0);
    }
    group.Stop(0);
  }
}

// The module list file: a round trip, and what a reader refuses.
TEST_F(WarmStarterTest, ModuleListFileRoundTripAndRefusals) {
  EXPECT_EQ(ModuleListFile("", "/usr/bin/python3", "/a.py"), "");
  const std::string a = ModuleListFile(dir_.string(), "/usr/bin/python3", "/a.py");
  EXPECT_EQ(a, ModuleListFile(dir_.string(), "/usr/bin/python3", "/a.py"));  // stable
  EXPECT_NE(a, ModuleListFile(dir_.string(), "/usr/bin/python3", "/b.py"));
  EXPECT_NE(a, ModuleListFile(dir_.string(), "/venv/bin/python", "/a.py"));
  EXPECT_TRUE(absl::IsNotFound(ReadModuleListFile(a, "/usr/bin/python3", "/a.py").status()));
  ASSERT_TRUE(WriteModuleListFile(a, "/usr/bin/python3", "/a.py", {"torch", "torch._dynamo", "sympy"}).ok());
  absl::StatusOr<std::vector<std::string>> got = ReadModuleListFile(a, "/usr/bin/python3", "/a.py");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<std::string>{"torch", "torch._dynamo", "sympy"}));
  // Written for another script (a hash collision, a copied file): not used.
  EXPECT_TRUE(absl::IsNotFound(ReadModuleListFile(a, "/usr/bin/python3", "/b.py").status()));
  // Lines that are not module names are skipped.
  std::ofstream(a, std::ios::app) << "os; rm -rf /\n../x\njson\n_sysconfigdata__x86_64-linux-gnu\n";
  got = ReadModuleListFile(a, "/usr/bin/python3", "/a.py");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, (std::vector<std::string>{"torch", "torch._dynamo", "sympy", "json",
                                            "_sysconfigdata__x86_64-linux-gnu"}));
  // No temp files left beside it.
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(fs::path(a).parent_path())) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1u);
}

}  // namespace
}  // namespace ballast::agent
