#include "agent/chaos_driver.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace ballast::agent {
namespace {

constexpr uint64_t kSec = 1000000000ULL;

ChaosSpec Spec(const std::string& text, int incarnation = 1) {
  auto s = ParseChaosSpec(text);
  EXPECT_TRUE(s.ok()) << s.status();
  s->incarnation = incarnation;
  return *s;
}

TEST(ChaosDriverTest, KillWorkerAtStepFiresOnceForItsRankInItsAttempt) {
  ChaosDriver d(Spec("kill-worker:rank=3,at_step=7"), /*node_rank=*/1);
  ASSERT_TRUE(d.armed());
  d.RoundStarted(10 * kSec, /*restart_count=*/0);
  std::vector<ChaosDriver::Worker> w = {{2, 100, true, true, 9}, {3, 101, true, true, 6}};
  EXPECT_TRUE(d.Due(11 * kSec, w).empty());  // rank 3 at step 6
  w[1].step = 8;                              // polled after it passed 7
  auto due = d.Due(12 * kSec, w);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].kind, ChaosAction::Kind::kKillWorker);
  EXPECT_EQ(due[0].pid, 101);
  EXPECT_EQ(due[0].global_rank, 3);
  EXPECT_NE(due[0].what.find("at step 8"), std::string::npos) << due[0].what;
  EXPECT_TRUE(d.Due(13 * kSec, w).empty());  // once
  // The restarted attempt (restart count 1) trains on.
  d.RoundStarted(14 * kSec, 1);
  EXPECT_TRUE(d.Due(15 * kSec, w).empty());
}

TEST(ChaosDriverTest, WorkerFaultWaitsForItsRestartAndSkipsOtherNodesRanks) {
  ChaosDriver d(Spec("hang:rank=0,after=2,restart=1"), 0);
  d.RoundStarted(1 * kSec, 0);
  std::vector<ChaosDriver::Worker> w = {{0, 50, true, false, 0}};
  EXPECT_TRUE(d.Due(10 * kSec, w).empty());  // attempt 0
  d.RoundStarted(20 * kSec, 1);
  EXPECT_TRUE(d.Due(21 * kSec, w).empty());  // 1 s into the round
  auto due = d.Due(22 * kSec, w);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].kind, ChaosAction::Kind::kStopWorker);
  EXPECT_EQ(due[0].pid, 50);
  // A rank this node does not hold never fires here.
  ChaosDriver other(Spec("kill-worker:rank=5,after=1"), 0);
  other.RoundStarted(1 * kSec, 0);
  EXPECT_TRUE(other.Due(100 * kSec, w).empty());
  // Nor does a worker that already exited.
  ChaosDriver exited(Spec("kill-worker:rank=0,after=1"), 0);
  exited.RoundStarted(1 * kSec, 0);
  EXPECT_TRUE(exited.Due(100 * kSec, {{0, 50, false, true, 3}}).empty());
}

TEST(ChaosDriverTest, KillAgentByTimeCountsFromTheFirstRoundAndByStepFromTheNodesLowest) {
  ChaosDriver timed(Spec("kill-agent:node=2,after=5"), 2);
  timed.RoundStarted(10 * kSec, 0);
  timed.RoundStarted(13 * kSec, 1);  // a restart does not re-arm it
  EXPECT_TRUE(timed.Due(14 * kSec, {}).empty());
  auto due = timed.Due(15 * kSec, {});
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].kind, ChaosAction::Kind::kKillAgent);

  ChaosDriver stepped(Spec("kill-agent:node=2,at_step=4"), 2);
  stepped.RoundStarted(1 * kSec, 0);
  std::vector<ChaosDriver::Worker> w = {{4, 1, true, true, 5}, {5, 2, true, true, 3}};
  EXPECT_TRUE(stepped.Due(2 * kSec, w).empty());  // the node's lowest is 3
  w[1].step = 4;
  EXPECT_EQ(stepped.Due(3 * kSec, w).size(), 1u);

  EXPECT_FALSE(ChaosDriver(Spec("kill-agent:node=2,after=5"), 1).armed());     // another node
  EXPECT_FALSE(ChaosDriver(Spec("kill-worker:rank=0,after=1", 2), 0).armed());  // a replacement's agent
  EXPECT_TRUE(ChaosDriver(Spec("kill-worker:rank=0,after=1,incarnation=2", 2), 0).armed());
}

TEST(ChaosDriverTest, APartitionTakesTheLinkDownAndBringsItBackAfterItsDuration) {
  ChaosDriver d(Spec("partition:node=1,at_step=4,for=2.5"), 1);
  ASSERT_TRUE(d.armed());
  d.RoundStarted(1 * kSec, 0);
  std::vector<ChaosDriver::Worker> w = {{2, 10, true, true, 3}, {3, 11, true, true, 5}};
  EXPECT_TRUE(d.Due(2 * kSec, w).empty());
  w[0].step = 4;
  auto down = d.Due(3 * kSec, w);
  ASSERT_EQ(down.size(), 1u);
  EXPECT_EQ(down[0].kind, ChaosAction::Kind::kLinkDown);
  EXPECT_DOUBLE_EQ(down[0].seconds, 2.5);
  EXPECT_NE(down[0].what.find("partition:node=1,at_step=4,for=2.5"), std::string::npos) << down[0].what;
  EXPECT_TRUE(d.Due(5 * kSec, w).empty());  // 2 s into it
  auto up = d.Due(5 * kSec + kSec / 2, w);
  ASSERT_EQ(up.size(), 1u);
  EXPECT_EQ(up[0].kind, ChaosAction::Kind::kLinkUp);
  EXPECT_TRUE(d.Due(60 * kSec, w).empty());  // once
}

