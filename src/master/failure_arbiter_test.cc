#include "master/failure_arbiter.h"

#include "gtest/gtest.h"

namespace ballast::master {
namespace {

v1::FailureReport Report(const std::string& node, int64_t round, const std::string& kind = "exit-code") {
  v1::FailureReport r;
  r.set_node_id(node);
  r.set_round(round);
  r.set_kind(kind);
  return r;
}

v1::FailureReport Hang(const std::string& node, int rank, int64_t last_step, bool in_collective) {
  v1::FailureReport r = Report(node, 1, "hang");
  r.set_global_rank(rank);
  r.set_hang_last_step(last_step);
  r.set_hang_stack_found(true);
  r.set_hang_in_collective(in_collective);
  r.set_hang_top_frame(in_collective ? "all_reduce" : "data_loader");
  return r;
}

const auto kNobodyDisconnected = [](const NodeId&) { return false; };

TEST(FailureArbiter, HoldsOnlyWithMoreThanOneMemberAndHangsLonger) {
  FailureArbiter a(0.5, 3.0);
  EXPECT_EQ(a.SettleSeconds(Report("a", 1), 1), 0);
  EXPECT_EQ(a.SettleSeconds(Report("a", 1), 2), 0.5);
  EXPECT_EQ(a.SettleSeconds(Report("a", 1, "hang"), 2), 3.0);
}

TEST(FailureArbiter, DecidesAfterTheSettleTimeUnlessAnotherMemberIsDisconnected) {
  FailureArbiter a(1.0, 1.0);
  a.Hold({Report("a", 1), "h", 10.0});
  EXPECT_TRUE(a.TakeDue(10.5, 2, kNobodyDisconnected).empty());
  EXPECT_TRUE(a.TakeDue(11.5, 2, [](const NodeId& except) { return except != NodeId("b"); }).empty())
      << "another member is disconnected: its loss may be the cause";
  auto due = a.TakeDue(11.5, 2, kNobodyDisconnected);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_TRUE(a.held().empty());
}

TEST(FailureArbiter, AHangReportedByEveryMemberIsDecidedWithoutWaitingOutTheSettleTime) {
  FailureArbiter a(0.0, 3.0);
  a.Hold({Hang("a", 0, 5, /*in_collective=*/true), "h", 10.0});
  EXPECT_TRUE(a.TakeDue(10.2, 2, kNobodyDisconnected).empty()) << "node b's report may still come";
  a.Hold({Hang("b", 2, 5, /*in_collective=*/false), "h", 10.3});
  EXPECT_TRUE(a.TakeDue(10.3, 2, [](const NodeId& except) { return except != NodeId("b"); }).empty())
      << "a disconnected member still holds the decision";
  auto due = a.TakeDue(10.3, 2, kNobodyDisconnected);
  ASSERT_EQ(due.size(), 2u);
  // Two reports from one node of three are not every member.
  a.Hold({Hang("a", 0, 5, true), "h", 20.0});
  a.Hold({Hang("a", 1, 5, true), "h", 20.0});
  EXPECT_TRUE(a.TakeDue(20.1, 3, kNobodyDisconnected).empty());
}

TEST(FailureArbiter, DropsReportsOfAnOlderRound) {
  FailureArbiter a(1.0, 1.0);
  a.Hold({Report("a", 1), "h", 0});
  a.Hold({Report("b", 2), "h", 0});
  auto stale = a.DropStale(Round(2));
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0].report.node_id(), "a");
  ASSERT_EQ(a.held().size(), 1u);
  EXPECT_EQ(a.held()[0].report.node_id(), "b");
}

