// End-to-end tests of the pre-flight check (`ballast launch --network-check`):
// real master and agents, real check workers (torch gloo matmul + allreduce),
// faults injected with --chaos. Kept light: 1 worker per node, tiny check
// sizes, and a training script that only dumps its environment.
#include <regex>
#include <set>

#include "harness.h"

namespace ballast::testing {
namespace {

std::map<std::string, std::string> CheckEnv(const TempDir& dir) {
  return {{"OUT_DIR", dir.path()},
          {"BALLAST_PRECHECK_MATMUL_SIZE", "64"},
          {"BALLAST_PRECHECK_ALLREDUCE_BYTES", "4096"},
          {"BALLAST_PRECHECK_TIMEOUT_S", "90"}};
}

// `nodes`: --nodes, e.g. "4" or "1:2".
std::vector<std::string> Launch(const std::string& nodes, std::vector<std::string> flags,
                                std::vector<std::string> script = {Script("env_dump.py")}) {
  std::vector<std::string> argv = {BallastBin(), "launch", "--nodes", nodes, "--nproc-per-node",
                                   "1", "--network-check", "--python", Python()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), script.begin(), script.end());
  return argv;
}

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

std::set<std::string> Matches(const std::string& text, const std::string& pattern) {
  std::set<std::string> out;
  std::regex re(pattern);
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    out.insert((*it)[1].str());
  }
  return out;
}

// The node ids the master excluded, and those whose check the chaos failed.
std::set<std::string> Excluded(const std::string& log) { return Matches(log, R"(node=(\S+) excluded from the job)"); }
std::set<std::string> ChaosFailed(const std::string& log) {
  return Matches(log, R"(injected check failure node=(\S+))");
}

void ExpectTrainedOn(const TempDir& dir, int nodes, const std::string& log) {
  for (int rank = 0; rank < nodes; ++rank) {
    EXPECT_TRUE(std::filesystem::exists(dir / ("env-rank" + std::to_string(rank) + ".json")))
        << "rank " << rank << "\n" << log;
  }
}

void RunCheckFailOneOf(int nodes, int bad) {
  TempDir dir;
  Proc launch(Launch(std::to_string(nodes), {"--chaos", "check-fail:node=" + std::to_string(bad)}), dir / "launch.log",
              CheckEnv(dir));
  ASSERT_EQ(launch.Wait(300), 0) << launch.Output();
  std::string log = launch.Output();
  std::set<std::string> excluded = Excluded(log);
  ASSERT_EQ(excluded.size(), 1u) << log;
  EXPECT_EQ(excluded, ChaosFailed(log)) << log;
  EXPECT_NE(log.find("failed the pre-flight check"), std::string::npos) << log;
  EXPECT_NE(log.find("this node was excluded from the job"), std::string::npos) << log;
  EXPECT_NE(log.find("1 node replacement(s)"), std::string::npos) << log;
  // The replacement (a new node id) was checked before training started.
  EXPECT_NE(log.find("all " + std::to_string(nodes) + " nodes passed the pre-flight check"), std::string::npos)
      << log;
  EXPECT_NE(log.find("on " + std::to_string(nodes) + " nodes of round 1 exited 0"), std::string::npos) << log;
  ExpectTrainedOn(dir, nodes, log);
}

// 4 nodes, node 1 fails the check: found in round 2, excluded, replaced.
TEST(Precheck, FourNodesFailingNodeIsExcludedAndReplaced) { RunCheckFailOneOf(4, 1); }

// 5 nodes, node 3 fails: rounds 1 and 2 leave it with a partner (the group of
// three), the suspect round clears the partner.
TEST(Precheck, FiveNodesFailingNodeIsFoundByTheSuspectRound) { RunCheckFailOneOf(5, 3); }

// 3 nodes: a failure cannot be localized, so the job fails and says why.
TEST(Precheck, ThreeNodesWithAFailureAllFailTheCheck) {
  TempDir dir;
  Proc launch(Launch("3", {"--chaos", "check-fail:node=2"}), dir / "launch.log", CheckEnv(dir));
  ASSERT_EQ(launch.Wait(300), 1) << launch.Output();
  std::string log = launch.Output();
  EXPECT_NE(log.find("cannot be localized"), std::string::npos) << log;
  EXPECT_NE(log.find("all nodes fail the check"), std::string::npos) << log;
  EXPECT_TRUE(Excluded(log).empty()) << log;
  EXPECT_FALSE(std::filesystem::exists(dir / "env-rank0.json")) << "training must not start\n" << log;
}

