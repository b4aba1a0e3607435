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

}  // namespace
}  // namespace ballast::master
