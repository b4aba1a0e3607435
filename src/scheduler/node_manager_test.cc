#include "scheduler/node_manager.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::scheduler {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records what the manager asks of a scheduler; tests script its events.
class FakeScheduler : public SchedulerInterface {
 public:
  std::string Kind() const override { return "fake"; }
  absl::Status LaunchNode(const NodeRequest& r) override {
    if (refuse) return absl::UnavailableError("no capacity");
    launched.push_back(r);
    running.insert(r.name);
    return absl::OkStatus();
  }
  absl::Status ReleaseNode(const std::string& name, const std::string& reason, double) override {
    released.push_back(name + ": " + reason);
    if (running.erase(name) == 0) return absl::NotFoundError("unknown");
    return absl::OkStatus();
  }
  std::vector<NodeEvent> Poll() override { return std::exchange(events, {}); }
  std::vector<std::string> RunningNodes() const override { return {running.begin(), running.end()}; }
  void StopAll(double) override { running.clear(); }
  std::vector<AdoptedNode> AdoptedNodes() const override { return adopted; }

  void Exit(const std::string& name, int code) {
    running.erase(name);
    NodeEvent e;
    e.kind = NodeEvent::Kind::kExited;
    e.name = name;
    e.status.exit_code = code;
    events.push_back(e);
  }
  void Started(const std::string& name, const std::string& host) {
    NodeEvent e;
    e.kind = NodeEvent::Kind::kStarted;
    e.name = name;
    e.host = host;
    events.push_back(e);
  }
  void Lost(const std::string& name, const std::string& why) {
    NodeEvent e;
    e.kind = NodeEvent::Kind::kLost;
    e.name = name;
    e.reason = why;
    events.push_back(e);
  }

  bool refuse = false;
  std::vector<AdoptedNode> adopted;
  std::vector<NodeRequest> launched;
  std::vector<std::string> released;
  std::set<std::string> running;
  std::vector<NodeEvent> events;
};

std::vector<std::string> Names(const std::vector<NodeRequest>& rs) {
  std::vector<std::string> out;
  for (const auto& r : rs) out.push_back(r.name);
  return out;
}

struct Harness {
  explicit Harness(int nodes, int budget, bool early = false) {
    NodeManagerOptions o;
    o.initial_nodes = nodes;
    o.max_replacements = budget;
    o.early_replacement = early;
    o.early_keep_s = 30;
    o.on_event = [this](const std::string& reason, const std::string& msg, bool) {
      events.push_back(reason + ": " + msg);
    };
    o.excluded_exit_s = 10;
    o.now = [this] { return clock; };
    manager = std::make_unique<NodeManager>(&sched, o);
  }
  double clock = 100;
  FakeScheduler sched;
  std::vector<std::string> events;
  std::unique_ptr<NodeManager> manager;
};

TEST(NodeManager, StartsOneNodePerRankAndReplacesAnExitedOneAsItsNextIncarnation) {
  Harness h(3, 2);
  ASSERT_TRUE(h.manager->Start().ok());
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-2"));
  h.sched.Exit("node-1", 1);
  h.manager->Poll(false);
  ASSERT_EQ(h.sched.launched.size(), 4u);
  EXPECT_EQ(h.sched.launched[3].name, "node-1-2");
  EXPECT_EQ(h.sched.launched[3].node_rank, 1);
  EXPECT_EQ(h.sched.launched[3].incarnation, 2);
  EXPECT_EQ(h.manager->replacements(), 1);
  ASSERT_EQ(h.events.size(), 1u);
  EXPECT_THAT(h.events[0], HasSubstr("NodeReplaced: node node-1 (node rank 1) is gone (its agent exited: exit code 1)"));
}