// A slow node is reported as a straggler and stays in the job.
TEST(Precheck, StragglerIsReportedAndKept) {
  TempDir dir;
  Proc launch(Launch("4", {"--chaos", "check-slow:node=2,factor=2000"}), dir / "launch.log", CheckEnv(dir));
  ASSERT_EQ(launch.Wait(300), 0) << launch.Output();
  std::string log = launch.Output();
  std::set<std::string> stragglers = Matches(log, R"(node=(\S+) is a straggler in the pre-flight check)");
  EXPECT_EQ(stragglers.size(), 1u) << log;
  EXPECT_TRUE(Excluded(log).empty()) << log;
  EXPECT_NE(log.find("0 node replacement(s)"), std::string::npos) << log;
  ExpectTrainedOn(dir, 4, log);
}

// With --exclude-stragglers the slow node is excluded and replaced.
TEST(Precheck, StragglerIsReplacedWithExcludeStragglers) {
  TempDir dir;
  Proc launch(Launch("4", {"--exclude-stragglers", "--chaos", "check-slow:node=2,factor=2000"}), dir / "launch.log",
              CheckEnv(dir));
  ASSERT_EQ(launch.Wait(300), 0) << launch.Output();
  std::string log = launch.Output();
  std::set<std::string> excluded = Excluded(log);
  ASSERT_EQ(excluded.size(), 1u) << log;
  EXPECT_NE(log.find("a straggler in the pre-flight check (--exclude-stragglers)"), std::string::npos) << log;
  EXPECT_NE(log.find("1 node replacement(s)"), std::string::npos) << log;
  ExpectTrainedOn(dir, 4, log);
}

// A node lost mid-training is replaced while the job trains on: the
// replacement is checked (alone: the member is busy) before it may join, a
// replacement that fails is excluded and replaced again without stopping
// training, and the one that passes scales the job back up.
TEST(Precheck, NodeJoiningARunningJobIsCheckedBeforeItJoins) {
  TempDir dir;
  Proc launch(Launch("1:2",
                     {"--chaos", "kill-agent:node=1,after=2;check-fail:node=1,incarnation=2"},
                     {Example("train_ddp.py"), "--out", dir.path(), "--steps", "150", "--step-time", "0.2"}),
              dir / "launch.log", CheckEnv(dir));
  ASSERT_EQ(launch.Wait(300), 0) << launch.Output();
  std::string log = launch.Output();
  EXPECT_NE(log.find("chaos: kill-agent:node=1,after=2 ("), std::string::npos) << log;
  EXPECT_NE(log.find("scale down to 1 nodes"), std::string::npos) << log;
  // Both replacements were checked while training went on; the first failed.
  EXPECT_EQ(Count(log, ") while the job trains"), 2u) << log;
  std::set<std::string> excluded = Excluded(log);
  ASSERT_EQ(excluded.size(), 1u) << log;
  EXPECT_EQ(excluded, ChaosFailed(log)) << log;
  EXPECT_NE(log.find("all 1 joining node(s) passed the pre-flight check"), std::string::npos) << log;
  EXPECT_NE(log.find("2 node replacement(s)"), std::string::npos) << log;
  // Rounds: 1 (2 nodes), 2 (scale down), 3 (scale up): the failed check did
  // not stop the training member.
  EXPECT_NE(log.find("round=3 starts: 2 nodes"), std::string::npos) << log;
  EXPECT_NE(log.find("on 2 nodes of round 3 exited 0"), std::string::npos) << log;
  EXPECT_EQ(LastStep(dir.path(), 1), 150) << log;
}

// `ballast master --network-check` checks nodes whose agents did not ask for
// it (--exclude-stragglers alone excludes runtime stragglers: test_drills.py).
TEST(Precheck, MasterFlagTurnsTheCheckOn) {
  TempDir dir;
  Proc master({BallastBin(), "master", "--nnodes", "2", "--network-check", "--host", "127.0.0.1",
               "--advertise-host", "127.0.0.1", "--port", "0", "--token", "t0k"},
              dir / "master.log", CheckEnv(dir));
  std::string addr = WaitForMasterAddress(master);
  ASSERT_FALSE(addr.empty()) << master.Output();
  EXPECT_NE(master.Output().find("pre-flight check on"), std::string::npos) << master.Output();
  std::vector<std::unique_ptr<Proc>> agents;
  for (int i = 0; i < 2; ++i) {
    agents.push_back(std::make_unique<Proc>(
        std::vector<std::string>{BallastBin(), "run", "--rdzv-endpoint", addr, "--token", "t0k", "--nnodes", "2",
                                 "--node-rank", std::to_string(i), "--nproc-per-node", "1", "--python", Python(),
                                 Script("env_dump.py")},
        dir / ("agent" + std::to_string(i) + ".log"), CheckEnv(dir)));
  }
  for (auto& a : agents) EXPECT_EQ(a->Wait(120), 0) << a->Output();
  ASSERT_EQ(master.Wait(60), 0) << master.Output();
  EXPECT_NE(master.Output().find("all 2 nodes passed the pre-flight check"), std::string::npos) << master.Output();
  ExpectTrainedOn(dir, 2, master.Output());
}

}  // namespace
}  // namespace ballast::testing
