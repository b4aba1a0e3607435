// SlurmScheduler against stand-ins for srun, scancel, sinfo, squeue and
// scontrol (shell scripts in a temp dir): what it runs and how it reads their
// answers. The real Slurm is in tests/slurm (label `slurm`).
#include "scheduler/slurm/slurm_scheduler.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/node_manager.h"

namespace ballast::scheduler::slurm {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class FakeSlurm {
 public:
  FakeSlurm() {
    char tmpl[] = "/tmp/ballast-fake-slurm-XXXXXX";
    dir_ = mkdtemp(tmpl);
    // srun: logs its options, then runs the command after them (the first
    // argument that is not an option), as the step's task would.
    Script("srun", R"(echo "$@" >> "$D/srun.log"
while [ $# -gt 0 ]; do case "$1" in --*) shift;; *) break;; esac; done
exec "$@")");
    Script("scancel", R"(echo "$@" >> "$D/scancel.log")");
    Script("sinfo", R"(cat "$D/states" 2>/dev/null; echo "$@" >> "$D/sinfo.log")");
    Script("squeue", R"(cat "$D/steps" 2>/dev/null)");
    Script("scontrol", R"(if [ "$1" = show ]; then cat "$D/hostnames"; exit 0; fi
echo "$@" >> "$D/scontrol.log"; if [ -f "$D/deny" ]; then echo "slurm_update error: Access/permission denied" >&2; exit 1; fi)");
    Write("hostnames", "n1\nn2\nn3\n");
  }
  ~FakeSlurm() { fs::remove_all(dir_); }

  void Script(const std::string& name, const std::string& body) {
    const std::string path = dir_ + "/" + name;
    Write(name, "#!/bin/sh\nD=" + dir_ + "\n" + body + "\n");
    chmod(path.c_str(), 0755);
  }
  void Write(const std::string& name, const std::string& text) { std::ofstream(dir_ + "/" + name) << text; }
  std::string Read(const std::string& name) const {
    std::ifstream in(dir_ + "/" + name);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  SlurmTools Tools() const {
    SlurmTools t;
    t.srun = dir_ + "/srun";
    t.scancel = dir_ + "/scancel";
    t.sinfo = dir_ + "/sinfo";
    t.squeue = dir_ + "/squeue";
    t.scontrol = dir_ + "/scontrol";
    return t;
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

SlurmSchedulerOptions Options(const FakeSlurm& fake, const std::string& agent_script) {
  SlurmSchedulerOptions o;
  o.allocation.job_id = "42";
  o.allocation.nodelist = "n[1-3]";
  o.allocation.nodes = {"n1", "n2", "n3"};
  o.tools = fake.Tools();
  o.node_state_poll_s = 0;  // read states on every Poll
  o.command_for = [agent_script](const NodeRequest&) {
    return LocalCommand{{"/bin/sh", "-c", agent_script}, {{"BALLAST_X", "yes"}}};
  };
  return o;
}

NodeRequest Req(const std::string& name, int rank) { return NodeRequest{name, rank, 1, {}}; }

template <typename Pred>
std::vector<NodeEvent> PollUntil(SlurmScheduler& s, Pred done) {
  std::vector<NodeEvent> all;
  for (int i = 0; i < 300 && !done(all); ++i) {
    for (auto& e : s.Poll()) all.push_back(e);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return all;
}

TEST(ReadAllocation, ExpandsTheNodeListAndChecksTheCount) {
  FakeSlurm fake;
  auto a = ReadAllocation({{"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "n[1-3]"}, {"SLURM_JOB_NUM_NODES", "3"},
                           {"SLURMD_NODENAME", "n1"}},
                          fake.Tools());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->nodes, (std::vector<std::string>{"n1", "n2", "n3"}));
  EXPECT_EQ(a->batch_host, "n1");
  EXPECT_EQ(a->Describe(), "Slurm job 7 (n[1-3]: 3 nodes)");

  auto outside = ReadAllocation({}, fake.Tools());
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("sbatch -N NODES --no-kill"));

  auto wrong = ReadAllocation({{"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "n[1-3]"}, {"SLURM_JOB_NUM_NODES", "5"}},
                              fake.Tools());
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("SLURM_JOB_NUM_NODES=5 contradicts"));

  auto no_list = ReadAllocation({{"SLURM_JOB_ID", "7"}}, fake.Tools());
  EXPECT_THAT(std::string(no_list.status().message()), HasSubstr("SLURM_JOB_NODELIST is not set"));

  SlurmTools missing = fake.Tools();
  missing.scontrol = fake.dir() + "/no-such-scontrol";
  auto no_tool = ReadAllocation({{"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "n1"}}, missing);
  EXPECT_THAT(std::string(no_tool.status().message()), HasSubstr("is the Slurm client installed"));
}

TEST(NodeStateIsLost, DownDrainFailAndNotResponding) {
  for (const char* s : {"down", "down*", "drained", "draining", "fail", "allocated*", "mixed*", "idle*",
                        "DOWN+DRAIN"}) {
    EXPECT_TRUE(NodeStateIsLost(s)) << s;
  }
  for (const char* s : {"allocated", "mixed", "idle", "completing", ""}) EXPECT_FALSE(NodeStateIsLost(s)) << s;
}

TEST(SlurmScheduler, NamesFreeNodesInOrderAndNeverReusesOne) {
  FakeSlurm fake;
  SlurmScheduler s(Options(fake, "sleep 30"));
  EXPECT_EQ(s.NextNodeName(0, 1), "n1");
  EXPECT_EQ(s.NextNodeName(1, 1), "n2");
  ASSERT_TRUE(s.LaunchNode(Req("n1", 0)).ok());
  ASSERT_TRUE(s.LaunchNode(Req("n2", 1)).ok());
  EXPECT_EQ(s.FreeNodes(), std::vector<std::string>{"n3"});
  ASSERT_TRUE(s.ReleaseNode("n2", "lost: heartbeat timeout", 0.1).ok());
  // n2 is not reused: the replacement goes to n3, then nothing is left.
  EXPECT_EQ(s.NextNodeName(1, 2), "n3");
  ASSERT_TRUE(s.LaunchNode(Req("n3", 1)).ok());
  const std::string none = s.NextNodeName(1, 3);
  absl::Status refused = s.LaunchNode(Req(none, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("no free node left in Slurm job 42"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("n2: lost: heartbeat timeout"));
  EXPECT_EQ(s.LaunchNode(Req("n2", 1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.LaunchNode(Req("n1", 0)).code(), absl::StatusCode::kAlreadyExists);
}

TEST(SlurmScheduler, RunsOneOverlappingStepPerNodeWithTheNodeId) {
  FakeSlurm fake;
  SlurmScheduler s(Options(fake, "echo \"$BALLAST_NODE_ID $BALLAST_X\" > \"$OUT\""));
  setenv("OUT", (fake.dir() + "/agent.out").c_str(), 1);
  ASSERT_TRUE(s.LaunchNode(Req("n2", 1)).ok());
  auto events = PollUntil(s, [](const std::vector<NodeEvent>& all) {
    return std::any_of(all.begin(), all.end(), [](const NodeEvent& e) { return e.kind == NodeEvent::Kind::kExited; });
  });
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, NodeEvent::Kind::kStarted);
  EXPECT_EQ(events[0].host, "n2");
  EXPECT_EQ(events[1].kind, NodeEvent::Kind::kExited);
  EXPECT_TRUE(events[1].status.ok());
  EXPECT_EQ(fake.Read("agent.out"), "n2 yes\n");
  EXPECT_THAT(fake.Read("srun.log"),
              HasSubstr("--overlap --nodes=1 --ntasks=1 --nodelist=n2 --job-name=ballast-agent-n2"));
  // A node whose step ended is not used again either.
  EXPECT_EQ(s.NextNodeName(1, 2), "n1");
  EXPECT_THAT(s.retired().at("n2"), HasSubstr("its agent step ended"));
}

TEST(SlurmScheduler, ReportsNodesSlurmMarksDownOnce) {
  FakeSlurm fake;
  SlurmScheduler s(Options(fake, "sleep 30"));
  ASSERT_TRUE(s.LaunchNode(Req("n1", 0)).ok());
  ASSERT_TRUE(s.LaunchNode(Req("n2", 1)).ok());
  fake.Write("states", "n1|allocated\nn2|allocated*\nn3|idle\n");
  std::vector<NodeEvent> lost;
  for (const NodeEvent& e : s.Poll()) {
    if (e.kind == NodeEvent::Kind::kLost) lost.push_back(e);
  }
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].name, "n2");
  EXPECT_EQ(lost[0].reason, "Slurm reports node n2 allocated*");
  EXPECT_THAT(fake.Read("sinfo.log"), HasSubstr("--nodes=n1,n2"));
}

TEST(SlurmScheduler, ReleaseCancelsTheNodesStepWithoutWaiting) {
  FakeSlurm fake;
  // The agent ignores SIGTERM: the release must not wait for it.
  SlurmScheduler s(Options(fake, "trap '' TERM; sleep 30"));
  ASSERT_TRUE(s.LaunchNode(Req("n1", 0)).ok());
  ASSERT_TRUE(s.LaunchNode(Req("n3", 2)).ok());
  fake.Write("steps", "42.0 ballast-agent-n1\n42.1 ballast-agent-n3\n42.batch batch\n");
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(s.ReleaseNode("n3", "excluded: failed the pre-flight check", 30).ok());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_EQ(fake.Read("scancel.log"), "--quiet 42.1\n");
  EXPECT_EQ(s.RunningNodes(), std::vector<std::string>{"n1"});
  EXPECT_EQ(s.ReleaseNode("n3", "again", 0).code(), absl::StatusCode::kNotFound);
  s.StopAll(0.2);
  EXPECT_TRUE(s.RunningNodes().empty());
  EXPECT_THAT(fake.Read("scancel.log"), HasSubstr("--quiet 42.0"));  // still running after the grace
}

TEST(SlurmScheduler, DrainSaysWhenSlurmDoesNotPermitIt) {
  FakeSlurm fake;
  SlurmScheduler s(Options(fake, "true"));
  ASSERT_TRUE(s.Drain("n2", "ballast: failed the pre-flight check").ok());
  EXPECT_EQ(fake.Read("scontrol.log"), "update nodename=n2 state=drain reason=ballast: failed the pre-flight check\n");
  fake.Write("deny", "");
  absl::Status denied = s.Drain("n3", "x");
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(denied.message()), HasSubstr("does not permit"));
}

// NodeManager over the Slurm backend: a lost node is replaced on the next
// free node; with none left the job goes on without it.
TEST(SlurmScheduler, NodeManagerReplacesOnFreeNodesThenRunsOut) {
  FakeSlurm fake;
  SlurmScheduler s(Options(fake, "sleep 30"));
  NodeManagerOptions nmo;
  nmo.initial_nodes = 2;
  nmo.max_replacements = 5;
  nmo.release_grace_s = 0.1;
  nmo.name = [&s](int rank, int inc) { return s.NextNodeName(rank, inc); };
  NodeManager nodes(&s, nmo);
  ASSERT_TRUE(nodes.Start().ok());
  nodes.Poll(false);
  EXPECT_EQ(s.RunningNodes(), (std::vector<std::string>{"n1", "n2"}));
  nodes.OnNodeLost("n2", "heartbeat timeout");
  nodes.Poll(false);
  EXPECT_EQ(s.RunningNodes(), (std::vector<std::string>{"n1", "n3"}));
  nodes.OnNodeLost("n3", "heartbeat timeout");
  nodes.Poll(false);
  EXPECT_EQ(s.RunningNodes(), std::vector<std::string>{"n1"});
  EXPECT_FALSE(nodes.Exhausted());  // n1 still trains
}

}  // namespace
}  // namespace ballast::scheduler::slurm