// A node the scheduler reports lost (a Ray node death, a Slurm node down)
// is told to the master at once (on_scheduler_lost), then replaced; not when
// the master itself lost it first, nor once the job finished.
TEST(NodeManager, TheSchedulersLossGoesToTheMasterOnceWhileTheJobRuns) {
  std::vector<std::string> told;
  NodeManagerOptions o;
  o.initial_nodes = 3;
  o.max_replacements = 5;
  o.on_scheduler_lost = [&](const std::string& node, const std::string& why) { told.push_back(node + ": " + why); };
  FakeScheduler sched;
  NodeManager manager(&sched, o);
  ASSERT_TRUE(manager.Start().ok());
  sched.Lost("node-1", "its Ray node died");
  manager.Poll(false);
  EXPECT_THAT(told, ElementsAre("node-1: its Ray node died"));
  EXPECT_THAT(Names(sched.launched), ElementsAre("node-0", "node-1", "node-2", "node-1-2"));
  // The master lost node-2 first: the scheduler's word after it adds nothing.
  manager.OnNodeLost("node-2", "heartbeat timeout");
  manager.Poll(false);
  sched.Lost("node-2", "its Ray node died");
  manager.Poll(false);
  sched.Lost("node-0", "its Ray node died");
  manager.Poll(/*job_finished=*/true);
  EXPECT_THAT(told, ElementsAre("node-1: its Ray node died"));
}

// Early replacements (`ballast ray run`): a node whose agent hung up its
// stream gets its next incarnation at once; it is the replacement when the
// node is then lost (placed already: no second launch, counted then).
TEST(NodeManager, ADisconnectedNodesEarlyReplacementTakesItsPlaceWhenItIsLost) {
  Harness h(2, 3, /*early=*/true);
  ASSERT_TRUE(h.manager->Start().ok());
  h.manager->OnNodeDisconnected("node-1");
  h.manager->Poll(false);
  ASSERT_EQ(h.sched.launched.size(), 3u);
  EXPECT_EQ(h.sched.launched[2].name, "node-1-2");
  EXPECT_EQ(h.sched.launched[2].node_rank, 1);
  EXPECT_EQ(h.sched.launched[2].incarnation, 2);
  EXPECT_EQ(h.manager->replacements(), 0);  // not yet: node-1 may come back
  ASSERT_EQ(h.events.size(), 1u);
  EXPECT_THAT(h.events[0], HasSubstr("EarlyReplacement: node node-1 (node rank 1) hung up its connection to the "
                                     "master: starting node-1-2 now"));
  // A second disconnect notice (the master process's status) starts nothing more.
  h.manager->OnNodeDisconnected("node-1");
  h.sched.Started("node-1-2", "ray:bbb@10.0.0.3");
  h.clock += 0.5;
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 3u);
  // Ray's death notice: node-1 is lost; node-1-2 is its replacement.
  h.sched.Lost("node-1", "Ray node died");
  h.manager->Poll(false);
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-1-2"));
  EXPECT_EQ(h.manager->replacements(), 1);
  ASSERT_EQ(h.events.size(), 2u);
  EXPECT_THAT(h.events[1], HasSubstr("NodeReplaced: node node-1 (node rank 1) is gone (Ray node died); replacing it "
                                     "with node-1-2 (started 0.5 s before, when it disconnected) (1/3 replacements"));
  EXPECT_EQ(h.manager->Describe("node-1-2"), "node-1-2 (node rank 1, host ray:bbb@10.0.0.3)");
  // It is the rank's node now: its own loss is replaced as usual, and not
  // released by the early-replacement expiry.
  h.clock += 60;
  h.manager->Poll(false);
  EXPECT_THAT(h.sched.released, ElementsAre("node-1: Ray node died"));  // the lost one only
  h.sched.Exit("node-1-2", 1);
  h.manager->Poll(false);
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-1-2", "node-1-3"));
}