TEST(ChaosDriverTest, KillMasterAtAStepReportsTheNodesStepTheMomentItGetsThere) {
  // Every agent, whatever its node rank or incarnation: the launcher waits
  // for every training node's step.
  ChaosDriver d(Spec("kill-master:at_step=6", /*incarnation=*/2), /*node_rank=*/3);
  ASSERT_TRUE(d.armed());
  d.RoundStarted(1 * kSec, 0);
  std::vector<ChaosDriver::Worker> w = {{6, 10, true, true, 7}, {7, 11, true, false, 0}};
  EXPECT_TRUE(d.Due(2 * kSec, w).empty());  // rank 7 has not stepped
  w[1] = {7, 11, true, true, 5};
  EXPECT_TRUE(d.Due(3 * kSec, w).empty());  // the node's lowest is 5
  w[1].step = 6;
  auto due = d.Due(3 * kSec + kSec / 20, w);  // the next poll, 50 ms later
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].kind, ChaosAction::Kind::kReportStep);
  EXPECT_NE(due[0].what.find("kill-master:at_step=6 (its workers at step 6)"), std::string::npos) << due[0].what;
  EXPECT_TRUE(d.Due(4 * kSec, w).empty());  // once a round
  // A restarted round resumes from a checkpoint: it reports again when it
  // gets there (the master may not have been killed yet).
  d.RoundStarted(5 * kSec, 1);
  w[0].step = w[1].step = 4;
  EXPECT_TRUE(d.Due(6 * kSec, w).empty());
  w[0].step = w[1].step = 6;
  EXPECT_EQ(d.Due(7 * kSec, w).size(), 1u);
  // By time the launcher alone decides: nothing to report early.
  EXPECT_FALSE(ChaosDriver(Spec("kill-master:after=3"), 0).armed());
}

v1::JobStatus Status(const std::string& state, const std::vector<std::pair<std::string, int64_t>>& nodes) {
  v1::JobStatus st;
  st.set_state(state);
  for (const auto& [node_state, step] : nodes) {
    v1::NodeStatus* n = st.add_nodes();
    n->set_state(node_state);
    n->set_last_step(step);
  }
  return st;
}

TEST(KillMasterDueTest, ByStepWhenEveryTrainingNodeGotThere) {
  const ChaosFault f = Spec("kill-master:at_step=6").faults[0];
  EXPECT_FALSE(KillMasterDue(f, Status("running", {{"training", 6}, {"training", 5}}), 100).has_value());
  auto why = KillMasterDue(f, Status("running", {{"training", 6}, {"training", 7}}), 0);
  ASSERT_TRUE(why.has_value());
  EXPECT_EQ(*why, "every training node at step 6 or later");
  // A hot spare, a node waiting for the next round, a lost or excluded node
  // never steps: they do not hold the kill back.
  EXPECT_TRUE(KillMasterDue(f,
                            Status("running", {{"training", 6}, {"spare", 0}, {"waiting", 0}, {"dead", 2},
                                               {"excluded", 1}, {"training", 8}}),
                            0)
                  .has_value());
  EXPECT_FALSE(KillMasterDue(f, Status("rendezvous", {{"training", 9}}), 0).has_value());
  EXPECT_FALSE(KillMasterDue(f, Status("running", {{"spare", 0}}), 0).has_value());  // nobody trains

  const ChaosFault timed = Spec("kill-master:after=3").faults[0];
  EXPECT_FALSE(KillMasterDue(timed, Status("rendezvous", {}), 2.9).has_value());
  why = KillMasterDue(timed, Status("rendezvous", {}), 3.04);
  ASSERT_TRUE(why.has_value());
  EXPECT_EQ(*why, "3.0 s after it started");
}

TEST(ChaosDriverTest, NothingFiresBeforeARound) {
  ChaosDriver d(Spec("kill-agent:node=0,after=1"), 0);
  EXPECT_TRUE(d.Due(100 * kSec, {}).empty());
}

TEST(DiskChaosTest, FailsTheGivenNumberOfWritesFromItsStepWithTheDisksError) {
  DiskChaos full(Spec("disk-full:node=1,at_step=6,writes=2"), 1);
  ASSERT_TRUE(full.armed());
  EXPECT_TRUE(full.BeforeWrite(3, "/ckpt").ok());
  absl::Status s = full.BeforeWrite(6, "/ckpt");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("No space left on device (chaos disk-full, 1 more failing write(s))"),
            std::string::npos)
      << s;
  EXPECT_FALSE(full.BeforeWrite(9, "/ckpt").ok());
  EXPECT_TRUE(full.BeforeWrite(12, "/ckpt").ok());  // the disk is fine again

  DiskChaos error(Spec("disk-error:node=0,after=0.01"), 0);
  EXPECT_TRUE(error.BeforeWrite(1, "/ckpt").ok());  // not yet
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (int i = 0; i < 3; ++i) {  // writes=3 by default
    absl::Status e = error.BeforeWrite(1, "/ckpt");
    EXPECT_EQ(e.code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(e.message().find("Input/output error"), std::string::npos) << e;
  }
  EXPECT_TRUE(error.BeforeWrite(1, "/ckpt").ok());
  EXPECT_FALSE(DiskChaos(Spec("disk-full:node=1,at_step=1"), 0).armed());  // another node
}

}  // namespace
}  // namespace ballast::agent
