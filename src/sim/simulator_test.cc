// The simulator on small clusters: the published arithmetic, the policies'
// order, parts that add up, and fault schedules whose outcome can be worked
// out by hand.
#include "sim/simulator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "nlohmann/json.hpp"

namespace ballast::sim {
namespace {

using ::testing::HasSubstr;

TEST(Simulator, ReproducesThePublishedFailureArithmetic) {
  SimOptions o;
  o.gpus = 1000;
  EXPECT_NEAR(FailureProbabilityPerDay(o), 0.933, 0.001);  // ~93% a day at 0.27%/GPU/day
  o.days = 30;
  o.seed = 7;
  const std::vector<Fault> faults = RandomFaults(o);
  EXPECT_NEAR(static_cast<double>(faults.size()), 1000 * 0.0027 * 30, 25);  // Poisson: 81 +- 3 sigma
  int node = 0;
  for (const Fault& f : faults) node += f.node_loss ? 1 : 0;
  EXPECT_NEAR(static_cast<double>(node) / static_cast<double>(faults.size()), 0.25, 0.15);
}

TEST(Simulator, BallastKeepsMoreGoodputThanDlroverThanManualAndThePartsAddUp) {
  SimOptions o;
  o.gpus = 64;
  o.days = 2;
  o.failure_rate_per_gpu_day = 0.05;  // ~6 faults a day on 64 GPUs
  o.spares = 1;
  const SimResult r = Simulate(o);
  ASSERT_EQ(r.policies.size(), 3u);
  ASSERT_GT(r.faults.size(), 4u);
  for (const PolicyResult& p : r.policies) {
    double sum = 0;
    for (const auto& [name, s] : p.parts) sum += s;
    EXPECT_NEAR(sum, p.wall_s, 1e-6 * p.wall_s) << PolicyName(p.policy);
    EXPECT_NEAR(p.wall_s, 2 * 86400, 1) << PolicyName(p.policy);
    EXPECT_EQ(p.process_failures + p.node_failures, static_cast<int>(r.faults.size())) << PolicyName(p.policy);
  }
  const PolicyResult& manual = r.policies[0];
  const PolicyResult& dlrover = r.policies[1];
  const PolicyResult& ballast = r.policies[2];
  EXPECT_GT(ballast.goodput, dlrover.goodput);
  EXPECT_GT(dlrover.goodput, manual.goodput);
  EXPECT_GT(ballast.goodput, 0.9);
  // Flash checkpoints every step: nothing is redone but the interrupted
  // steps, up to the failure's decision (a lost node's: the heartbeat timeout).
  EXPECT_LT(ballast.Part("recompute"), (o.step_time_s + 0.5) * static_cast<double>(r.faults.size()) +
                                              o.heartbeat_timeout_s * ballast.node_failures);
  EXPECT_GT(dlrover.Part("recompute"), 100 * o.step_time_s);
  EXPECT_GT(ballast.Part("checkpoint"), 0);
  // A lost node is replaced (the spare takes its place, a new spare is asked for).
  if (ballast.node_failures > 0) {
    EXPECT_GE(ballast.replacements, ballast.node_failures);
  }
  // The same seed gives the same run.
  const SimResult again = Simulate(o);
  EXPECT_DOUBLE_EQ(again.policies[2].goodput, ballast.goodput);
  nlohmann::json doc = nlohmann::json::parse(SimResultJson(o, r));
  EXPECT_NEAR(doc["p_failure_per_day"].get<double>(), r.p_failure_per_day, 1e-12);
  for (const char* name : {"manual", "dlrover", "ballast"}) {
    EXPECT_TRUE(doc["policies"][name].contains("goodput")) << name;
    EXPECT_TRUE(doc["policies"][name]["lost_s"].contains("restart")) << name;
  }
  EXPECT_THAT(SimSeriesCsv(r), HasSubstr("hours,manual,dlrover,ballast\n"));
  EXPECT_THAT(SimResultText(o, r), HasSubstr("ballast  goodput"));
}

TEST(Simulator, AFaultScheduleCostsWhatTheRestartCosts) {
  SimOptions o;
  o.gpus = 2;
  o.gpus_per_node = 2;
  o.steps = 100;
  o.step_time_s = 1.0;
  o.flash_ckpt_s = 0;
  o.job_start_s = 5;
  o.ballast_restart_s = 2;
  o.random_faults = false;
  o.faults = *ParseFaultSchedule("30.5:process,60.5:process");
  o.policies = {Policy::kBallast};
  const PolicyResult p = Simulate(o).policies[0];
  EXPECT_EQ(p.process_failures, 2);
  EXPECT_EQ(p.restarts, 2);
  EXPECT_EQ(p.steps, 100);
  // Worked out by hand (one node: the master decides a failure at once):
  //   start 0 -> workers up 5 -> step 1 done at 6 (startup 6 s);
  //   steps 2-25 by 30.0 (24 s productive); fault at 30.5, reported at 30.6:
  //     0.6 s lost (recompute); restart 2 s + the first step: step 26 at 33.6;
  //   steps 27-52 by 59.6 (26 s); fault 60.5, reported 60.6: 1.0 s lost;
  //     step 53 at 63.6; steps 54-100 by 110.6 (47 s).
  EXPECT_NEAR(p.Part("startup"), 6, 1e-6);
  EXPECT_NEAR(p.Part("productive"), 24 + 26 + 47, 1e-6);
  EXPECT_NEAR(p.Part("recompute"), 0.6 + 1.0, 1e-6);
  EXPECT_NEAR(p.Part("restart"), 2 * 3, 1e-6);
  EXPECT_NEAR(p.mean_resume_s, 3, 1e-6);
  EXPECT_NEAR(p.wall_s, 110.6, 1e-5);
  EXPECT_NEAR(p.goodput, p.Part("productive") / p.wall_s, 1e-9);
}

TEST(Simulator, ALostNodeWaitsForItsReplacementWithoutASpare) {
  SimOptions o;
  o.gpus = 16;
  o.gpus_per_node = 8;
  o.steps = 400;
  o.step_time_s = 1.0;
  o.node_replacement_s = 100;
  o.heartbeat_timeout_s = 10;
  o.job_start_s = 5;
  o.random_faults = false;
  o.faults = *ParseFaultSchedule("200.5:node");
  o.policies = {Policy::kDlrover, Policy::kBallast};
  o.spares = 1;  // ballast's
  const SimResult r = Simulate(o);
  const PolicyResult& dlrover = r.policies[0];
  const PolicyResult& ballast = r.policies[1];
  EXPECT_EQ(dlrover.node_failures, 1);
  EXPECT_EQ(dlrover.restarts, 0);  // a membership change, not a restart
  EXPECT_EQ(dlrover.replacements, 1);
  // dlrover: detected after the heartbeat timeout, then the world waits for
  // the new node (rendezvous), and rolls back to its last disk checkpoint.
  EXPECT_NEAR(dlrover.Part("rendezvous"), 100, 2);
  EXPECT_GT(dlrover.Part("recompute"), 150);
  // ballast: the spare is in the next round at once; nothing rolled back.
  EXPECT_LT(ballast.Part("rendezvous"), 2);
  EXPECT_LT(ballast.Part("recompute"), 12);
  EXPECT_GT(ballast.goodput, dlrover.goodput);
}

// The policies run on threads of their own: the same inputs give the same
// results, in the order asked, run after run.
TEST(Simulator, ThePoliciesGiveTheSameResultsRunAfterRun) {
  SimOptions o;
  o.gpus = 800;
  o.days = 3;
  o.spares = 1;
  o.policies = {Policy::kBallast, Policy::kManual, Policy::kDlrover};
  auto without_timing = [&](SimResult r) {
    for (PolicyResult& p : r.policies) p.sim_cpu_s = 0;
    return SimResultJson(o, r);
  };
  const SimResult first = Simulate(o);
  ASSERT_EQ(first.policies.size(), 3u);
  EXPECT_EQ(first.policies[0].policy, Policy::kBallast);
  EXPECT_EQ(first.policies[1].policy, Policy::kManual);
  EXPECT_EQ(first.policies[2].policy, Policy::kDlrover);
  EXPECT_GT(first.policies[0].restarts, 0);
  const std::string want = without_timing(first);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(without_timing(Simulate(o)), want);
}

TEST(Simulator, BadInputSaysWhatToFix) {
  SimOptions o;
  o.gpus = 12;
  o.gpus_per_node = 8;
  EXPECT_THAT(std::string(ValidateSimOptions(o).message()), HasSubstr("multiple of --gpus-per-node"));
  EXPECT_THAT(std::string(ParseFaultSchedule("5:disk").status().message()), HasSubstr("SECONDS:process"));
  EXPECT_THAT(std::string(ParseFaultSchedule("x:node").status().message()), HasSubstr("SECONDS:process"));
  EXPECT_EQ(ParseFaultSchedule("30:node, 5:process")->front().at_s, 5);
}

}  // namespace
}  // namespace ballast::sim
