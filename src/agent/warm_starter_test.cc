// WarmStarter with a real /usr/bin/python3 behind the pool and the worker
// group, and a fake KV store: what a replacement preloads, and what running
// workers teach the next interpreters.
#include "agent/warm_starter.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "agent/fake_kv.h"
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

}  // namespace
}  // namespace ballast::agent
