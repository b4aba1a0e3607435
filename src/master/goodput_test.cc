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

// A Kueue job: queued 30 s before its first master, trains, is preempted
// (the master sees its suspension, the step in progress is lost), and the
// master after the re-admission carries on from the first one's breakdown.
TEST(Goodput, QueuedAndPreemptedTimeHaveTheirPartsAndAreNotInGoodput) {
  G first(1000.0);
  GoodputBefore before;
  before.queued_s = 30;
  first.Held(before.breakdown, 0, before.queued_s, 999.0);  // admitted 1 s before this master started
  first.RoundStarted(1001.0);                               // 1 s waiting for nodes, 1 + 1 s startup
  first.Progress(1002.0, 1);
  first.Progress(1012.0, 11);  // 10 s productive
  first.Suspended(1012.5);     // 0.5 s of a step lost
  first.RoundStarted(1013.0);  // what the suspended master still sees changes nothing
  first.Failure(1013.5);
  first.Rendezvous(1014.0);
  G::Breakdown b = first.Get(1016.5);  // 4 s preempted so far (the drain)
  EXPECT_DOUBLE_EQ(b.seconds[G::kQueued], 30.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kStartup], 2.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRendezvous], 1.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kProductive], 10.0);
  EXPECT_DOUBLE_EQ(b.seconds[G::kRecompute], 0.5);
  EXPECT_DOUBLE_EQ(b.seconds[G::kPreempted], 4.0);
  EXPECT_DOUBLE_EQ(b.wall_s, 30.0 + 1016.5 - 999.0);
  EXPECT_DOUBLE_EQ(Sum(b), b.wall_s);
  EXPECT_DOUBLE_EQ(b.held_s(), 13.5);
  EXPECT_DOUBLE_EQ(b.goodput(), 10.0 / 13.5);  // queued and preempted are not the job's to lose

  // Re-admitted at 2020 (its own clock), the next master starts at 2021:
  // the first master's breakdown was taken at 2000 (by this clock).
  G second(2021.0);
  second.Held(b, 2000.0, 30.0, 2020.0);
  second.RoundStarted(2021.0);
  second.Progress(2022.0, 11);  // resumed from step 11: 1 + 1 s restart
  second.Progress(2025.0, 14);
  G::Breakdown c = second.Get(2025.0);
  EXPECT_DOUBLE_EQ(c.seconds[G::kQueued], 30.0);  // not counted twice
  EXPECT_DOUBLE_EQ(c.seconds[G::kPreempted], 4.0 + 20.0);
  EXPECT_DOUBLE_EQ(c.seconds[G::kRestart], 2.0);
  EXPECT_DOUBLE_EQ(c.seconds[G::kProductive], 13.0);
  EXPECT_DOUBLE_EQ(c.wall_s, b.wall_s + 20.0 + 5.0);
  EXPECT_DOUBLE_EQ(Sum(c), c.wall_s);
  EXPECT_EQ(c.high_water_step, 14);

  // A master that restarts the job without the last one's state (its
  // breakdown newer than the admission): the gap is a restart, not preempted.
  G third(3010.0);
  third.Held(c, 3000.0, 30.0, 2020.0);
  G::Breakdown d = third.Get(3010.0);
  EXPECT_DOUBLE_EQ(d.seconds[G::kPreempted], c.seconds[G::kPreempted]);
  EXPECT_DOUBLE_EQ(d.seconds[G::kRestart], 2.0 + 10.0);
  EXPECT_DOUBLE_EQ(Sum(d), d.wall_s);

  // The line `ballast status` and job summaries print.
  v1::Goodput g;
  g.set_known(true);
  g.set_wall_s(b.wall_s);
  g.set_goodput(b.goodput());
  for (int p = 0; p < G::kNumParts; ++p) {
    v1::GoodputPart* part = g.add_parts();
    part->set_part(std::string(G::PartName(static_cast<G::Part>(p))));
    part->set_seconds(b.seconds[p]);
  }
  EXPECT_EQ(FormatGoodput(g),
            "goodput 74.1% of the 13.5 s the job held its nodes (wall 47.5 s: productive 10.0 s, recompute 0.5 s, "
            "rendezvous 1.0 s, startup 2.0 s, queued 30.0 s, preempted 4.0 s)");
}

// A master that resumes from its journal carries the time that came before
// the job's first master in the journaled parts: the wall still adds up.
TEST(Goodput, AResumedMasterKeepsTheQueuedTimeInTheWall) {
  G g(100.0);
  G::Breakdown b;
  b.seconds[G::kQueued] = 30;
  b.seconds[G::kStartup] = 2;
  b.seconds[G::kProductive] = 8;
  b.steps_seen = true;
  b.high_water_step = 8;
  g.Resume(/*start=*/100.0, /*mark=*/110.0, b, /*running=*/true, /*training=*/true, 0);
  g.Progress(112.0, 10);
  G::Breakdown c = g.Get(112.0);
  EXPECT_DOUBLE_EQ(c.seconds[G::kProductive], 10.0);
  EXPECT_DOUBLE_EQ(c.wall_s, 42.0);
  EXPECT_DOUBLE_EQ(Sum(c), c.wall_s);
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
