// Hang detection end to end: the real `ballast launch`, real PyTorch DDP
// workers on gloo that report progress with ballast.step(); one worker sleeps
// forever mid-training on the first attempt.
#include <time.h>

#include <regex>

#include "harness.h"

namespace ballast::testing {
namespace {

constexpr double kHangTimeoutS = 3;

// Seconds since local midnight of an epoch time (the agent logs local %H:%M:%S.%e).
double LocalTimeOfDay(double epoch_s) {
  time_t t = static_cast<time_t>(epoch_s);
  tm local;
  localtime_r(&t, &local);
  return local.tm_hour * 3600.0 + local.tm_min * 60.0 + local.tm_sec + (epoch_s - static_cast<double>(t));
}

// The time of day of the first hang detection log line ("... hung: no
// progress ..."), -1 if none.
double HangLogTimeOfDay(const std::string& log) {
  static const std::regex re(R"(\[ballast [^\]]*?(\d\d):(\d\d):(\d\d)\.(\d{3})\][^\n]*hung: no progress)");
  std::smatch m;
  if (!std::regex_search(log, m, re)) return -1;
  return std::stoi(m[1]) * 3600.0 + std::stoi(m[2]) * 60.0 + std::stoi(m[3]) + std::stoi(m[4]) / 1000.0;
}

// 2 ranks, --hang-timeout 3: rank 1 sleeps forever at step 3 of the first
// attempt while rank 0 waits for it in the gradient allreduce. The agents
// notice within the timeout + 2 s of the last progress and log the workers'
// Python stacks; rank 1, the one outside a collective, is blamed; the master
// restarts the workers in place, and the second attempt resumes and finishes
// every step. `nodes` x `nproc` = 2: on one node the agent picks the rank to
// blame, on two nodes the master does, from both agents' hang reports.
void RunHangTest(int nodes, int nproc) {
  TempDir dir;
  const int steps = 8;
  std::vector<std::string> argv = {BallastBin(), "launch", "--python", Python(), "--nodes", std::to_string(nodes),
                                   "--nproc-per-node", std::to_string(nproc), "--max-restarts", "2", "--hang-timeout",
                                   std::to_string(static_cast<int>(kHangTimeoutS)),
                                   Example("train_ddp.py"), "--out", dir.path(), "--steps", std::to_string(steps),
                                   "--step-time", "0.1", "--hang-rank", "1", "--hang-step", "3"};
  // Imports and rendezvous on a busy test machine may take a while: the
  // first-step grace is generous, the hang timeout is not.
  Proc launch(argv, dir / "launch.log", {{"BALLAST_HANG_FIRST_STEP_GRACE_S", "60"}});
  ASSERT_EQ(launch.Wait(240), 0) << launch.Output();
  const std::string out = launch.Output();

  // Rank 1 hung once, after its step-3 progress report.
  auto hangs = EventsOfKind(dir.path(), 1, "hang");
  ASSERT_EQ(hangs.size(), 1u) << out;
  double last_progress = 0;
  for (auto& e : EventsOfKind(dir.path(), 1, "step"))
    if (e["restart"] == 0) last_progress = std::max(last_progress, e["t"].get<double>());
  ASSERT_GT(last_progress, 0) << out;

  // Detected within hang-timeout + 2 s of the last progress, not before the timeout.
  double hung_at = HangLogTimeOfDay(out);
  ASSERT_GE(hung_at, 0) << "no hang detection line:\n" << out;
  double latency = hung_at - LocalTimeOfDay(last_progress);
  if (latency < -43200) latency += 86400;  // across midnight
  EXPECT_GE(latency, kHangTimeoutS - 0.5) << out;
  EXPECT_LE(latency, kHangTimeoutS + 2) << out;

  // The Python stacks of the workers reached the log (faulthandler on SIGUSR1).
  EXPECT_NE(out.find("most recent call first"), std::string::npos) << out;
  EXPECT_NE(out.find("hang_forever"), std::string::npos) << out;
  EXPECT_NE(out.find("train_ddp.py"), std::string::npos) << out;
  EXPECT_NE(out.find("hung (no progress)"), std::string::npos) << out;
  // The stacks were read: rank 1 sleeps outside any collective, rank 0 waits
  // in one, and rank 1 is blamed.
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(rank 1 \(local rank \d\): stopped outside any collective at \S*train_ddp.py)")))
      << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(rank 0 \(local rank 0\): waiting in a collective at \S*torch/)"))) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(restarting in place \(restart 1 of 2\): worker rank 1 )"))) << out;

  // Restarted once; every rank finished every step in the second attempt.
  for (int rank = 0; rank < 2; ++rank) {
    auto starts = EventsOfKind(dir.path(), rank, "start");
    ASSERT_EQ(starts.size(), 2u) << "rank " << rank << "\n" << out;
    EXPECT_EQ(starts[1]["restart"], 1);
    EXPECT_GE(starts[1]["step"].get<int>(), 3);  // resumed from the checkpoint
    EXPECT_NE(starts[0]["cell"].get<std::string>(), "local") << "no progress cell from the agent";
    auto done = EventsOfKind(dir.path(), rank, "done");
    ASSERT_EQ(done.size(), 1u) << "rank " << rank << "\n" << out;
    EXPECT_EQ(done[0]["step"], steps);
    EXPECT_EQ(LastStep(dir.path(), rank), steps);
  }
}

TEST(Hang, WorkerSleepingForeverIsDetectedDumpedAndRestarted) { RunHangTest(1, 2); }

TEST(Hang, OnTwoNodesTheRankOutsideTheCollectiveIsBlamed) { RunHangTest(2, 1); }

}  // namespace
}  // namespace ballast::testing