TEST(NodeManager, AnEarlyReplacementIsReleasedWhenItsNodeIsStillThereAndForgottenWhenItEnds) {
  Harness h(2, 3, /*early=*/true);
  ASSERT_TRUE(h.manager->Start().ok());
  h.manager->OnNodeDisconnected("node-0");
  h.manager->Poll(false);
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-0-2"));
  h.clock += 29;
  h.manager->Poll(false);
  EXPECT_TRUE(h.sched.released.empty());
  // node-0 reconnected: 30 s after the disconnect its early one goes.
  h.clock += 1;
  h.manager->Poll(false);
  EXPECT_THAT(h.sched.released, ElementsAre("node-0-2: not needed: node-0 is still in the job"));
  EXPECT_EQ(h.manager->replacements(), 0);
  // The released one's exit, or the master losing it, replaces nothing.
  h.sched.Exit("node-0-2", 143);
  h.manager->OnNodeLost("node-0-2", "agent disconnected");
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 3u);
  // The next disconnect starts incarnation 3 (2 is used up); this one ends by
  // itself before node-0 is lost: forgotten, and the loss launches incarnation 4.
  h.manager->OnNodeDisconnected("node-0");
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.back().name, "node-0-3");
  h.sched.Exit("node-0-3", 1);
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 4u);
  h.manager->OnNodeLost("node-0", "agent disconnected");
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.back().name, "node-0-4");
  EXPECT_EQ(h.sched.launched.back().incarnation, 4);
  EXPECT_EQ(h.manager->replacements(), 1);
  EXPECT_FALSE(h.manager->Exhausted());
}

TEST(NodeManager, NoEarlyReplacementWhenOffOrTheBudgetIsUsedUpOrTheJobFinished) {
  {
    Harness h(2, 3, /*early=*/false);
    ASSERT_TRUE(h.manager->Start().ok());
    h.manager->OnNodeDisconnected("node-1");
    h.manager->Poll(false);
    EXPECT_EQ(h.sched.launched.size(), 2u);
  }
  {
    Harness h(2, 0, /*early=*/true);
    ASSERT_TRUE(h.manager->Start().ok());
    h.manager->OnNodeDisconnected("node-1");
    h.manager->Poll(false);
    EXPECT_EQ(h.sched.launched.size(), 2u);
  }
  {
    Harness h(2, 3, /*early=*/true);
    ASSERT_TRUE(h.manager->Start().ok());
    h.manager->OnNodeDisconnected("node-1");
    h.manager->Poll(/*job_finished=*/true);
    h.manager->OnNodeDisconnected("someone-else");
    h.manager->Poll(false);
    EXPECT_EQ(h.sched.launched.size(), 2u);
  }
  {
    // The budget ran out between the disconnect and the loss (another node's
    // replacement): the early one is released, not kept.
    Harness h(3, 1, /*early=*/true);
    ASSERT_TRUE(h.manager->Start().ok());
    h.manager->OnNodeDisconnected("node-1");
    h.manager->Poll(false);
    h.sched.Exit("node-2", 1);
    h.manager->Poll(false);
    EXPECT_EQ(h.manager->replacements(), 1);
    h.manager->OnNodeLost("node-1", "agent disconnected");
    h.manager->Poll(false);
    EXPECT_THAT(h.sched.released,
                ElementsAre("node-1: agent disconnected", "node-1-2: the replacement budget is used up"));
    EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-2", "node-1-2", "node-2-2"));
  }
}

