// End-to-end flash checkpoint under `ballast launch`: real agents owning the
// shared-memory stores, the master committing steps, real PyTorch DDP workers
// (gloo) using ballast.Checkpointer (tests/integration/scripts/train_ckpt.py).
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "harness.h"

namespace ballast::testing {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int kSteps = 12;
constexpr int kKillStep = 5;
constexpr int kWorld = 4;

std::vector<std::string> LaunchCkpt(const std::string& out, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {BallastBin(), "launch", "--python", Python(), "--nodes", "2",
                                   "--nproc-per-node", "2", "--max-restarts", "2",
                                   Script("train_ckpt.py"), "--out", out, "--ckpt", out + "/ckpt",
                                   "--steps", std::to_string(kSteps)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// The sha256 of the final weights each rank logged in its "done" event.
std::map<int, std::string> FinalHashes(const std::string& dir) {
  std::map<int, std::string> out;
  for (int rank = 0; rank < kWorld; ++rank) {
    auto done = EventsOfKind(dir, rank, "done");
    if (done.size() == 1) out[rank] = done[0]["sha256"].get<std::string>();
  }
  return out;
}

bool PythonPackageBuilt() {
  return fs::exists(fs::path(BallastBin()).parent_path() / ".." / "python" / "ballast" / "__init__.py");
}

// One worker SIGKILLed right after a step that lived only in memory: the
// agents persist it (breakpoint save), the restarted workers restore it from
// memory, and training ends with the same weights as an uninterrupted run.
TEST(FlashCheckpoint, KilledWorkerRestoresFromMemoryAndMatchesAnUninterruptedRun) {
  ASSERT_TRUE(PythonPackageBuilt()) << "the ballast Python package is not built: run `make` (target ballast_python)";
  TempDir ref;
  {
    Proc launch(LaunchCkpt(ref.path(), {}), ref / "launch.log");
    ASSERT_EQ(launch.Wait(240), 0) << launch.Output();
  }
  std::map<int, std::string> want = FinalHashes(ref.path());
  ASSERT_EQ(want.size(), static_cast<size_t>(kWorld)) << ReadFile(ref / "launch.log");
  for (int rank = 0; rank < kWorld; ++rank) {
    auto loads = EventsOfKind(ref.path(), rank, "load");
    ASSERT_EQ(loads.size(), 1u);
    EXPECT_TRUE(loads[0]["source"].is_null()) << loads[0].dump();  // a fresh start
    auto starts = EventsOfKind(ref.path(), rank, "start");
    ASSERT_EQ(starts.size(), 1u);
    // Every worker got its own agent-owned store.
    EXPECT_THAT(starts[0]["shm"].get<std::string>(), ::testing::StartsWith("/ballast-"));
  }

  TempDir dir;
  Proc launch(LaunchCkpt(dir.path(), {"--kill-step", std::to_string(kKillStep), "--kill-rank", "1"}),
              dir / "launch.log");
  ASSERT_EQ(launch.Wait(240), 0) << launch.Output();
  const std::string log = launch.Output();

  ASSERT_EQ(EventsOfKind(dir.path(), 1, "kill").size(), 1u) << log;
  for (int rank = 0; rank < kWorld; ++rank) {
    auto loads = EventsOfKind(dir.path(), rank, "load");
    ASSERT_EQ(loads.size(), 2u) << "rank " << rank << "\n" << log;
    EXPECT_TRUE(loads[0]["source"].is_null()) << loads[0].dump();
    // The restarted worker found the killed step in the agent's memory.
    EXPECT_EQ(loads[1]["source"], "memory") << "rank " << rank << ": " << loads[1].dump();
    EXPECT_EQ(loads[1]["step"], kKillStep) << loads[1].dump();
    EXPECT_EQ(loads[1]["restart"], 1);
    // The store survived the worker: the same name in both attempts.
    auto starts = EventsOfKind(dir.path(), rank, "start");
    ASSERT_EQ(starts.size(), 2u);
    EXPECT_EQ(starts[0]["shm"], starts[1]["shm"]);
  }

  // Bit-for-bit the uninterrupted run's weights.
  EXPECT_EQ(FinalHashes(dir.path()), want);
  for (int rank = 0; rank < kWorld; ++rank) {
    const std::string name = absl::StrCat("/final-rank", rank, ".pt");
    EXPECT_TRUE(fs::exists(dir.path() + name)) << name;
  }

  // The in-memory-only step reached disk through the breakpoint save on both
  // nodes (all four ranks), and the master had it committed.
  EXPECT_NE(log.find(absl::StrCat("breakpoint save: step ", kKillStep, " of rank")), std::string::npos) << log;
  for (int rank = 0; rank < kWorld; ++rank)
    EXPECT_NE(log.find(absl::StrCat("breakpoint save: step ", kKillStep, " of rank ", rank)), std::string::npos)
        << "rank " << rank << "\n" << log;
  EXPECT_NE(log.find(absl::StrCat("checkpoint step ", kKillStep, " durable on all ", kWorld, " ranks")),
            std::string::npos)
      << log;

  // `latest` names the final step, whose shards are all there.
  std::string latest(absl::StripAsciiWhitespace(ReadFile(dir / "ckpt/latest")));
  EXPECT_EQ(latest, std::to_string(kSteps - 1));
  for (int rank = 0; rank < kWorld; ++rank)
    EXPECT_TRUE(fs::exists(absl::StrCat(dir.path(), "/ckpt/step-", kSteps - 1, "/rank-", rank, ".ballast")));
  EXPECT_TRUE(fs::exists(absl::StrCat(dir.path(), "/ckpt/step-", kSteps - 1, "/COMPLETE")));

  // The agents unlinked their stores when they exited.
  for (int rank = 0; rank < kWorld; ++rank) {
    std::string shm = EventsOfKind(dir.path(), rank, "start")[0]["shm"].get<std::string>();
    EXPECT_FALSE(fs::exists("/dev/shm" + shm)) << shm;
  }
}

}  // namespace
}  // namespace ballast::testing
