#include "master/goodput.h"

#include <numeric>

#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using G = GoodputAccountant;

double Sum(const G::Breakdown& b) { return std::accumulate(b.seconds.begin(), b.seconds.end(), 0.0); }

TEST(Goodput, PartsAddUpAndARollbackIsRecompute) {
  G g(100.0);
  g.RoundStarted(102.0);  // 2 s waiting for nodes
  g.Progress(105.0, 1);   // 3 s startup
  g.Progress(109.0, 5);   // 4 s, steps 2-5: productive
  g.Progress(111.0, 7);   // 2 s productive (high water 7)
  g.Failure(111.5);       // 0.5 s of a step lost: recompute
  g.RoundStarted(111.6);  // the restart goes on
  g.Progress(112.5, 5);   // rolled back to step 5: 1 s restart
  g.Progress(114.5, 9);   // steps 6-9: 6, 7 redone (1 s), 8, 9 new (1 s)
  G::Breakdown b = g.Get(115.0);
  EXPECT_DOUBLE_EQ(b.wall_s, 15.0);
  EXPECT_DOUBLE_EQ(Sum(b), b.wall_s);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRendezvous], 2.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kStartup], 3.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kProductive], 4.0 + 2.0 + 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRecompute], 0.5 + 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRestart], 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kIdle], 0.5);  // a step in progress
  EXPECT_EQ(b.recomputed_steps, 2);
  EXPECT_EQ(b.high_water_step, 9);
  EXPECT_TRUE(b.steps_seen);
  EXPECT_NEAR(b.goodput(), 7.0 / 15.0, 1e-12);
}

TEST(Goodput, WaitingForNodesAndPrecheckHaveTheirOwnParts) {
  G g(0.0);
  g.Precheck(1.0);
  g.RoundStarted(3.0);
  g.Progress(4.0, 1);
  g.Progress(6.0, 3);
  g.Rendezvous(7.0);  // a node lost, below MIN: 1 s of a step lost
  g.RoundStarted(9.0);
  g.Progress(10.0, 3);
  g.Finished(11.0);
  G::Breakdown b = g.Get(50.0);  // the clock stopped at the end
  EXPECT_DOUBLE_EQ(b.wall_s, 11.0);
  EXPECT_DOUBLE_EQ(Sum(b), 11.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRendezvous], 1.0 + 2.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kPrecheck], 2.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kStartup], 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRestart], 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kProductive], 2.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRecompute], 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kIdle], 1.0);
}

TEST(Goodput, WithoutProgressReportsGoodputIsUnknown) {
  G g(0.0);
  g.RoundStarted(1.0);
  G::Breakdown b = g.Get(30.0);
  EXPECT_FALSE(b.steps_seen);
  EXPECT_DOUBLE_EQ(b.seconds[G::kStartup], 29.0);
  EXPECT_DOUBLE_EQ(Sum(b), 30.0);
  // A late report of a round that was stopped counts nothing.
  g.Rendezvous(31.0);
  g.Progress(32.0, 4);
  EXPECT_DOUBLE_EQ(g.Get(33.0).seconds[G::kProductive], 0.0);
}

TEST(Goodput, CheckpointStallsComeOutOfTheStepIntervalsTheyFellIn) {
  G g(0.0);
  g.RoundStarted(0.0);
  g.Progress(1.0, 1);  // startup 1 s
  auto at = [](int64_t step, double t, double stall) {
    G::WorldStep w;
    w.step = step;
    w.reached_at = t;
    w.first_step = 1;
    w.first_at = 1.0;
    w.ckpt_stall_s = stall;
    return w;
  };
  g.Progress(3.0, at(3, 3.0, 0.5));  // 2 s for steps 2-3, 0.5 s of it in saves
  g.Progress(4.0, at(4, 4.0, 0.5));  // no new stall
  g.Progress(4.2, at(4, 4.0, 1.5));  // a 1 s save reported before its step completed...
  g.Progress(6.0, at(5, 6.0, 1.5));  // ...is taken out of that step
  G::Breakdown b = g.Get(6.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kCheckpoint], 1.5);
  EXPECT_DOUBLE_EQ(b.seconds[G::kProductive], 5.0 - 1.5);
  EXPECT_DOUBLE_EQ(Sum(b), b.wall_s);
  // A new round's workers count their stall from zero again.
  g.Failure(6.5);
  g.RoundStarted(6.5);
  g.Progress(7.0, at(5, 7.0, 0.0));
  g.Progress(8.0, at(7, 8.0, 0.25));
  b = g.Get(8.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kCheckpoint], 1.75);
  EXPECT_DOUBLE_EQ(Sum(b), b.wall_s);
}

TEST(StepHistory, StaysBoundedAndSpansTheWholeJob) {
  StepHistory h;
  for (int i = 0; i < 10000; ++i) h.Add(0.5 * i, i);
  ASSERT_LE(h.points().size(), StepHistory::kMaxPoints);
  EXPECT_GE(h.points().size(), StepHistory::kMaxPoints / 2);
  EXPECT_DOUBLE_EQ(h.points().front().at_s, 0);
  EXPECT_GT(h.points().back().at_s, 0.9 * 0.5 * 10000);
  for (size_t i = 1; i < h.points().size(); ++i) EXPECT_GT(h.points()[i].step, h.points()[i - 1].step);
  h.Add(1e6, 5);  // a rolled-back step is not a new high
  EXPECT_NE(h.points().back().at_s, 1e6);
}

TEST(FormatChaosReport, SaysWhatWasInjectedAndWhatTheJobDid) {
  v1::JobStatus st;
  EXPECT_EQ(FormatChaosReport("nan:rank=1,at_step=6", st), "chaos: injected nan:rank=1,at_step=6; the job saw no failure");
  v1::FailureRecord* f = st.add_failures();
  f->set_at_s(12.34);
  f->set_round(1);
  f->set_kind("nan");
  f->set_global_rank(1);
  f->set_node_id("node-0");
  f->set_node_rank(0);
  f->set_cause("non-finite loss (nan) at step 6");
  f->set_action("rollback");
  f->set_detection_s(0.1);
  f->set_resumed(true);
  f->set_resume_s(1.25);
  f->set_steps_lost(1);
  EXPECT_EQ(FormatChaosReport("nan:rank=1,at_step=6", st),
            "chaos: injected nan:rank=1,at_step=6; the job responded:\n  12.3 s, round 1: nan, rank 1 on node node-0 "
            "(node rank 0): non-finite loss (nan) at step 6 -> rollback; decided 0.10 s after it was seen, training "
            "again 1.25 s later, 1 step(s) run again");
  // Failed checkpoint writes are no failure of the job, but the report says them.
  v1::JobStatus disk;
  disk.set_persist_errors_total(2);
  disk.set_last_persist_error("node node-1 (node rank 1, host h1) rank 3: cannot write checkpoint step 9 to /c: x");
  EXPECT_EQ(FormatChaosReport("disk-full:node=1,at_step=4", disk),
            "chaos: injected disk-full:node=1,at_step=4; the job responded:\n  2 checkpoint write(s) failed (the "
            "agents retry them); training went on; the newest: node node-1 (node rank 1, host h1) rank 3: cannot "
            "write checkpoint step 9 to /c: x");
}

}  // namespace
}  // namespace ballast::master
