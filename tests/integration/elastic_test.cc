// End-to-end tests of the elastic runtime: the real `ballast` binary, real
// agents, real PyTorch DDP workers on gloo (Debian's python3-torch).
#include <signal.h>

#include <fstream>
#include <regex>
#include <set>

#include "common/net.h"
#include "common/subprocess.h"
#include "harness.h"

namespace ballast::testing {
namespace {

using nlohmann::json;

std::vector<std::string> TrainArgs(const TempDir& dir, int steps, double step_time) {
  return {Example("train_ddp.py"), "--out", dir.path(), "--steps", std::to_string(steps), "--step-time",
          std::to_string(step_time)};
}

std::vector<std::string> Launch(std::vector<std::string> flags, const std::vector<std::string>& script) {
  std::vector<std::string> argv = {BallastBin(), "launch", "--python", Python()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), script.begin(), script.end());
  return argv;
}

// pid of the first worker of `rank` (from its "start" event), -1 if none yet.
pid_t FirstWorkerPid(const std::string& dir, int rank) {
  auto starts = EventsOfKind(dir, rank, "start");
  return starts.empty() ? -1 : starts.front()["pid"].get<pid_t>();
}

pid_t ParentPid(pid_t pid) {
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  char state;
  pid_t ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

// (1) 2 nodes x 2 workers, SIGKILL one worker mid-run: restarted in place once,
// every rank completes all steps, the job exits 0.
TEST(Elastic, WorkerKilledMidRunRestartsInPlaceAndFinishes) {
  TempDir dir;
  Proc launch(Launch({"--nodes", "2", "--nproc-per-node", "2", "--max-restarts", "3"}, TrainArgs(dir, 20, 0.15)),
              dir / "launch.log");
  ASSERT_TRUE(WaitFor([&] { return LastStep(dir.path(), 1) >= 4; }, 120)) << launch.Output();
  pid_t victim = FirstWorkerPid(dir.path(), 1);
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(launch.Wait(180), 0) << launch.Output();
  for (int rank = 0; rank < 4; ++rank) {
    auto done = EventsOfKind(dir.path(), rank, "done");
    ASSERT_EQ(done.size(), 1u) << "rank " << rank << "\n" << launch.Output();
    EXPECT_EQ(done[0]["step"], 20);
    EXPECT_EQ(done[0]["world"], 4);
    EXPECT_EQ(done[0]["restart"], 1) << "rank " << rank;
    EXPECT_EQ(EventsOfKind(dir.path(), rank, "start").size(), 2u) << "rank " << rank;
  }
  EXPECT_NE(launch.Output().find("SIGKILL"), std::string::npos) << launch.Output();
}

// (2) --nodes 1:2, one agent SIGKILLed and not replaced: training continues on
// the remaining node (WORLD_SIZE 2) and finishes.
TEST(Elastic, AgentLostScalesDownToOneNodeAndFinishes) {
  TempDir dir;
  Proc launch(Launch({"--nodes", "1:2", "--nproc-per-node", "2", "--max-replacements", "0"},
                     TrainArgs(dir, 20, 0.15)),
              dir / "launch.log");
  ASSERT_TRUE(WaitFor([&] { return LastStep(dir.path(), 2) >= 4; }, 120)) << launch.Output();
  // The agent of node rank 1 is the parent of global rank 2's worker.
  pid_t agent = ParentPid(FirstWorkerPid(dir.path(), 2));
  ASSERT_GT(agent, 1);
  ASSERT_NE(agent, launch.pid());
  ASSERT_EQ(::kill(agent, SIGKILL), 0);
  ASSERT_EQ(launch.Wait(180), 0) << launch.Output();
  for (int rank = 0; rank < 2; ++rank) {
    auto done = EventsOfKind(dir.path(), rank, "done");
    ASSERT_EQ(done.size(), 1u) << launch.Output();
    EXPECT_EQ(done[0]["world"], 2);
    EXPECT_EQ(done[0]["step"], 20);
  }
  EXPECT_TRUE(EventsOfKind(dir.path(), 2, "done").empty());
}

// (3) An agent joins a running one-node job (--nodes 1:2): the next round has
// WORLD_SIZE 4 and both nodes finish.
TEST(Elastic, AgentJoiningRunningJobScalesUpToFourWorkers) {
  TempDir dir;
  std::map<std::string, std::string> env = {{"BALLAST_TOKEN", "scale-up-token"}};
  Proc launch(Launch({"--nodes", "1:2", "--start-nodes", "1", "--nproc-per-node", "2"}, TrainArgs(dir, 30, 0.15)),
              dir / "launch.log", env);
  ASSERT_TRUE(WaitFor([&] { return LastStep(dir.path(), 0) >= 3; }, 120)) << launch.Output();
  std::string addr = MasterAddressFromLog(launch.Output());
  ASSERT_FALSE(addr.empty()) << launch.Output();
  std::vector<std::string> run = {BallastBin(), "run", "--rdzv-endpoint", addr, "--nnodes", "1:2",
                                  "--nproc_per_node", "2", "--python", Python()};
  auto script = TrainArgs(dir, 30, 0.15);
  run.insert(run.end(), script.begin(), script.end());
  Proc joiner(run, dir / "joiner.log", env);
  ASSERT_EQ(launch.Wait(180), 0) << launch.Output() << "\n--- joiner:\n" << joiner.Output();
  EXPECT_EQ(joiner.Wait(30), 0) << joiner.Output();
  for (int rank = 0; rank < 4; ++rank) {
    auto done = EventsOfKind(dir.path(), rank, "done");
    ASSERT_EQ(done.size(), 1u) << "rank " << rank << "\n" << launch.Output();
    EXPECT_EQ(done[0]["world"], 4);
    EXPECT_EQ(done[0]["step"], 30);
  }
  // Rank 0 first trained alone (world 2), then in the bigger world.
  auto starts = EventsOfKind(dir.path(), 0, "start");
  ASSERT_GE(starts.size(), 2u);
  EXPECT_EQ(starts.front()["world"], 2);
  EXPECT_EQ(starts.back()["world"], 4);
}

// (4) A worker that always fails: the job fails after --max-restarts with the
// node, rank, exit code and the worker's last stderr lines in the message.
TEST(Elastic, AlwaysFailingWorkerFailsJobAfterMaxRestarts) {
  TempDir dir;
  auto script = TrainArgs(dir, 10, 0.05);
  script.insert(script.end(), {"--fail-rank", "1", "--fail-step", "1"});
  Proc launch(Launch({"--nodes", "1", "--nproc-per-node", "2", "--max-restarts", "2"}, script), dir / "launch.log");
  EXPECT_EQ(launch.Wait(180), 1);
  // The final message alone must carry the facts (worker output is forwarded
  // to the console too, so look only after "job ... failed:").
  std::string all = launch.Output();
  auto at = all.rfind("failed:");
  ASSERT_NE(at, std::string::npos) << all;
  std::string out = all.substr(at);
  EXPECT_NE(out.find("rank 1"), std::string::npos) << out;
  EXPECT_NE(out.find("exit code 3"), std::string::npos) << out;
  EXPECT_NE(out.find("injected failure at step 1"), std::string::npos) << out;
  EXPECT_EQ(EventsOfKind(dir.path(), 1, "start").size(), 3u) << all;  // first run + 2 restarts
  EXPECT_TRUE(EventsOfKind(dir.path(), 0, "done").empty());
}

// (5) An agent with the wrong token is refused (UNAUTHENTICATED) and changes
// nothing; so is `ballast status` with a wrong token.
TEST(Elastic, WrongTokenIsRefusedAndChangesNothing) {
  TempDir dir;
  Proc master({BallastBin(), "master", "--nnodes", "1", "--host", "127.0.0.1", "--advertise-host", "127.0.0.1",
               "--port", "0", "--token", "right-token"},
              dir / "master.log");
  std::string addr = WaitForMasterAddress(master);
  ASSERT_FALSE(addr.empty()) << master.Output();
  Proc agent({BallastBin(), "run", "--rdzv-endpoint", addr, "--token", "wrong-token", "--nproc-per-node", "1",
              "--python", Python(), Script("env_dump.py")},
             dir / "agent.log", {{"OUT_DIR", dir.path()}});
  EXPECT_EQ(agent.Wait(60), 1);
  EXPECT_NE(agent.Output().find("token"), std::string::npos) << agent.Output();
  EXPECT_NE(master.Output().find("UNAUTHENTICATED"), std::string::npos) << master.Output();

  // Right token, contradicting settings: refused naming the difference.
  Proc mismatched({BallastBin(), "run", "--rdzv-endpoint", addr, "--token", "right-token", "--nnodes", "2:3",
                   "--nproc-per-node", "1", "--python", Python(), Script("env_dump.py")},
                  dir / "mismatched.log", {{"OUT_DIR", dir.path()}});
  EXPECT_EQ(mismatched.Wait(60), 1);
  EXPECT_NE(mismatched.Output().find("--nnodes 2:3"), std::string::npos) << mismatched.Output();
  EXPECT_NE(mismatched.Output().find("--nnodes 1:1"), std::string::npos) << mismatched.Output();

  Proc status({BallastBin(), "status", "--master", addr, "--token", "right-token", "--json"}, dir / "status.log");
  ASSERT_EQ(status.Wait(30), 0) << status.Output();
  auto js = json::parse(status.Output(), nullptr, false);
  ASSERT_FALSE(js.is_discarded()) << status.Output();
  EXPECT_TRUE(js["nodes"].empty()) << status.Output();
  EXPECT_EQ(js["state"], "rendezvous");

  Proc bad_status({BallastBin(), "status", "--master", addr, "--token", "nope"}, dir / "bad_status.log");
  EXPECT_EQ(bad_status.Wait(30), 1);
  EXPECT_NE(bad_status.Output().find("token"), std::string::npos) << bad_status.Output();
}

// (6) After an agent is SIGKILLed, none of its workers remains.
TEST(Elastic, NoWorkerSurvivesSigkilledAgent) {
  TempDir dir;
  std::vector<std::string> argv = {BallastBin(), "run", "--standalone", "--nproc-per-node", "2", "--python",
                                   Python()};
  auto script = TrainArgs(dir, 1000, 0.2);
  argv.insert(argv.end(), script.begin(), script.end());
  Proc agent(argv, dir / "agent.log");
  ASSERT_TRUE(WaitFor([&] { return LastStep(dir.path(), 0) >= 1 && LastStep(dir.path(), 1) >= 1; }, 120))
      << agent.Output();
  pid_t w0 = FirstWorkerPid(dir.path(), 0), w1 = FirstWorkerPid(dir.path(), 1);
  ASSERT_TRUE(ProcessAlive(w0) && ProcessAlive(w1));
  agent.Kill(SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return !ProcessAlive(w0) && !ProcessAlive(w1); }, 10))
      << "workers " << w0 << "," << w1 << " outlived their agent";
}

