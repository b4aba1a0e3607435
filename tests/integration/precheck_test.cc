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

std::vector<std::string> Launch(int nodes, std::vector<std::string> flags) {
  std::vector<std::string> argv = {BallastBin(), "launch", "--nodes", std::to_string(nodes), "--nproc-per-node",
                                   "1", "--network-check", "--python", Python()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(Script("env_dump.py"));
  return argv;
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
  Proc launch(Launch(nodes, {"--chaos", "check-fail:node=" + std::to_string(bad)}), dir / "launch.log",
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
  Proc launch(Launch(3, {"--chaos", "check-fail:node=2"}), dir / "launch.log", CheckEnv(dir));
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
  Proc launch(Launch(4, {"--chaos", "check-slow:node=2,factor=2000"}), dir / "launch.log", CheckEnv(dir));
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
  Proc launch(Launch(4, {"--exclude-stragglers", "--chaos", "check-slow:node=2,factor=2000"}), dir / "launch.log",
              CheckEnv(dir));
  ASSERT_EQ(launch.Wait(300), 0) << launch.Output();
  std::string log = launch.Output();
  std::set<std::string> excluded = Excluded(log);
  ASSERT_EQ(excluded.size(), 1u) << log;
  EXPECT_NE(log.find("a straggler in the pre-flight check (--exclude-stragglers)"), std::string::npos) << log;
  EXPECT_NE(log.find("1 node replacement(s)"), std::string::npos) << log;
  ExpectTrainedOn(dir, 4, log);
}

}  // namespace
}  // namespace ballast::testing
