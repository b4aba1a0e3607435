// JobMaster with the pre-flight check: RunCheck rounds, exclusion, replacement.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "gtest/gtest.h"
#include "master/job_master.h"

namespace ballast::master {
namespace {

class JobMasterPrecheckTest : public ::testing::Test {
 protected:
  void Make(int nodes, int min_nodes = -1) {
    JobMasterOptions o;
    o.job_id = "job1";
    o.min_nodes = min_nodes > 0 ? min_nodes : nodes;
    o.max_nodes = nodes;
    o.last_call_s = 2.0;
    o.clock = &clock_;
    o.precheck_options = PrecheckOptions{};
    jm_ = std::make_unique<JobMaster>(o);
  }
  absl::Status Join(const std::string& id, int hint, bool precheck = true) {
    v1::JoinRequest req;
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_node_rank_hint(hint);
    req.mutable_node()->set_local_world_size(1);
    req.mutable_node()->set_host(id + ".host");
    req.mutable_spec()->set_precheck(precheck);
    auto r = jm_->Join(req);
    if (r.ok() && handles_.count(id) == 0) handles_[id] = *jm_->OpenWatch(id);
    return r.status();
  }
  // The node's newest decision delivered now (empty when none).
  std::optional<v1::Decision> Last(const std::string& id) {
    std::optional<v1::Decision> last;
    while (true) {
      auto next = jm_->NextDecision(handles_[id], 0);
      if (!next.ok() || !next->has_value()) break;
      last = **next;
    }
    return last;
  }
  absl::Status Report(const std::string& id, int64_t check_id, bool ok, const std::string& error = "") {
    v1::CheckResult r;
    r.set_node_id(id);
    r.set_check_id(check_id);
    r.set_ok(ok);
    r.set_error(error);
    r.set_time_s(0.01);
    return jm_->ReportCheckResult(r);
  }
  // Answers the pending RunCheck of every node: `bad` fails ("*": all fail).
  void AnswerChecks(const std::vector<std::string>& ids, const std::string& bad) {
    std::map<std::string, v1::RunCheck> checks;
    for (const auto& id : ids) {
      auto d = Last(id);
      if (d.has_value() && d->has_run_check()) checks[id] = d->run_check();
    }
    for (const auto& [id, rc] : checks) {
      const bool ok = id != bad && bad != "*";
      ASSERT_TRUE(Report(id, rc.check_id(), ok, ok ? "" : "ModuleNotFoundError: No module named 'torch'").ok());
    }
  }

  FakeClock clock_;
  std::unique_ptr<JobMaster> jm_;
  std::map<std::string, JobMaster::WatchHandle> handles_;
};

TEST_F(JobMasterPrecheckTest, FaultyNodeIsExcludedAndItsReplacementCheckedBeforeTraining) {
  Make(4);
  std::vector<std::string> ids = {"a", "b", "c", "d"};
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Join(ids[i], i).ok());
  ASSERT_EQ(jm_->Status().round(), 0);  // checking, not training
  AnswerChecks(ids, "b");               // round 1
  AnswerChecks(ids, "b");               // round 2
  auto excluded = Last("b");
  ASSERT_TRUE(excluded.has_value() && excluded->has_excluded());
  EXPECT_NE(excluded->excluded().reason().find("failed the pre-flight check"), std::string::npos);
  EXPECT_EQ(Join("b", 1).code(), absl::StatusCode::kFailedPrecondition);  // re-join refused
  EXPECT_EQ(jm_->Status().round(), 0);  // 3 of 4 nodes: waiting for a replacement
  ASSERT_TRUE(Join("e", 1).ok());
  AnswerChecks({"a", "c", "d", "e"}, "");
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 1);
  EXPECT_EQ(st.world_size(), 4);
  EXPECT_NE(st.precheck().find("all 4 nodes passed"), std::string::npos) << st.precheck();
  auto start = Last("e");
  ASSERT_TRUE(start.has_value() && start->has_start_round());
}

TEST_F(JobMasterPrecheckTest, ThreeNodesWithAFailureFailTheJob) {
  Make(3);
  std::vector<std::string> ids = {"a", "b", "c"};
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Join(ids[i], i).ok());
  AnswerChecks(ids, "c");
  auto outcome = jm_->outcome();
  ASSERT_TRUE(outcome.has_value());
  EXPECT_FALSE(outcome->succeeded);
  EXPECT_NE(outcome->message.find("cannot be localized"), std::string::npos) << outcome->message;
}

// Every node failing every round is not a node fault: the job fails with the
// errors instead of excluding (and replacing) every node.
TEST_F(JobMasterPrecheckTest, EveryNodeFailingFailsTheJob) {
  Make(4);
  std::vector<std::string> ids = {"a", "b", "c", "d"};
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Join(ids[i], i).ok());
  AnswerChecks(ids, "*");
  AnswerChecks(ids, "*");
  auto outcome = jm_->outcome();
  ASSERT_TRUE(outcome.has_value());
  EXPECT_FALSE(outcome->succeeded);
  EXPECT_NE(outcome->message.find("not in one node"), std::string::npos) << outcome->message;
  EXPECT_NE(outcome->message.find("No module named 'torch'"), std::string::npos) << outcome->message;
  auto last = Last("a");
  ASSERT_TRUE(last.has_value() && last->has_job_finished());
}