TEST(FailureArbiter, BlamesTheHungRankOutsideACollectiveFirst) {
  std::vector<FailureArbiter::Held> reports = {{Report("c", 1), "h", 0},
                                               {Hang("a", 0, 5, /*in_collective=*/true), "h", 0},
                                               {Hang("b", 2, 5, /*in_collective=*/false), "h", 0}};
  const std::string line = FailureArbiter::OrderForBlame(&reports);
  EXPECT_EQ(reports[0].report.node_id(), "b");
  EXPECT_EQ(reports[1].report.node_id(), "a");
  EXPECT_EQ(reports[2].report.node_id(), "c") << "a crash in the same window comes last";
  EXPECT_NE(line.find("blaming rank 2 on node b (outside any collective)"), std::string::npos) << line;
  EXPECT_NE(reports[0].report.stderr_tail().find("waiting in a collective at all_reduce"), std::string::npos);
}

TEST(FailureArbiter, ThenAHungRankThatDidNotAnswerTheStackDump) {
  v1::FailureReport silent = Hang("b", 2, 9, false);
  silent.set_hang_stack_found(false);  // SIGSTOPped: no dump, at a higher step
  std::vector<FailureArbiter::Held> reports = {{Hang("a", 0, 5, /*in_collective=*/true), "h", 0},
                                               {silent, "h", 0}};
  const std::string line = FailureArbiter::OrderForBlame(&reports);
  EXPECT_EQ(reports[0].report.node_id(), "b");
  EXPECT_NE(line.find("blaming rank 2 on node b (it did not answer the stack dump"), std::string::npos) << line;
}

TEST(FailureArbiter, DetectionCountsTheHeldTimeAndAHangsIdleTime) {
  v1::FailureReport r = Report("a", 1);
  r.set_seen_age_s(0.25);
  EXPECT_DOUBLE_EQ(FailureArbiter::DetectionSeconds(r, 1.0), 1.25);
  v1::FailureReport h = Hang("a", 0, 1, false);
  h.set_hang_idle_s(30);
  EXPECT_DOUBLE_EQ(FailureArbiter::DetectionSeconds(h, 0), 30);
}

TEST(FailureArbiter, ABadLossIsBlamedBeforeTheCrashesAndHangsItCaused) {
  std::vector<FailureArbiter::Held> held = {{Report("a", 1), "ha", 0},
                                            {Hang("b", 3, 7, true), "hb", 0},
                                            {Report("c", 1, "nan"), "hc", 0}};
  FailureArbiter::OrderForBlame(&held);
  EXPECT_EQ(held[0].report.node_id(), "c");
  EXPECT_EQ(held[1].report.node_id(), "b");
}

// A rank SIGKILLed on node a; node b's ranks fail in their next allreduce
// ("Connection closed by peer") and b's report arrives first: the kill is
// blamed, whatever the order of arrival; a crash that says nothing of a peer
// keeps its place before them.
TEST(FailureArbiter, ACrashFromALostPeerIsBlamedAfterTheFailureThatCausedIt) {
  v1::FailureReport peer = Report("b", 1);
  peer.set_exit_code(1);
  peer.set_stderr_tail(
      "Traceback (most recent call last):\nRuntimeError: [./gloo/transport/tcp/pair.cc:598] Connection closed by "
      "peer [127.0.0.1]:908\n");
  v1::FailureReport killed = Report("a", 1, "killed");
  killed.set_signal(9);
  std::vector<FailureArbiter::Held> held = {{peer, "hb", 0}, {killed, "ha", 0.1}};
  EXPECT_EQ(FailureArbiter::OrderForBlame(&held), "");
  EXPECT_EQ(held[0].report.node_id(), "a");
  v1::FailureReport other = Report("c", 1);
  other.set_exit_code(3);
  other.set_stderr_tail("ValueError: bad batch\n");
  held = {{peer, "hb", 0}, {other, "hc", 0.1}, {killed, "ha", 0.2}};
  FailureArbiter::OrderForBlame(&held);
  EXPECT_EQ(held[0].report.node_id(), "c");  // the first of the crashes that are not a peer's loss
  EXPECT_EQ(held[1].report.node_id(), "a");
  EXPECT_EQ(held[2].report.node_id(), "b");
}

}  // namespace
}  // namespace ballast::master