TEST(NodeManager, MasterLossAndSchedulerExitOfOneNodeReplaceItOnce) {
  Harness h(2, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  // The master lost the agent (heartbeat timeout) while its process still runs.
  h.manager->OnNodeLost("node-0", "heartbeat timeout");
  h.manager->Poll(false);
  EXPECT_THAT(h.sched.released, ElementsAre("node-0: heartbeat timeout"));
  // Then the released agent's exit shows up: no second replacement.
  h.sched.Exit("node-0", 137);
  h.manager->Poll(false);
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-0-2"));
  EXPECT_EQ(h.manager->replacements(), 1);
}

TEST(NodeManager, ExcludedNodesHostIsAvoidedByEveryLaterLaunch) {
  Harness h(2, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  h.sched.Started("node-0", "host-a");
  h.sched.Started("node-1", "host-b");
  h.manager->Poll(false);
  h.manager->OnNodeExcluded("node-1", "failed the pre-flight check");
  h.manager->Poll(false);
  // Its agent exits by itself (after writing what a rollback needs): it is
  // stopped only if it still runs 10 s later, and replaced then.
  EXPECT_EQ(h.sched.launched.size(), 2u);
  EXPECT_FALSE(h.manager->Exhausted());
  h.clock += 9.9;
  h.manager->Poll(false);
  EXPECT_TRUE(h.sched.released.empty());
  EXPECT_EQ(h.sched.launched.size(), 2u);
  h.clock += 0.2;
  h.manager->Poll(false);
  EXPECT_THAT(h.sched.released, ElementsAre("node-1: excluded: failed the pre-flight check"));
  ASSERT_EQ(h.sched.launched.size(), 3u);
  EXPECT_THAT(h.sched.launched[2].avoid_hosts, ElementsAre("host-b"));
  h.clock += 20;
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.released.size(), 1u);
  h.sched.Lost("node-0", "pod deleted");
  h.manager->Poll(false);
  EXPECT_THAT(h.sched.launched.back().avoid_hosts, ElementsAre("host-b"));
  EXPECT_THAT(h.events[0], HasSubstr("NodeExcluded: node node-1 (node rank 1, host host-b) was excluded"));
}

TEST(NodeManager, ExclusionSeenWithTheAgentsExitStillAvoidsTheHost) {
  // The excluded agent exits at once: the notice and the exit (and even the
  // node's start) come in the same poll.
  Harness h(2, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  h.sched.Started("node-1", "host-b");
  h.sched.Exit("node-1", 1);
  h.manager->OnNodeExcluded("node-1", "failed the pre-flight check");
  h.manager->Poll(false);
  ASSERT_EQ(h.sched.launched.size(), 3u);
  EXPECT_THAT(h.sched.launched[2].avoid_hosts, ElementsAre("host-b"));
  EXPECT_EQ(h.manager->replacements(), 1);
}

// SDC: the excluded agent drops the rolled-back steps and writes the rollback
// target, then exits. Stopping it at once (SIGTERM) could overtake that: its
// stop would write its newest steps instead, and the replacement would find
// no rollback target on disk (seen in a clean-clone run of test_health). Nor
// may its replacement start before it exited: the replacement's ranks would
// look for the target before it is written (seen in a later clean-clone run:
// CheckpointLostError, "none is on disk").
TEST(NodeManager, AnExcludedNodeThatExitsByItselfIsNeverStoppedAndReplacedOnceItExited) {
  Harness h(2, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  h.sched.Started("node-1", "host-b");
  h.manager->Poll(false);
  h.manager->OnNodeExcluded("node-1", "silent data corruption");
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 2u);
  h.clock += 1;
  h.sched.Exit("node-1", 1);
  h.manager->Poll(false);
  ASSERT_EQ(h.sched.launched.size(), 3u);
  EXPECT_EQ(h.sched.launched[2].name, "node-1-2");
  EXPECT_THAT(h.sched.launched[2].avoid_hosts, ElementsAre("host-b"));
  h.clock += 60;
  h.manager->Poll(false);
  EXPECT_TRUE(h.sched.released.empty());
  EXPECT_EQ(h.manager->replacements(), 1);
}

TEST(NodeManager, BudgetUsedUpStopsReplacingAndExhaustsWhenAllEnded) {
  Harness h(1, 1);
  ASSERT_TRUE(h.manager->Start().ok());
  h.sched.Exit("node-0", 1);
  h.manager->Poll(false);
  EXPECT_FALSE(h.manager->Exhausted());
  h.sched.Exit("node-0-2", 1);
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 2u);
  EXPECT_TRUE(h.manager->Exhausted());
  EXPECT_THAT(h.events.back(), HasSubstr("ReplacementsUsedUp: node node-0-2 (node rank 0) is gone"));
  EXPECT_THAT(h.events.back(), HasSubstr("the replacement budget (1) is used up"));
}

TEST(NodeManager, NothingIsReplacedOnceTheJobFinished) {
  Harness h(2, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  h.sched.Exit("node-0", 0);
  h.sched.Exit("node-1", 0);
  h.manager->Poll(true);
  EXPECT_EQ(h.sched.launched.size(), 2u);
  EXPECT_TRUE(h.manager->Exhausted());
}

TEST(NodeManager, AnAgentThatExitedZeroIsDoneNotReplacedEvenBeforeTheEndIsHeard) {
  Harness h(2, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  h.sched.Exit("node-0", 0);  // the job succeeded; the driver has not seen it yet
  h.sched.Exit("node-1", 1);  // a failure is still replaced
  h.manager->Poll(false);
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-0", "node-1", "node-1-2"));
  EXPECT_EQ(h.manager->replacements(), 1);
}

TEST(NodeManager, UnknownAndStaleNamesChangeNothing) {
  Harness h(1, 5);
  ASSERT_TRUE(h.manager->Start().ok());
  h.manager->OnNodeLost("someone-else", "heartbeat timeout");
  h.sched.Exit("not-ours", 1);
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 1u);
  EXPECT_TRUE(h.sched.released.empty());
}

TEST(NodeManager, RefusedInitialLaunchIsAnErrorNamingTheRank) {
  Harness h(2, 5);
  h.sched.refuse = true;
  absl::Status s = h.manager->Start();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot start node rank 0: no capacity"));
}

TEST(NodeManager, StartTakesOverAdoptedNodesAndLaunchesOnlyTheMissingRanks) {
  Harness h(3, 3);
  // An earlier master process replaced rank 1 once (node-1 ended, node-1-2
  // runs) and never started rank 2.
  h.sched.adopted = {{"node-0", 0, 1, "h0"}, {"node-1", 1, 1, "h1"}, {"node-1-2", 1, 2, "h2"}};
  ASSERT_TRUE(h.manager->Start().ok());
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-2"));
  EXPECT_EQ(h.manager->replacements(), 1);
  EXPECT_EQ(h.manager->Describe("node-1-2"), "node-1-2 (node rank 1, host h2)");
  // The older incarnation's end is stale: nothing is replaced for it.
  h.sched.Exit("node-1", 1);
  h.manager->Poll(false);
  EXPECT_EQ(h.sched.launched.size(), 1u);
  // The adopted node of rank 1 ends: its replacement is incarnation 3.
  h.sched.Exit("node-1-2", 1);
  h.manager->Poll(false);
  EXPECT_THAT(Names(h.sched.launched), ElementsAre("node-2", "node-1-3"));
  EXPECT_EQ(h.manager->replacements(), 2);
  EXPECT_FALSE(h.manager->Exhausted());
}

TEST(NodeManager, AdoptedIncarnationsCountAgainstTheReplacementBudget) {
  Harness h(1, 2);
  h.sched.adopted = {{"node-0-3", 0, 3, ""}};
  ASSERT_TRUE(h.manager->Start().ok());
  EXPECT_TRUE(h.sched.launched.empty());
  EXPECT_EQ(h.manager->replacements(), 2);
  h.sched.Lost("node-0-3", "its pod was deleted");
  h.manager->Poll(false);
  EXPECT_TRUE(h.sched.launched.empty()) << "the budget of 2 was used up before the master restarted";
  EXPECT_TRUE(h.manager->Exhausted());
  ASSERT_FALSE(h.events.empty());
  EXPECT_THAT(h.events.back(), HasSubstr("ReplacementsUsedUp"));
}

}  // namespace
}  // namespace ballast::scheduler