// A node that joins a running job is checked (alone: the members are busy)
// while training goes on; a failing joiner is excluded without touching the
// round, a passing one scales the job up. A restart in place meanwhile keeps
// the unchecked joiner out.
TEST_F(JobMasterPrecheckTest, JoinerIsCheckedWhileTheJobTrains) {
  Make(2, /*min_nodes=*/1);
  ASSERT_TRUE(Join("a", 0).ok());
  ASSERT_TRUE(Join("b", 1).ok());
  AnswerChecks({"a", "b"}, "");
  ASSERT_EQ(jm_->Status().round(), 1);
  v1::LeaveRequest leave;
  leave.set_node_id("b");
  leave.set_reason("node lost");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  ASSERT_EQ(jm_->Status().round(), 2);  // scaled down to a alone
  Last("a");

  ASSERT_TRUE(Join("c", 1).ok());
  auto wait = Last("c");
  ASSERT_TRUE(wait.has_value() && wait->has_wait());
  EXPECT_NE(wait->wait().reason().find("pre-flight check"), std::string::npos) << wait->wait().reason();
  jm_->Tick();  // within the last call: no check yet
  EXPECT_FALSE(Last("c").has_value());
  clock_.Advance(2.5);
  jm_->Tick();
  auto check = Last("c");
  ASSERT_TRUE(check.has_value() && check->has_run_check());
  EXPECT_EQ(check->run_check().world_size(), 1);  // alone
  const v1::JobStatus checking = jm_->Status();
  for (const auto& ns : checking.nodes()) {
    if (ns.node_id() == "c") {
      EXPECT_EQ(ns.state(), "checking");
    } else if (ns.node_id() == "a") {
      EXPECT_EQ(ns.state(), "training");
    }
  }
  EXPECT_FALSE(Last("a").has_value());             // the member keeps training
  ASSERT_TRUE(Report("c", check->run_check().check_id(), false, "exit code 1").ok());
  auto excluded = Last("c");
  ASSERT_TRUE(excluded.has_value() && excluded->has_excluded());
  EXPECT_EQ(jm_->Status().round(), 2);
  EXPECT_FALSE(Last("a").has_value());

  ASSERT_TRUE(Join("d", 1).ok());
  clock_.Advance(2.5);
  jm_->Tick();
  auto check_d = Last("d");
  ASSERT_TRUE(check_d.has_value() && check_d->has_run_check());
  // a's worker fails meanwhile: the restart in place does not take d.
  v1::FailureReport f;
  f.set_node_id("a");
  f.set_round(2);
  f.set_exit_code(1);
  ASSERT_TRUE(jm_->ReportFailure(f).ok());
  ASSERT_EQ(jm_->Status().round(), 3);
  EXPECT_EQ(jm_->Status().world_size(), 1);
  ASSERT_TRUE(Report("d", check_d->run_check().check_id(), true).ok());
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 4);  // scaled up with d
  EXPECT_EQ(st.world_size(), 2);
  EXPECT_NE(st.precheck().find("all 1 joining node(s) passed"), std::string::npos) << st.precheck();
  auto start = Last("d");
  ASSERT_TRUE(start.has_value() && start->has_start_round());
}

// The check turned on by a node that joins a running job (its agent has
// --network-check, the others not): the members keep training and stay in
// every new round; only the newcomer is checked.
TEST_F(JobMasterPrecheckTest, CheckTurnedOnMidJobKeepsTheMembers) {
  Make(3, /*min_nodes=*/2);
  ASSERT_TRUE(Join("a", 0, /*precheck=*/false).ok());
  ASSERT_TRUE(Join("b", 1, /*precheck=*/false).ok());
  clock_.Advance(2.5);
  jm_->Tick();
  ASSERT_EQ(jm_->Status().round(), 1);
  ASSERT_TRUE(Join("c", 2).ok());
  v1::FailureReport f;
  f.set_node_id("a");
  f.set_round(1);
  f.set_exit_code(1);
  ASSERT_TRUE(jm_->ReportFailure(f).ok());
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 2);
  EXPECT_EQ(st.world_size(), 2);  // a and b, not the unchecked c
  clock_.Advance(2.5);
  jm_->Tick();
  auto check = Last("c");
  ASSERT_TRUE(check.has_value() && check->has_run_check());
  EXPECT_EQ(check->run_check().world_size(), 1);
  ASSERT_TRUE(Report("c", check->run_check().check_id(), true).ok());
  st = jm_->Status();
  EXPECT_EQ(st.round(), 3);  // scale up: a, b and c
  EXPECT_EQ(st.world_size(), 3);
}

}  // namespace
}  // namespace ballast::master