// Workers get the torchrun environment, so env:// scripts run unchanged.
TEST(Elastic, WorkersGetTorchrunEnvironment) {
  TempDir dir;
  Proc agent({BallastBin(), "run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "5", "--python",
              Python(), Script("env_dump.py")},
             dir / "agent.log", {{"OUT_DIR", dir.path()}, {"OMP_NUM_THREADS", ""}});
  ASSERT_EQ(agent.Wait(60), 0) << agent.Output();
  std::set<std::string> ports;
  for (int rank = 0; rank < 2; ++rank) {
    auto env = json::parse(ReadFile(dir / ("env-rank" + std::to_string(rank) + ".json")), nullptr, false);
    ASSERT_FALSE(env.is_discarded()) << agent.Output();
    EXPECT_EQ(env["RANK"], std::to_string(rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(env["WORLD_SIZE"], "2");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(env["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "2");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "5");
    EXPECT_FALSE(env["TORCHELASTIC_RUN_ID"].get<std::string>().empty());
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    ports.insert(env["MASTER_PORT"].get<std::string>());
  }
  EXPECT_EQ(ports.size(), 1u);
}

TEST(Elastic, UnknownRunFlagExitsTwo) {
  TempDir dir;
  Proc agent({BallastBin(), "run", "--no-such-flag", "1", "train.py"}, dir / "out.log");
  EXPECT_EQ(agent.Wait(30), 2);
  EXPECT_NE(agent.Output().find("--no-such-flag"), std::string::npos) << agent.Output();
}

TEST(Elastic, UnreachableMasterIsAClearError) {
  TempDir dir;
  auto port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  Proc agent({BallastBin(), "run", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(*port), "--token", "t",
              "--nproc-per-node", "1", "--python", Python(), Script("env_dump.py")},
             dir / "out.log", {{"BALLAST_CONNECT_TIMEOUT_S", "2"}});
  EXPECT_EQ(agent.Wait(60), 1);
  EXPECT_NE(agent.Output().find("cannot reach"), std::string::npos) << agent.Output();
}

}  // namespace
}  // namespace ballast::testing
