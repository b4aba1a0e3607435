#include "master/job_master.h"
#include "master/test_reports.h"

#include <cmath>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Pair;

class JobMasterTest : public ::testing::Test {
 protected:
  JobMasterOptions Options(int min_nodes, int max_nodes, int node_unit = 1, int max_restarts = 3) {
    JobMasterOptions o;
    o.job_id = "job1";
    o.min_nodes = min_nodes;
    o.max_nodes = max_nodes;
    o.node_unit = node_unit;
    o.max_restarts = max_restarts;
    o.last_call_s = 2.0;
    o.heartbeat_interval_s = 1.0;
    o.heartbeat_timeout_s = 5.0;
    o.wait_for_nodes_s = 30.0;
    o.clock = &clock_;
    o.on_node_lost = [this](const std::string& id, const std::string& reason) {
      lost_.emplace_back(id, reason);
    };
    return o;
  }
  void Make(const JobMasterOptions& o) {
    ASSERT_TRUE(ValidateJobMasterOptions(o).ok());
    jm_ = std::make_unique<JobMaster>(o);
  }

  absl::StatusOr<v1::JoinResponse> Join(const std::string& id, int hint = -1, int lws = 1) {
    v1::JoinRequest req;
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_node_rank_hint(hint);
    req.mutable_node()->set_local_world_size(lws);
    req.mutable_node()->set_host(id + ".host");
    auto r = jm_->Join(req);
    if (r.ok()) live_.insert(id);
    return r;
  }

  void Add(const std::string& id, int hint = -1, int lws = 1) {
    auto r = Join(id, hint, lws);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  // Every decision the node's Watch stream has to deliver now (opens the
  // stream on first use).
  std::vector<v1::Decision> Drain(const std::string& id) {
    if (handles_.count(id) == 0) {
      auto h = jm_->OpenWatch(id);
      EXPECT_TRUE(h.ok()) << h.status();
      if (!h.ok()) return {};
      handles_[id] = *h;
    }
    std::vector<v1::Decision> out;
    while (true) {
      auto next = jm_->NextDecision(handles_[id], 0);
      if (!next.ok() || !next->has_value()) break;
      out.push_back(**next);
    }
    return out;
  }
  v1::Decision Last(const std::string& id) {
    auto all = Drain(id);
    return all.empty() ? v1::Decision() : all.back();
  }

  // A progress report of `id` at `step` in `round` (tests set the rest).
  static v1::ProgressReport Progress(const std::string& id, int64_t round, int64_t step) {
    v1::ProgressReport p;
    p.set_node_id(id);
    p.set_round(round);
    p.set_step(step);
    return p;
  }

  // Advances the fake clock in 0.5 s steps; live nodes heartbeat each step.
  // Nodes a, b and c in round 1 of a job that excludes stragglers (2x the
  // median); the nodes it excludes are appended to *excluded. The round.
  int64_t StartStragglerJob(std::vector<std::string>* excluded) {
    JobMasterOptions o = Options(2, 3, 1, /*max_restarts=*/0);
    o.straggler_factor = 2.0;
    o.exclude_stragglers = true;
    o.on_node_excluded = [excluded](const std::string& id, const std::string&) { excluded->push_back(id); };
    Make(o);
    Add("a");
    Add("b");
    Add("c");
    Advance(0.5);
    return jm_->Status().round();
  }
  void Advance(double seconds) {
    for (double t = 0; t < seconds - 1e-9; t += 0.5) {
      double step = std::min(0.5, seconds - t);
      clock_.Advance(step);
      for (const auto& id : live_) (void)jm_->Heartbeat(HeartbeatFor(id));
      jm_->Tick();
    }
  }
  static v1::HeartbeatRequest HeartbeatFor(const std::string& id) {
    v1::HeartbeatRequest hb;
    hb.set_node_id(id);
    return hb;
  }

  absl::Status Fail(const std::string& id, int64_t round, int global_rank = 0, int exit_code = 1) {
    v1::FailureReport r;
    r.set_node_id(id);
    r.set_round(round);
    r.set_global_rank(global_rank);
    r.set_local_rank(0);
    r.set_exit_code(exit_code);
    r.set_stderr_tail("line one\nValueError: bad batch\n");
    return jm_->ReportFailure(r);
  }
  absl::Status Done(const std::string& id, int64_t round) {
    v1::WorkersDoneRequest r;
    r.set_node_id(id);
    r.set_round(round);
    return jm_->ReportWorkersDone(r);
  }

  FakeClock clock_;
  std::unique_ptr<JobMaster> jm_;
  std::set<std::string> live_;
  std::map<std::string, JobMaster::WatchHandle> handles_;
  std::vector<std::pair<std::string, std::string>> lost_;
};

v1::ShardDurableReport Shard(const std::string& dir, int64_t step, int rank, int world_size) {
  v1::ShardDurableReport r;
  r.set_node_id("n" + std::to_string(rank));
  r.set_round(1);
  r.set_dir(dir);
  r.set_step(step);
  r.set_rank(rank);
  r.set_world_size(world_size);
  return r;
}

TEST_F(JobMasterTest, ShardDurableCommitsExactlyOnceWhenAllRanksReported) {
  Make(Options(1, 1));
  auto r0 = jm_->ReportShardDurable(Shard("/ckpt", 5, 0, 3));
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_FALSE(r0->commit());
  EXPECT_EQ(r0->committed_step(), 0);
  // A repeated report of the same rank does not count twice.
  auto again = jm_->ReportShardDurable(Shard("/ckpt", 5, 0, 3));
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->commit());
  auto r2 = jm_->ReportShardDurable(Shard("/ckpt", 5, 2, 3));
  ASSERT_TRUE(r2.ok());
  EXPECT_FALSE(r2->commit());
  auto r1 = jm_->ReportShardDurable(Shard("/ckpt", 5, 1, 3));
  ASSERT_TRUE(r1.ok());
  EXPECT_TRUE(r1->commit());
  EXPECT_EQ(r1->committed_step(), 5);
  // A late report of a committed step (e.g. a breakpoint save) commits nothing.
  auto late = jm_->ReportShardDurable(Shard("/ckpt", 5, 1, 3));
  ASSERT_TRUE(late.ok());
  EXPECT_FALSE(late->commit());
  EXPECT_EQ(late->committed_step(), 5);
  auto older = jm_->ReportShardDurable(Shard("/ckpt", 4, 0, 3));
  ASSERT_TRUE(older.ok());
  EXPECT_FALSE(older->commit());
  EXPECT_EQ(older->committed_step(), 5);
}

TEST_F(JobMasterTest, ShardDurableTracksDirsAndStepsIndependently) {
  Make(Options(1, 1));
  ASSERT_FALSE(jm_->ReportShardDurable(Shard("/a", 1, 0, 2))->commit());
  ASSERT_FALSE(jm_->ReportShardDurable(Shard("/a", 2, 0, 2))->commit());
  ASSERT_FALSE(jm_->ReportShardDurable(Shard("/b", 1, 1, 2))->commit());
  // Step 2 of /a completes before step 1: it commits, and step 1 is dropped.
  auto a2 = jm_->ReportShardDurable(Shard("/a", 2, 1, 2));
  ASSERT_TRUE(a2.ok());
  EXPECT_TRUE(a2->commit());
  auto a1 = jm_->ReportShardDurable(Shard("/a", 1, 1, 2));
  ASSERT_TRUE(a1.ok());
  EXPECT_FALSE(a1->commit());
  EXPECT_EQ(a1->committed_step(), 2);
  auto b1 = jm_->ReportShardDurable(Shard("/b", 1, 0, 2));
  ASSERT_TRUE(b1.ok());
  EXPECT_TRUE(b1->commit());
  EXPECT_EQ(b1->committed_step(), 1);
}

TEST_F(JobMasterTest, ShardDurableWorldSizeChangeRecountsTheStep) {
  Make(Options(1, 1));
  ASSERT_FALSE(jm_->ReportShardDurable(Shard("/c", 7, 0, 4))->commit());
  ASSERT_FALSE(jm_->ReportShardDurable(Shard("/c", 7, 1, 4))->commit());
  // The world shrank to 2: the old world's shards of step 7 no longer count.
  ASSERT_FALSE(jm_->ReportShardDurable(Shard("/c", 7, 0, 2))->commit());
  EXPECT_TRUE(jm_->ReportShardDurable(Shard("/c", 7, 1, 2))->commit());
}

TEST_F(JobMasterTest, ShardDurableRejectsBadReports) {
  Make(Options(1, 1));
  EXPECT_EQ(jm_->ReportShardDurable(Shard("", 1, 0, 1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(jm_->ReportShardDurable(Shard("/d", 1, 2, 2)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(jm_->ReportShardDurable(Shard("/d", 1, -1, 2)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(jm_->ReportShardDurable(Shard("/d", 1, 0, 0)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobMasterTest, ShardDurablePendingStepsStayBounded) {
  Make(Options(1, 1));
  // Steps that never complete (rank 1 never reports) are capped; the oldest go.
  for (int step = 1; step <= 200; ++step) ASSERT_TRUE(jm_->ReportShardDurable(Shard("/e", step, 0, 2)).ok());
  // Step 1 was dropped: rank 1's report alone cannot complete it now.
  EXPECT_FALSE(jm_->ReportShardDurable(Shard("/e", 1, 1, 2))->commit());
  EXPECT_TRUE(jm_->ReportShardDurable(Shard("/e", 200, 1, 2))->commit());
}

TEST_F(JobMasterTest, InitialRoundStartsAtMaxNodesWithRanks) {
  Make(Options(2, 2));
  ASSERT_TRUE(Join("a", -1, 2).ok());
  EXPECT_TRUE(Last("a").has_wait());
  EXPECT_EQ(jm_->Status().state(), "rendezvous");
  ASSERT_TRUE(Join("b", 0, 3).ok());
  v1::Decision da = Last("a"), db = Last("b");
  ASSERT_TRUE(da.has_start_round());
  ASSERT_TRUE(db.has_start_round());
  const v1::StartRound& a = da.start_round();
  const v1::StartRound& b = db.start_round();
  EXPECT_EQ(a.round(), 1);
  EXPECT_EQ(b.round(), 1);
  // b has the hint, so it is group rank 0.
  EXPECT_EQ(b.group_rank(), 0);
  EXPECT_EQ(b.rank_offset(), 0);
  EXPECT_EQ(a.group_rank(), 1);
  EXPECT_EQ(a.rank_offset(), 3);
  EXPECT_EQ(a.world_size(), 5);
  EXPECT_EQ(a.group_world_size(), 2);
  EXPECT_EQ(a.restart_count(), 0);
  EXPECT_EQ(a.max_restarts(), 3);
  EXPECT_EQ(a.run_id(), "job1");
  ASSERT_EQ(a.members_size(), 2);
  EXPECT_EQ(a.members(0).node_id(), "b");
  EXPECT_EQ(a.members(1).host(), "a.host");
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.state(), "running");
  EXPECT_EQ(st.round(), 1);
  EXPECT_EQ(st.world_size(), 5);
  ASSERT_EQ(st.nodes_size(), 2);
  EXPECT_EQ(st.nodes(0).node_id(), "b");
  EXPECT_EQ(st.nodes(0).state(), "training");
}

// Heartbeats and ReportProgressFrom (one call for many nodes: ballast
// simulate) leave the master as each node's own call does.
TEST_F(JobMasterTest, BatchHeartbeatsAndProgressActAsEachNodesOwnCall) {
  Make(Options(3, 3));
  JobMaster batch(Options(3, 3));
  for (const std::string id : {"a", "b", "c"}) {
    Add(id);
    v1::JoinRequest req;
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_node_rank_hint(-1);
    req.mutable_node()->set_local_world_size(1);
    req.mutable_node()->set_host(id + ".host");
    ASSERT_TRUE(batch.Join(req).ok());
  }
  const int64_t round = jm_->Status().round();
  ASSERT_EQ(round, 1);
  ASSERT_EQ(batch.Status().round(), 1);
  const std::vector<NodeId> all = {"a"_node, "b"_node, "c"_node};
  for (int step = 1; step <= 4; ++step) {
    clock_.Advance(2.0);
    v1::ProgressReport p = Progress("", round, step);
    p.set_step_time_s(2.0);
    p.set_step_age_s(0.5);
    p.set_first_step_known(true);
    p.set_first_step(1);
    p.set_first_step_age_s(2.0 * step);
    p.set_ckpt_saves(step);
    p.set_ckpt_stall_sum_s(0.01 * step);
    for (const NodeId& id : all) {
      ASSERT_TRUE(jm_->Heartbeat(HeartbeatFor(id.str())).ok());
      p.set_node_id(id.str());
      ASSERT_TRUE(jm_->ReportProgress(p).ok());
    }
    ASSERT_TRUE(batch.Heartbeats(all).ok());
    p.set_node_id("ignored");
    ASSERT_TRUE(batch.ReportProgressFrom(all, p).ok());
    jm_->Tick();
    batch.Tick();
    EXPECT_EQ(batch.Status().SerializeAsString(), jm_->Status().SerializeAsString()) << "step " << step;
  }
  // An unknown node is refused as its own call would be; the others are still heard.
  clock_.Advance(4.0);
  EXPECT_EQ(batch.Heartbeats({"a"_node, "zz"_node, "b"_node}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(batch.ReportProgressFrom({"zz"_node, "a"_node}, Progress("", round, 5)).code(),
            absl::StatusCode::kNotFound);
  clock_.Advance(2.0);
  batch.Tick();
  const v1::JobStatus st = batch.Status();
  std::map<std::string, std::pair<std::string, int64_t>> nodes;
  for (const auto& n : st.nodes()) nodes[n.node_id()] = {n.state(), n.last_step()};
  EXPECT_EQ(nodes["c"].first, "dead");  // silent for 6 s
  EXPECT_NE(nodes["a"].first, "dead");
  EXPECT_NE(nodes["b"].first, "dead");
}

TEST_F(JobMasterTest, InitialRoundAtMinWaitsForLastCall) {
  Make(Options(2, 4));
  ASSERT_TRUE(Join("a").ok());
  ASSERT_TRUE(Join("b").ok());
  Advance(1.5);
  EXPECT_TRUE(Last("a").has_wait());
  EXPECT_EQ(jm_->Status().state(), "rendezvous");
  Advance(0.5);
  EXPECT_TRUE(Last("a").has_start_round());
  EXPECT_EQ(jm_->Status().round(), 1);
}

TEST_F(JobMasterTest, JoinResponseCarriesMasterSettings) {
  Make(Options(2, 2));
  auto r = Join("a");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->job_id(), "job1");
  EXPECT_EQ(r->spec().min_nodes(), 2);
  EXPECT_EQ(r->spec().max_restarts(), 3);
  EXPECT_DOUBLE_EQ(r->heartbeat_timeout_s(), 5.0);
}

TEST_F(JobMasterTest, RestartInPlaceIncrementsRestartCountAndRound) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  ASSERT_TRUE(Fail("b", 1, 1, 7).ok());
  for (const char* id : {"a", "b"}) {
    v1::Decision d = Last(id);
    ASSERT_TRUE(d.has_start_round()) << id;
    EXPECT_EQ(d.start_round().round(), 2);
    EXPECT_EQ(d.start_round().restart_count(), 1);
  }
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.restart_count(), 1);
  EXPECT_EQ(st.round(), 2);
  EXPECT_EQ(st.last_failure().node_id(), "b");
  EXPECT_EQ(st.last_failure().exit_code(), 7);
  EXPECT_EQ(st.last_failure().cause(), "exit code 7");
}

TEST_F(JobMasterTest, FailureReportWithAnUnknownKindIsRefusedAndChangesNothing) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  v1::FailureReport r;
  r.set_node_id("b");
  r.set_round(1);
  r.set_exit_code(1);
  r.set_kind("gremlins");
  absl::Status s = jm_->ReportFailure(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown failure kind \"gremlins\""));
  EXPECT_EQ(jm_->Status().restart_count(), 0);
  EXPECT_EQ(jm_->Status().round(), 1);
}

TEST_F(JobMasterTest, MaxRestartsExhaustedFailsWithRankExitCodeAndStderr) {
  Make(Options(2, 2, 1, /*max_restarts=*/1));
  Add("a");
  Add("b");
  ASSERT_TRUE(Fail("a", 1).ok());
  ASSERT_TRUE(Fail("b", 2, /*global_rank=*/1, /*exit_code=*/7).ok());
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_job_finished());
  EXPECT_FALSE(d.job_finished().succeeded());
  const std::string& msg = d.job_finished().message();
  EXPECT_THAT(msg, HasSubstr("worker rank 1"));
  EXPECT_THAT(msg, HasSubstr("node b (host b.host)"));
  EXPECT_THAT(msg, HasSubstr("exit code 7"));
  EXPECT_THAT(msg, HasSubstr("used 1 of 1 restarts"));
  EXPECT_THAT(msg, EndsWith("line one\nValueError: bad batch"));
  EXPECT_TRUE(Last("b").has_job_finished());
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.state(), "failed");
  EXPECT_EQ(st.message(), msg);
  ASSERT_TRUE(jm_->outcome().has_value());
  EXPECT_FALSE(jm_->outcome()->succeeded);
  EXPECT_EQ(jm_->outcome()->restart_count, 1);
  // The other rank's report of the same round is logged and ignored.
  EXPECT_TRUE(Fail("a", 2).ok());
  EXPECT_EQ(jm_->Status().round(), 2);
  // Nobody joins a finished job.
  auto late = Join("c");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("job already finished"));
}

TEST_F(JobMasterTest, StaleRoundReportIsAbortedAndChangesNothing) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  ASSERT_TRUE(Fail("a", 1).ok());
  Drain("a");
  Drain("b");
  absl::Status s = Fail("b", 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.message(), "stale round 1 (current is 2)");
  EXPECT_EQ(Done("b", 1).code(), absl::StatusCode::kAborted);
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 2);
  EXPECT_EQ(st.restart_count(), 1);
  EXPECT_EQ(st.state(), "running");
  EXPECT_TRUE(Drain("a").empty());
}

TEST_F(JobMasterTest, DisconnectedAgentIsLostAfterGraceBeforeHeartbeatTimeout) {
  auto o = Options(1, 2);
  o.disconnect_grace_s = 1.0;
  Make(o);
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  jm_->CloseWatch(handles_["b"]);  // b's agent died: its connection closed
  Advance(1.0);                     // b still "heartbeats" here: the stream decides
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().round(), 2);
  EXPECT_EQ(d.start_round().group_world_size(), 1);
  ASSERT_EQ(lost_.size(), 1u);
  EXPECT_EQ(lost_[0].first, "b");
  EXPECT_THAT(lost_[0].second, HasSubstr("agent disconnected"));
}

TEST_F(JobMasterTest, ReconnectWithinGraceKeepsNode) {
  auto o = Options(1, 2);
  o.disconnect_grace_s = 1.0;
  Make(o);
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  jm_->CloseWatch(handles_["b"]);
  handles_.erase("b");
  Advance(0.5);
  Drain("b");  // reopens the stream
  Advance(2.0);
  EXPECT_TRUE(lost_.empty());
  EXPECT_EQ(jm_->Status().round(), 1);
}

// The master tells its backend at once when an agent hangs up (an early
// replacement can start: NodeManager), and the status shows it, until the
// agent reconnects; once per disconnect, and not after the job ended.
TEST_F(JobMasterTest, AnAgentHangingUpIsToldAtOnceAndShownInTheStatusUntilItReconnects) {
  auto o = Options(1, 2);
  o.disconnect_grace_s = 1.0;
  std::vector<std::string> told;
  o.on_node_disconnected = [&](const std::string& id) { told.push_back(id); };
  Make(o);
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  auto disconnected = [&](const std::string& id) {
    const v1::JobStatus st = jm_->Status();
    for (const auto& n : st.nodes()) {
      if (n.node_id() == id) return n.disconnected();
    }
    ADD_FAILURE() << "no node " << id;
    return false;
  };
  EXPECT_FALSE(disconnected("b"));
  const JobMaster::WatchHandle old = handles_["b"];
  jm_->CloseWatch(old);
  EXPECT_THAT(told, ElementsAre("b"));
  EXPECT_TRUE(disconnected("b"));
  EXPECT_FALSE(disconnected("a"));
  jm_->CloseWatch(old);  // the same stream again: nothing new
  handles_.erase("b");
  Advance(0.5);
  Drain("b");  // reopens the stream
  EXPECT_FALSE(disconnected("b"));
  jm_->CloseWatch(old);  // the stale stream's close is not a disconnect
  EXPECT_THAT(told, ElementsAre("b"));
  jm_->CloseWatch(handles_["b"]);
  EXPECT_THAT(told, ElementsAre("b", "b"));
  jm_->Abort("stopped");
  jm_->CloseWatch(handles_["a"]);
  EXPECT_THAT(told, ElementsAre("b", "b"));
}

TEST_F(JobMasterTest, AbortFailsTheJobAndTellsEveryAgentOnce) {
  Make(Options(1, 2));
  Add("a");
  Add("b");
  jm_->Abort("every worker pod ended and spec.maxReplacements (3) is used up");
  ASSERT_TRUE(jm_->outcome().has_value());
  EXPECT_FALSE(jm_->outcome()->succeeded);
  EXPECT_EQ(jm_->outcome()->message, "job failed: every worker pod ended and spec.maxReplacements (3) is used up");
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_job_finished());
  EXPECT_FALSE(d.job_finished().succeeded());
  jm_->Abort("a second reason");  // a no-op once finished
  EXPECT_THAT(jm_->outcome()->message, HasSubstr("maxReplacements"));
}

TEST_F(JobMasterTest, FailureCausedByLostNodeIsNotCountedAsRestart) {
  auto o = Options(1, 2);
  o.disconnect_grace_s = 1.0;
  Make(o);
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  jm_->CloseWatch(handles_["b"]);       // b's agent was killed...
  ASSERT_TRUE(Fail("a", 1, 0, 1).ok());  // ...so a's worker fails in the collective
  EXPECT_TRUE(Drain("a").empty());       // held while b is disconnected
  Advance(1.0);
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().group_world_size(), 1);
  EXPECT_EQ(d.start_round().restart_count(), 0);
  EXPECT_EQ(jm_->Status().restart_count(), 0);
  EXPECT_EQ(jm_->Status().round(), 2);
}

TEST_F(JobMasterTest, HeldFailureRestartsOnceDisconnectedPeerIsBack) {
  auto o = Options(2, 2);
  o.disconnect_grace_s = 1.0;
  Make(o);
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  jm_->CloseWatch(handles_["b"]);
  handles_.erase("b");
  ASSERT_TRUE(Fail("a", 1, 0, 1).ok());
  Advance(0.5);
  EXPECT_TRUE(Drain("a").empty());
  Drain("b");  // b reconnects: the failure was a real one
  Advance(0.5);
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().restart_count(), 1);
  EXPECT_EQ(jm_->Status().restart_count(), 1);
}

TEST_F(JobMasterTest, SingleNodeRoundDecidesFailureWithoutSettle) {
  auto o = Options(1, 1);
  o.failure_settle_s = 0.5;
  Make(o);
  Add("a");
  Drain("a");
  ASSERT_TRUE(Fail("a", 1, 0, 7).ok());
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().restart_count(), 1);
}

TEST_F(JobMasterTest, FailureSettleDelaysTheDecision) {
  auto o = Options(2, 2);
  o.failure_settle_s = 0.5;
  Make(o);
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  ASSERT_TRUE(Fail("b", 1, 1, 7).ok());
  EXPECT_TRUE(Drain("a").empty());
  Advance(0.5);
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().restart_count(), 1);
}

// Two nodes hang together (one rank sleeps, the other waits for it in the
// allreduce): the hang report of the rank outside a collective is blamed even
// though the waiting rank's agent reported first; a crash report that follows
// the kill comes after both.
TEST_F(JobMasterTest, HangOutsideACollectiveIsBlamedOverTheRankWaitingForIt) {
  auto o = Options(3, 3);
  o.failure_settle_s = 0.1;
  o.hang_settle_s = 3.0;
  Make(o);
  Add("a");
  Add("b");
  Add("c");
  for (const char* id : {"a", "b", "c"}) Drain(id);
  auto hang = [](const std::string& id, int rank, bool in_collective, const std::string& frame) {
    v1::FailureReport r;
    r.set_node_id(id);
    r.set_round(1);
    r.set_global_rank(rank);
    r.set_signal(9);
    r.set_kind("hang");
    r.set_cause("hung (no progress)");
    r.set_max_retries(-1);  // as the agent classifies a hang
    r.set_stderr_tail("no progress for 3 s");
    r.set_hang_last_step(5);
    r.set_hang_idle_s(3.0);
    r.set_hang_stack_found(true);
    r.set_hang_in_collective(in_collective);
    r.set_hang_top_frame(frame);
    return r;
  };
  ASSERT_TRUE(jm_->ReportFailure(hang("a", 0, true, "torch/autograd/__init__.py:197 in backward")).ok());
  ASSERT_TRUE(Fail("c", 1, 2, 1).ok());  // gloo: connection closed by peer
  Advance(1.0);
  EXPECT_TRUE(Drain("a").empty()) << "a hang report waits for the other nodes' reports";
  ASSERT_TRUE(jm_->ReportFailure(hang("b", 1, false, "train.py:10 in <module>")).ok());
  Advance(2.5);
  v1::JobStatus st = jm_->Status();
  ASSERT_EQ(st.round(), 2);
  EXPECT_EQ(st.restart_count(), 1);
  EXPECT_EQ(st.last_failure().node_id(), "b");
  EXPECT_EQ(st.last_failure().global_rank(), 1);
  EXPECT_THAT(st.last_failure().stderr_tail(), HasSubstr("rank 0 on node a (waiting in a collective at torch/autograd"));
}

TEST_F(JobMasterTest, ScaleDownOnHeartbeatTimeoutStartsNewRoundAtOnce) {
  Make(Options(2, 3));
  Add("a");
  Add("b");
  Add("c");
  EXPECT_EQ(jm_->Status().round(), 1);
  Drain("a");
  live_.erase("c");  // c's agent goes silent
  Advance(5.5);
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().round(), 2);
  EXPECT_EQ(d.start_round().group_world_size(), 2);
  EXPECT_EQ(d.start_round().restart_count(), 0);  // membership changes are free
  EXPECT_THAT(lost_, ElementsAre(Pair("c", "heartbeat timeout")));
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.restart_count(), 0);
  EXPECT_EQ(st.state(), "running");
  ASSERT_EQ(st.nodes_size(), 3);
  EXPECT_EQ(st.nodes(2).node_id(), "c");
  EXPECT_EQ(st.nodes(2).state(), "dead");
  EXPECT_EQ(jm_->Heartbeat(HeartbeatFor("c")).code(), absl::StatusCode::kNotFound);
}

TEST_F(JobMasterTest, BelowMinStopsWaitsThenFailsAfterWaitForNodes) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Drain("a");
  live_.erase("b");
  Advance(5.5);
  std::vector<v1::Decision> ds = Drain("a");
  ASSERT_EQ(ds.size(), 2u);
  EXPECT_TRUE(ds[0].has_stop_workers());
  EXPECT_EQ(ds[0].stop_workers().round(), 1);
  EXPECT_TRUE(ds[1].has_wait());
  EXPECT_EQ(jm_->Status().state(), "rendezvous");
  Advance(29.5);
  EXPECT_EQ(jm_->Status().state(), "rendezvous");
  Advance(1.0);
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.state(), "failed");
  EXPECT_EQ(st.message(),
            "job failed: it needs at least 2 nodes but has 1 after node b was lost (heartbeat "
            "timeout); waited 30 s for replacements (lower --nnodes MIN or start more agents)");
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_job_finished());
  EXPECT_FALSE(d.job_finished().succeeded());
  EXPECT_THAT(d.job_finished().message(), HasSubstr("needs at least 2 nodes but has 1"));
}

TEST_F(JobMasterTest, BelowMinRecoversWhenReplacementJoins) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  live_.erase("b");
  Advance(6);
  ASSERT_EQ(jm_->Status().state(), "rendezvous");
  Add("c");
  v1::Decision d = Last("c");
  ASSERT_TRUE(d.has_start_round());  // MAX reached: no last call
  EXPECT_EQ(d.start_round().round(), 2);
  EXPECT_EQ(d.start_round().restart_count(), 0);
  EXPECT_EQ(jm_->Status().state(), "running");
}

TEST_F(JobMasterTest, ScaleUpAfterLateJoinAndLastCall) {
  Make(Options(2, 4));
  Add("a");
  Add("b");
  Advance(2);
  ASSERT_EQ(jm_->Status().round(), 1);
  Drain("a");
  Add("c", -1, 2);
  v1::Decision w = Last("c");
  ASSERT_TRUE(w.has_wait());
  EXPECT_THAT(w.wait().reason(), HasSubstr("new round with 3 nodes"));
  Advance(1.5);
  EXPECT_EQ(jm_->Status().round(), 1);
  Advance(0.5);
  for (const char* id : {"a", "b", "c"}) {
    v1::Decision d = Last(id);
    ASSERT_TRUE(d.has_start_round()) << id;
    EXPECT_EQ(d.start_round().round(), 2);
    EXPECT_EQ(d.start_round().group_world_size(), 3);
    EXPECT_EQ(d.start_round().world_size(), 4);
    EXPECT_EQ(d.start_round().restart_count(), 0);
  }
}

TEST_F(JobMasterTest, SurplusNodeGetsWait) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Add("c");
  v1::Decision d = Last("c");
  ASSERT_TRUE(d.has_wait());
  EXPECT_THAT(d.wait().reason(), HasSubstr("surplus node"));
  Advance(10);
  EXPECT_EQ(jm_->Status().round(), 1);
  EXPECT_TRUE(Drain("c").empty());
}

// With hot spares (expected_nodes > MAX) the first round waits briefly for
// every node the scheduler started: the lowest node ranks train, the highest
// wait as spares (and would be pre-checked with the rest).
TEST_F(JobMasterTest, FirstRoundWaitsForTheStartingSparesThenLowestRanksTrain) {
  JobMasterOptions o = Options(2, 2);
  o.expected_nodes = 3;
  Make(o);
  Add("spare", /*hint=*/2);
  Add("b", /*hint=*/1);
  EXPECT_EQ(jm_->Status().round(), 0);  // MAX (2) joined, but only 2 of the 3 started nodes
  Add("a", /*hint=*/0);
  ASSERT_EQ(jm_->Status().round(), 1);  // all 3 started nodes joined: at once
  EXPECT_EQ(Last("a").start_round().group_rank(), 0);
  EXPECT_EQ(Last("b").start_round().group_rank(), 1);
  EXPECT_THAT(Last("spare").wait().reason(), HasSubstr("surplus node"));
  v1::JobStatus st = jm_->Status();
  std::map<std::string, std::string> states;
  for (const auto& n : st.nodes()) states[n.node_id()] = n.state();
  EXPECT_EQ(states["spare"], "spare");
}

// The driver's word that the scheduler lost a node (Leave with `lost`): the
// node is dead with the scheduler's reason, not "left", and a new round
// starts without waiting for its heartbeats to run out.
TEST_F(JobMasterTest, ANodeTheSchedulerLostIsDeadAtOnceWithItsReason) {
  Make(Options(2, 2));
  Add("a", 0);
  Add("b", 1);
  ASSERT_EQ(jm_->Status().round(), 1);
  v1::LeaveRequest lost;
  lost.set_node_id("b");
  lost.set_reason("its Ray node 8f3c died");
  lost.set_lost(true);
  ASSERT_TRUE(jm_->Leave(lost).ok());
  v1::JobStatus st = jm_->Status();
  bool seen = false;
  for (const auto& n : st.nodes()) {
    if (n.node_id() != "b") continue;
    seen = true;
    EXPECT_EQ(n.state(), "dead");
    EXPECT_EQ(n.reason(), "its Ray node 8f3c died");
  }
  EXPECT_TRUE(seen);
  EXPECT_GE(st.round(), 1);
  EXPECT_NE(st.state(), "running") << st.message();  // the world of 2 lost a member: no round runs with a dead node
  ASSERT_TRUE(jm_->Leave(lost).ok());  // again: a no-op
  // Its agent, not dead yet, joins again: refused, saying why.
  auto again = Join("b", 1, 1);
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(again.status())) << again.status();
  EXPECT_THAT(again.status().message(), HasSubstr("node b is gone from the job (its Ray node 8f3c died)"));
  Add("c", 1);  // its replacement joins
}

TEST_F(JobMasterTest, FirstRoundWaitsForSparesOnlyForTheLastCall) {
  JobMasterOptions o = Options(2, 2);
  o.expected_nodes = 3;
  Make(o);
  Add("a", 0);
  Add("b", 1);
  EXPECT_EQ(jm_->Status().round(), 0);
  EXPECT_THAT(Last("b").wait().reason(), HasSubstr("unless the other 1 starting node(s) (spares) join first"));
  Advance(2.5);  // last call (2 s) after the last join: the spare is late
  ASSERT_EQ(jm_->Status().round(), 1);
  // Later rounds do not wait for spares: a lost member is replaced at once.
  Add("c", 2);
  v1::LeaveRequest leave;
  leave.set_node_id("a");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 2);
  // Said as what it is: a promotion, not a scale-down (the world stays at 2).
  EXPECT_THAT(st.message(), HasSubstr("spare node c takes the place of node a (the world stays at 2 nodes)"));
  EXPECT_THAT(st.message(), Not(HasSubstr("scale down")));
  ASSERT_GT(st.failures_size(), 0);
  EXPECT_EQ(st.failures(st.failures_size() - 1).action(), "spare c promoted");
  bool event = false;
  for (const auto& e : jm_->events().After(0, 0)) event = event || (e.kind() == "spare_promoted" && e.node_id() == "c");
  EXPECT_TRUE(event);
}

// The replacement policy: a lost member's place goes to the spare that has
// waited longest, not to the one with the lowest node rank (`ballast launch
// --spares` starts a lost node's replacement with the lost node's rank, so it
// would jump the queue), and the surviving members stay.
TEST_F(JobMasterTest, TheLongestWaitingSpareTakesALostNodesPlace) {
  JobMasterOptions o = Options(2, 2);
  o.expected_nodes = 4;  // MAX 2 + 2 spares
  Make(o);
  Add("node-0", 0);
  Add("node-1", 1);
  Add("node-3", 3);  // the spares joined in this order
  Add("node-2", 2);
  ASSERT_EQ(jm_->Status().round(), 1);
  v1::LeaveRequest leave;
  leave.set_node_id("node-0");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  v1::JobStatus st = jm_->Status();
  ASSERT_EQ(st.round(), 2);
  EXPECT_THAT(st.message(), HasSubstr("spare node node-3 takes the place of node node-0 "));
  // node-0's replacement joins (node rank 0 again) and waits behind node-2.
  Advance(1);
  Add("node-0-2", 0);
  EXPECT_THAT(Last("node-0-2").wait().reason(), HasSubstr("surplus node"));
  leave.set_node_id("node-1");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  st = jm_->Status();
  ASSERT_EQ(st.round(), 3);
  EXPECT_THAT(st.message(), HasSubstr("spare node node-2 takes the place of node node-1 "));
  EXPECT_EQ(st.failures(st.failures_size() - 1).action(), "spare node-2 promoted");
  // The new world: the surviving member and the promoted spare, ranked by
  // their node ranks; the newer replacement still waits.
  v1::Decision d2 = Last("node-2"), d3 = Last("node-3");
  ASSERT_TRUE(d2.has_start_round());
  ASSERT_TRUE(d3.has_start_round());
  EXPECT_EQ(d2.start_round().round(), 3);
  EXPECT_EQ(d2.start_round().group_rank(), 0);
  EXPECT_EQ(d3.start_round().group_rank(), 1);
  EXPECT_TRUE(Last("node-0-2").has_wait());
  st = jm_->Status();
  std::map<std::string, std::string> states;
  for (const auto& n : st.nodes()) states[n.node_id()] = n.state();
  EXPECT_EQ(states["node-0-2"], "spare");
}

// The surviving members stay in the new world: spares with lower node ranks
// fill the free place, they do not push a member out (its workers hold the
// in-memory checkpoint).
TEST_F(JobMasterTest, ASpareWithALowerNodeRankDoesNotPushOutASurvivingMember) {
  Make(Options(2, 2));
  Add("x", 5);
  Add("y", 6);
  ASSERT_EQ(jm_->Status().round(), 1);
  Add("q", 1);
  Advance(0.5);
  Add("p", 0);
  v1::LeaveRequest leave;
  leave.set_node_id("y");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  v1::JobStatus st = jm_->Status();
  ASSERT_EQ(st.round(), 2);
  EXPECT_THAT(st.message(), HasSubstr("spare node q takes the place of node y "));
  std::map<std::string, std::string> states;
  for (const auto& n : st.nodes()) states[n.node_id()] = n.state();
  EXPECT_EQ(states["x"], "training");
  EXPECT_EQ(states["q"], "training");
  EXPECT_EQ(states["p"], "spare");
  v1::Decision dx = Last("x");
  ASSERT_TRUE(dx.has_start_round());
  EXPECT_EQ(dx.start_round().round(), 2);
  EXPECT_EQ(dx.start_round().group_rank(), 1);  // ranked by node rank: q (1) before x (5)
}

TEST_F(JobMasterTest, NodeUnitKeepsLateNodeWaitingUntilAUnitIsComplete) {
  Make(Options(2, 4, /*node_unit=*/2));
  Add("a");
  Add("b");
  Advance(2);
  ASSERT_EQ(jm_->Status().round(), 1);
  Add("c");
  EXPECT_THAT(Last("c").wait().reason(), HasSubstr("surplus node"));
  Advance(5);
  EXPECT_EQ(jm_->Status().round(), 1);
  Add("d");
  EXPECT_EQ(jm_->Status().round(), 2);  // MAX reached: at once
  EXPECT_EQ(Last("d").start_round().group_world_size(), 4);
}

TEST_F(JobMasterTest, FailureRestartIncludesWaitingNodesWhenWorldGrows) {
  Make(Options(2, 4, /*node_unit=*/2));
  Add("a");
  Add("b");
  Advance(2);
  Add("c");
  ASSERT_TRUE(Fail("a", 1).ok());
  EXPECT_EQ(Last("c").has_wait(), true);  // 3 nodes round down to 2: c stays out
  Add("d");                              // MAX: scale up to 4
  ASSERT_EQ(jm_->Status().round(), 3);
  EXPECT_EQ(Last("d").start_round().restart_count(), 1);
}

TEST_F(JobMasterTest, SpecMismatchIsRefusedNamingTheDifference) {
  Make(Options(2, 2));
  v1::JoinRequest req;
  req.mutable_node()->set_node_id("a");
  req.mutable_node()->set_local_world_size(1);
  req.mutable_spec()->set_min_nodes(1);
  req.mutable_spec()->set_max_nodes(4);
  auto r = jm_->Join(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(),
            "this agent was started with --nnodes 1:4 but the job master runs --nnodes 2:2; "
            "start the agent with the same --nnodes or without it");
  req.mutable_spec()->Clear();
  req.mutable_spec()->set_max_restarts(0);
  r = jm_->Join(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("--max-restarts 0 but the job master runs "
                                              "--max-restarts 3"));
  req.mutable_spec()->Clear();
  req.mutable_spec()->set_run_id("other");
  EXPECT_THAT(jm_->Join(req).status().message(), HasSubstr("--rdzv-id other"));
  req.mutable_spec()->Clear();
  req.mutable_spec()->set_node_unit(2);
  EXPECT_THAT(jm_->Join(req).status().message(), HasSubstr("--node-unit 2"));
  // A remote master does not silently ignore an agent's last call (torchrun's
  // --rdzv-conf last_call_timeout): it refuses a different one.
  req.mutable_spec()->Clear();
  req.mutable_spec()->set_last_call_s(0);
  EXPECT_THAT(jm_->Join(req).status().message(),
              HasSubstr("--rdzv-conf last_call_timeout=0 but the job master waits 2 s after the last join"));
  EXPECT_EQ(jm_->Status().nodes_size(), 0);
  // Matching or absent settings are fine.
  req.mutable_spec()->Clear();
  req.mutable_spec()->set_min_nodes(2);
  req.mutable_spec()->set_max_nodes(2);
  req.mutable_spec()->set_max_restarts(3);
  req.mutable_spec()->set_run_id("job1");
  req.mutable_spec()->set_last_call_s(2.0);
  EXPECT_TRUE(jm_->Join(req).ok());
}

TEST_F(JobMasterTest, ZeroLocalWorldSizeIsInvalid) {
  Make(Options(1, 1));
  EXPECT_EQ(Join("a", -1, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobMasterTest, JobSucceedsWhenAllMembersReportDone) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Add("c");  // surplus: hears the end too
  ASSERT_TRUE(Done("a", 1).ok());
  EXPECT_EQ(jm_->Status().state(), "running");
  EXPECT_EQ(jm_->Status().nodes(0).state(), "done");
  ASSERT_TRUE(Done("b", 1).ok());
  for (const char* id : {"a", "b", "c"}) {
    v1::Decision d = Last(id);
    ASSERT_TRUE(d.has_job_finished()) << id;
    EXPECT_TRUE(d.job_finished().succeeded());
  }
  EXPECT_EQ(jm_->Status().state(), "succeeded");
  auto outcome = jm_->WaitForFinish(0);
  ASSERT_TRUE(outcome.has_value());
  EXPECT_TRUE(outcome->succeeded);
}

TEST_F(JobMasterTest, KvGetWaitsForSet) {
  Make(Options(1, 1));
  std::thread setter([this] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(jm_->KvSet("round/1/master_endpoint", "h:123").ok());
  });
  auto v = jm_->KvGet("round/1/master_endpoint", 5.0);
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "h:123");
  EXPECT_EQ(jm_->KvGet("missing", 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(jm_->KvGet("missing", 0.05).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(jm_->KvGet("missing", 5.0, [] { return true; }).status().code(),
            absl::StatusCode::kCancelled);
}

TEST_F(JobMasterTest, KvGetAsyncAnswersOnceAtOnceOnSetOnDeadlineOrCancel) {
  Make(Options(1, 1));
  std::vector<std::pair<std::string, absl::StatusOr<std::string>>> answers;
  auto record = [&answers](std::string name) {
    return [&answers, name](absl::StatusOr<std::string> v) { answers.emplace_back(name, std::move(v)); };
  };
  ASSERT_TRUE(jm_->KvSet("set", "v0").ok());
  EXPECT_EQ(jm_->KvGetAsync("set", 5, record("now")), 0u);              // set already
  EXPECT_EQ(jm_->KvGetAsync("missing", 0, record("no wait")), 0u);       // NOT_FOUND at once
  EXPECT_NE(jm_->KvGetAsync("later", 5, record("on set 1")), 0u);
  EXPECT_NE(jm_->KvGetAsync("later", 5, record("on set 2")), 0u);
  EXPECT_NE(jm_->KvGetAsync("never", 0.05, record("deadline")), 0u);
  const uint64_t cancelled = jm_->KvGetAsync("never", 5, record("cancelled"));
  ASSERT_EQ(answers.size(), 2u);
  ASSERT_TRUE(jm_->KvSet("later", "v1").ok());  // both waiters of the key
  jm_->CancelKvWait(cancelled);
  jm_->CancelKvWait(cancelled);  // a second cancel is a no-op
  absl::SleepFor(absl::Milliseconds(80));
  jm_->Tick();  // expires the deadline waiter
  jm_->Tick();
  std::map<std::string, absl::StatusOr<std::string>> by(answers.begin(), answers.end());
  ASSERT_EQ(answers.size(), 6u);  // each exactly once
  EXPECT_EQ(*by.at("now"), "v0");
  EXPECT_EQ(by.at("no wait").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*by.at("on set 1"), "v1");
  EXPECT_EQ(*by.at("on set 2"), "v1");
  EXPECT_EQ(by.at("deadline").status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(by.at("cancelled").status().code(), absl::StatusCode::kCancelled);
  // Shutdown answers whoever still waits.
  EXPECT_NE(jm_->KvGetAsync("never", 5, record("shutdown")), 0u);
  jm_->Shutdown();
  ASSERT_EQ(answers.size(), 7u);
  EXPECT_EQ(answers.back().second.status().code(), absl::StatusCode::kUnavailable);
}

// A DecisionSink that records what the master hands it.
struct RecordingSink : JobMaster::DecisionSink {
  void Deliver(const v1::Decision& d) override { decisions.push_back(d); }
  void End(const absl::Status& s) override { ended.push_back(s); }
  std::vector<v1::Decision> decisions;
  std::vector<absl::Status> ended;
};

TEST_F(JobMasterTest, SinkWatchGetsCurrentDecisionPushesAndOneEnd) {
  Make(Options(1, 2));
  Add("a");
  auto sink = std::make_shared<RecordingSink>();
  auto h = jm_->OpenWatch("a", sink);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(sink->decisions.size(), 1u);  // the current one, before OpenWatch returned
  EXPECT_TRUE(sink->decisions[0].has_wait());
  Add("b");  // MAX: the round starts, and the decision is pushed to the sink
  ASSERT_EQ(sink->decisions.size(), 2u);
  EXPECT_EQ(sink->decisions.back().start_round().round(), 1);
  // A newer stream of the node ends this one (CANCELLED) and gets the current decision.
  auto newer = std::make_shared<RecordingSink>();
  ASSERT_TRUE(jm_->OpenWatch("a", newer).ok());
  ASSERT_EQ(sink->ended.size(), 1u);
  EXPECT_EQ(sink->ended[0].code(), absl::StatusCode::kCancelled);
  ASSERT_EQ(newer->decisions.size(), 1u);
  EXPECT_EQ(newer->decisions.back().start_round().round(), 1);
  EXPECT_EQ(sink->decisions.size(), 2u);  // nothing more reaches the replaced stream
  // The node leaves: its stream ends NOT_FOUND; the other's ends at shutdown.
  auto sb = std::make_shared<RecordingSink>();
  ASSERT_TRUE(jm_->OpenWatch("b", sb).ok());
  v1::LeaveRequest leave;
  leave.set_node_id("a");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  ASSERT_EQ(newer->ended.size(), 1u);
  EXPECT_EQ(newer->ended[0].code(), absl::StatusCode::kNotFound);
  jm_->Shutdown();
  ASSERT_EQ(sb->ended.size(), 1u);
  EXPECT_EQ(sb->ended[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(sink->ended.size(), 1u);  // never ended twice
}

TEST_F(JobMasterTest, BigWorldsListRankZeroAndTheRingNeighboursOnly) {
  for (int n : {JobMaster::kFullMemberListNodes, 100}) {
    handles_.clear();
    live_.clear();
    Make(Options(n, n));
    for (int i = 0; i < n; ++i) Add(absl::StrCat("n", 1000 + i));
    auto members_of = [&](int rank) {
      const v1::StartRound s = Last(absl::StrCat("n", 1000 + rank)).start_round();
      EXPECT_EQ(s.group_rank(), rank);
      std::set<int> ranks;
      for (const auto& m : s.members()) ranks.insert(m.group_rank());
      return ranks;
    };
    EXPECT_EQ(members_of(0).size(), static_cast<size_t>(n));  // rank 0 always has everyone
    if (n <= JobMaster::kFullMemberListNodes) {
      EXPECT_EQ(members_of(5).size(), static_cast<size_t>(n));
      continue;
    }
    EXPECT_EQ(members_of(5), (std::set<int>{0, 6, 7, 8, 9, 10, 11, 12, 13}));
    EXPECT_EQ(members_of(n - 2), (std::set<int>{0, n - 1, 1, 2, 3, 4, 5, 6}));  // wraps past rank 0
  }
}

TEST_F(JobMasterTest, WatchDeliversCurrentDecisionOnReconnectAndNewerReplacesOlder) {
  Make(Options(1, 1));
  Add("a");
  auto h1 = jm_->OpenWatch("a");
  ASSERT_TRUE(h1.ok());
  auto first = jm_->NextDecision(*h1, 0);
  ASSERT_TRUE(first.ok() && first->has_value());
  EXPECT_TRUE((*first)->has_start_round());
  auto h2 = jm_->OpenWatch("a");
  ASSERT_TRUE(h2.ok());
  EXPECT_EQ(jm_->NextDecision(*h1, 0).status().code(), absl::StatusCode::kCancelled);
  auto again = jm_->NextDecision(*h2, 0);
  ASSERT_TRUE(again.ok() && again->has_value());
  EXPECT_EQ((*again)->start_round().round(), 1);
  EXPECT_EQ(jm_->OpenWatch("ghost").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(JobMasterTest, NextDecisionBlocksUntilADecisionArrives) {
  Make(Options(2, 2));
  Add("a");
  Drain("a");
  std::thread joiner([this] {
    absl::SleepFor(absl::Milliseconds(100));
    Add("b");
  });
  auto next = jm_->NextDecision(handles_["a"], 5.0);
  joiner.join();
  ASSERT_TRUE(next.ok() && next->has_value());
  EXPECT_TRUE((*next)->has_start_round());
}

TEST_F(JobMasterTest, RejoinDuringRoundKeepsNodeInRound) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  ASSERT_TRUE(Join("a").ok());
  EXPECT_EQ(jm_->Status().round(), 1);
  EXPECT_EQ(Last("a").start_round().round(), 1);
}

TEST_F(JobMasterTest, LeaveOfMemberScalesDownAndCallsBack) {
  Make(Options(1, 2));
  Add("a");
  Add("b");
  v1::LeaveRequest leave;
  leave.set_node_id("b");
  leave.set_reason("agent stopped");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  EXPECT_TRUE(jm_->Leave(leave).ok());  // idempotent
  EXPECT_THAT(lost_, ElementsAre(Pair("b", "left: agent stopped")));
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().round(), 2);
  EXPECT_EQ(d.start_round().group_world_size(), 1);
  EXPECT_EQ(jm_->Status().nodes(1).state(), "left");
}

TEST_F(JobMasterTest, LostNodeWatchStreamEnds) {
  Make(Options(1, 2));
  Add("a");
  Add("b");
  Drain("b");
  live_.erase("b");
  Advance(6);
  EXPECT_EQ(jm_->NextDecision(handles_["b"], 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(JobMasterTest, AllFinalDecisionsSentTracksOpenStreams) {
  Make(Options(1, 1));
  EXPECT_TRUE(jm_->AllFinalDecisionsSent());
  Add("a");
  Drain("a");
  EXPECT_FALSE(jm_->AllFinalDecisionsSent());
  ASSERT_TRUE(Done("a", 1).ok());
  EXPECT_FALSE(jm_->AllFinalDecisionsSent());
  EXPECT_TRUE(Last("a").has_job_finished());
  jm_->MarkFinalSent(handles_["a"]);
  EXPECT_TRUE(jm_->AllFinalDecisionsSent());
}

TEST_F(JobMasterTest, ShutdownEndsWaits) {
  Make(Options(1, 1));
  Add("a");
  Drain("a");
  std::thread stopper([this] {
    absl::SleepFor(absl::Milliseconds(50));
    jm_->Shutdown();
  });
  EXPECT_EQ(jm_->NextDecision(handles_["a"], 10).status().code(), absl::StatusCode::kUnavailable);
  stopper.join();
  EXPECT_EQ(jm_->KvGet("k", 10).status().code(), absl::StatusCode::kUnavailable);
}

TEST(JobMasterOptions, ValidationSaysWhatToFix) {
  FakeClock clock;
  JobMasterOptions o;
  o.job_id = "j";
  o.clock = &clock;
  EXPECT_TRUE(ValidateJobMasterOptions(o).ok());
  o.min_nodes = 3;
  o.max_nodes = 2;
  EXPECT_THAT(ValidateJobMasterOptions(o).message(), HasSubstr("MIN <= MAX, got 3:2"));
  o.max_nodes = 3;
  o.node_unit = 2;
  EXPECT_THAT(ValidateJobMasterOptions(o).message(), HasSubstr("can never form a world"));
  o.node_unit = 4;
  EXPECT_EQ(ValidateJobMasterOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.node_unit = 1;
  o.max_restarts = -1;
  EXPECT_THAT(ValidateJobMasterOptions(o).message(), HasSubstr("--max-restarts"));
  o.max_restarts = 0;
  o.min_nodes = 0;
  EXPECT_THAT(ValidateJobMasterOptions(o).message(), HasSubstr("at least 1"));
}

TEST_F(JobMasterTest, StatusFlagsNodesSlowerThanFactorTimesMedian) {
  JobMasterOptions o = Options(3, 3);
  o.straggler_factor = 2.0;
  Make(o);
  Add("a");
  Add("b");
  Add("c");
  Advance(0.5);
  const int64_t round = jm_->Status().round();
  ASSERT_EQ(round, 1);
  auto progress = [&](const std::string& id, int64_t r, int64_t step, double step_time) {
    v1::ProgressReport p = Progress(id, r, step);
    p.set_step_time_s(step_time);
    return jm_->ReportProgress(p);
  };
  ASSERT_TRUE(progress("a", round, 10, 1.0).ok());
  // One reporting node: nothing to compare with.
  v1::JobStatus st = jm_->Status();
  for (const auto& n : st.nodes()) EXPECT_FALSE(n.straggler()) << n.node_id();
  ASSERT_TRUE(progress("b", round, 10, 1.2).ok());
  ASSERT_TRUE(progress("c", round, 4, 3.0).ok());   // median 1.2, limit 2.4
  ASSERT_TRUE(progress("b", round - 1, 1, 99.0).ok());  // stale round: ignored
  st = jm_->Status();
  std::map<std::string, std::pair<double, bool>> got;
  for (const auto& n : st.nodes()) got[n.node_id()] = {n.step_time_s(), n.straggler()};
  EXPECT_THAT(got, ElementsAre(Pair("a", Pair(1.0, false)), Pair("b", Pair(1.2, false)),
                               Pair("c", Pair(3.0, true))));
  EXPECT_EQ(jm_->ReportProgress(v1::ProgressReport()).code(), absl::StatusCode::kNotFound);
}

// Synchronous training makes every node's step time the same: the compute
// times (when every member reports one) tell the straggler, and with
// exclude_stragglers one that stays so for 3 checks is excluded; the others
// restart without it, and no restart is used up.
TEST_F(JobMasterTest, ComputeTimesFindARuntimeStragglerAndExcludeStragglersReplacesIt) {
  std::vector<std::string> excluded;
  const int64_t round = StartStragglerJob(&excluded);
  ASSERT_EQ(round, 1);
  auto progress = [&](const std::string& id, double compute) {
    v1::ProgressReport p = Progress(id, round, 10);
    p.set_step_time_s(1.0);  // the same everywhere
    p.set_compute_time_s(compute);
    ASSERT_TRUE(jm_->ReportProgress(p).ok());
  };
  progress("a", 0.10);
  progress("b", 0.50);
  v1::JobStatus st = jm_->Status();
  for (const auto& n : st.nodes()) EXPECT_FALSE(n.straggler()) << "c reports no compute time yet: step times";
  progress("c", 0.11);
  st = jm_->Status();
  std::map<std::string, std::pair<double, bool>> got;
  for (const auto& n : st.nodes()) got[n.node_id()] = {n.compute_time_s(), n.straggler()};
  EXPECT_THAT(got, ElementsAre(Pair("a", Pair(0.10, false)), Pair("b", Pair(0.50, true)),
                               Pair("c", Pair(0.11, false))));
  EXPECT_EQ(st.nodes(1).step_time_s(), 1.0);
  Advance(1.0);
  Advance(1.0);
  EXPECT_TRUE(excluded.empty()) << "not 3 checks in a row yet";
  Advance(1.0);
  ASSERT_THAT(excluded, ElementsAre("b"));
  st = jm_->Status();
  EXPECT_EQ(st.state(), "running");
  EXPECT_EQ(st.world_size(), 2);
  EXPECT_GT(st.round(), round);
  ASSERT_EQ(st.failures_size(), 1);
  EXPECT_EQ(st.failures(0).kind(), "straggler");
  EXPECT_EQ(st.failures(0).action(), "exclude");
  EXPECT_THAT(st.failures(0).cause(),
              HasSubstr("a straggler at runtime (--exclude-stragglers): compute time per forward pass 0.5 s > 2 x "
                        "the median 0.11 s for 3 checks in a row"));
  EXPECT_TRUE(Last("b").has_excluded());
}

// A check that finds no straggler is not repeated while nothing it reads
// changed; a node that turns slow afterwards is still found and, after three
// checks in a row, replaced.
TEST_F(JobMasterTest, ANodeThatTurnsSlowAfterQuietChecksIsStillFoundAndExcluded) {
  std::vector<std::string> excluded;
  const int64_t round = StartStragglerJob(&excluded);
  ASSERT_EQ(round, 1);
  auto progress = [&](const std::string& id, int64_t step, double step_time) {
    v1::ProgressReport p = Progress(id, round, step);
    p.set_step_time_s(step_time);
    ASSERT_TRUE(jm_->ReportProgress(p).ok());
  };
  for (int64_t step = 1; step <= 5; ++step) {  // quiet checks, the same times, steps moving
    for (const char* id : {"a", "b", "c"}) progress(id, step, 1.0);
    Advance(1.0);
  }
  EXPECT_TRUE(excluded.empty());
  progress("b", 6, 3.0);  // b turns slow
  Advance(1.0);
  Advance(1.0);
  EXPECT_TRUE(excluded.empty()) << "not 3 checks in a row yet";
  Advance(1.0);
  EXPECT_THAT(excluded, ElementsAre("b"));
}

TEST_F(JobMasterTest, StatusShowsEachNodesLastStartAndWhereReplicasAre) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Advance(0.5);
  const int64_t round = jm_->Status().round();
  v1::ProgressReport p = Progress("a", round, 3);
  v1::StartTimeline* t = p.mutable_timeline();
  t->set_round(round);
  t->set_recovery(true);
  t->set_start("warm (2 of 2)");
  t->set_failure_seen(true);
  t->set_decision_ms(30);
  t->set_first_step_ms(250);
  ASSERT_TRUE(jm_->ReportProgress(p).ok());
  // A report of an older round's start does not replace a newer one.
  p.mutable_timeline()->set_round(round - 1);
  p.mutable_timeline()->set_first_step_ms(9999);
  ASSERT_TRUE(jm_->ReportProgress(p).ok());
  ASSERT_TRUE(jm_->KvSet("ckpt-replica/1/0", "a 10.0.0.1:4000 step=12 world=4").ok());
  ASSERT_TRUE(jm_->KvSet("ckpt-replica/0/0", "b 10.0.0.2:4000 step=11 world=4").ok());
  ASSERT_TRUE(jm_->KvSet("ckpt-replica/x/0", "garbage").ok());  // not an agent's record: not shown
  v1::JobStatus st = jm_->Status();
  std::map<std::string, v1::StartTimeline> timelines;
  for (const auto& n : st.nodes()) {
    if (n.has_timeline()) timelines[n.node_id()] = n.timeline();
  }
  ASSERT_EQ(timelines.size(), 1u);
  EXPECT_EQ(timelines["a"].first_step_ms(), 250);
  EXPECT_EQ(timelines["a"].start(), "warm (2 of 2)");
  ASSERT_EQ(st.replicas_size(), 2);
  EXPECT_EQ(st.replicas(0).rank(), 0);
  EXPECT_EQ(st.replicas(0).holder(), "b");
  EXPECT_EQ(st.replicas(0).step(), 11);
  EXPECT_EQ(st.replicas(1).rank(), 1);
  EXPECT_EQ(st.replicas(1).holder(), "a");
  EXPECT_EQ(st.replicas(1).world_size(), 4);
}

TEST_F(JobMasterTest, StatusCarriesTheGoodputBreakdownFromProgressReports) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Advance(0.5);
  const int64_t round = jm_->Status().round();
  ASSERT_EQ(round, 1);
  v1::JobStatus st = jm_->Status();
  EXPECT_FALSE(st.goodput().known());
  EXPECT_THAT(st.goodput().note(), HasSubstr("ballast.step()"));
  auto progress = [&](const std::string& id, int64_t step, double age = 0, bool first = true) {
    v1::ProgressReport p = Progress(id, round, step);
    p.set_step_age_s(age);
    p.set_first_step_known(first);
    p.set_first_step(1);
    ASSERT_TRUE(jm_->ReportProgress(p).ok());
  };
  progress("a", 2, 0, /*first=*/false);
  progress("b", 1);  // not every node's first step is known yet: still starting
  EXPECT_EQ(jm_->Status().goodput().parts(0).seconds(), 0);
  progress("a", 2);  // now the world is at step 1, since its first step
  Advance(4.0);
  progress("a", 9, 0.5);  // reached 0.5 s ago
  progress("b", 9);
  Advance(1.0);
  st = jm_->Status();
  const v1::Goodput& g = st.goodput();
  ASSERT_TRUE(g.known());
  double sum = 0, productive = 0;
  for (const auto& p : g.parts()) {
    sum += p.seconds();
    if (p.part() == "productive") productive = p.seconds();
  }
  EXPECT_NEAR(sum, g.wall_s(), 1e-9);
  EXPECT_NEAR(productive, 4.0, 0.2);  // steps 2-9 took the 4 s (the fake clock moves in small ticks)
  EXPECT_NEAR(g.goodput(), productive / g.wall_s(), 1e-9);
  EXPECT_EQ(g.high_water_step(), 9);
  EXPECT_THAT(FormatGoodput(g), HasSubstr("goodput "));
}

// The step-rate chart's data (JobStatus.step_history): a sample of the
// world's step at each progress report (at most one a second) from the
// round's first step on; none before it, when the world's step is no step
// reached (a job that restored step 1000 must not show a burst from 0).
TEST_F(JobMasterTest, StepHistorySamplesTheWorldsStepFromItsFirstStep) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  ASSERT_EQ(jm_->Status().round(), 1);
  auto progress = [&](const std::string& id, int64_t step, bool first) {
    v1::ProgressReport p = Progress(id, 1, step);
    p.set_first_step_known(first);
    p.set_first_step(1001);
    ASSERT_TRUE(jm_->ReportProgress(p).ok());
  };
  progress("a", 1001, true);
  progress("b", 0, false);  // one worker of b has not made a step yet
  Advance(1.0);
  EXPECT_EQ(jm_->Status().step_history_size(), 0);
  progress("b", 1001, true);
  Advance(0.5);
  v1::JobStatus st = jm_->Status();
  ASSERT_EQ(st.step_history_size(), 1);
  EXPECT_EQ(st.step_history(0).step(), 1001);
  progress("a", 1011, true);
  progress("b", 1011, true);
  Advance(0.5);
  EXPECT_EQ(jm_->Status().step_history_size(), 1);  // under a second after the last sample
  Advance(1.0);
  progress("a", 1021, true);
  progress("b", 1021, true);
  st = jm_->Status();
  ASSERT_EQ(st.step_history_size(), 2);  // the chart can draw a rate from here
  EXPECT_EQ(st.step_history(1).step(), 1021);
  EXPECT_NEAR(st.step_history(1).at_s() - st.step_history(0).at_s(), 1.5, 1e-6);
}

TEST_F(JobMasterTest, EachFailureIsRecordedWithDetectionResumeAndStepsLost) {
  Make(Options(2, 3));
  Add("a");
  Add("b");
  Add("c");
  ASSERT_EQ(jm_->Status().round(), 1);
  auto progress = [&](const std::string& id, int64_t round, int64_t step, int64_t first) {
    v1::ProgressReport p = Progress(id, round, step);
    p.set_first_step_known(true);
    p.set_first_step(first);
    ASSERT_TRUE(jm_->ReportProgress(p).ok());
  };
  for (const char* id : {"a", "b", "c"}) progress(id, 1, 10, 1);
  // A worker of b is killed; its agent saw it 0.2 s before the report came.
  v1::FailureReport r;
  r.set_node_id("b");
  r.set_round(1);
  r.set_global_rank(1);
  r.set_signal(9);
  r.set_cause("SIGKILL");
  r.set_kind("killed");
  r.set_max_retries(-1);
  r.set_seen_age_s(0.2);
  ASSERT_TRUE(jm_->ReportFailure(r).ok());
  ASSERT_EQ(jm_->Status().round(), 2);
  Advance(1.5);
  for (const char* id : {"a", "b", "c"}) progress(id, 2, 8, 8);  // resumed at step 8: 8, 9, 10 again
  // Then c goes silent: lost at the heartbeat timeout.
  live_.erase("c");
  Advance(5.5);
  v1::JobStatus st = jm_->Status();
  ASSERT_EQ(st.failures_size(), 2);
  EXPECT_EQ(st.failures_total(), 2);
  const v1::FailureRecord& f = st.failures(0);
  EXPECT_EQ(f.round(), 1);
  EXPECT_EQ(f.node_id(), "b");
  EXPECT_EQ(f.host(), "b.host");
  EXPECT_EQ(f.node_rank(), 1);
  EXPECT_EQ(f.global_rank(), 1);
  EXPECT_EQ(f.kind(), "killed");
  EXPECT_EQ(f.action(), "restart");
  EXPECT_NEAR(f.detection_s(), 0.2, 1e-9);
  EXPECT_TRUE(f.resumed());
  EXPECT_NEAR(f.resume_s(), 1.5, 1e-6);
  EXPECT_EQ(f.steps_lost(), 3);
  const v1::FailureRecord& lost = st.failures(1);
  EXPECT_EQ(lost.node_id(), "c");
  EXPECT_EQ(lost.kind(), "node-lost");
  EXPECT_EQ(lost.cause(), "heartbeat timeout");
  EXPECT_EQ(lost.global_rank(), -1);
  EXPECT_EQ(lost.node_rank(), 2);
  EXPECT_EQ(lost.action(), "scale down");
  EXPECT_GE(lost.detection_s(), 5.0);  // the heartbeat timeout
  EXPECT_FALSE(lost.resumed());
  EXPECT_EQ(jm_->RecoveriesByKind().at("node-lost"), 1);
  EXPECT_EQ(jm_->RecoveryHistogram().count, 1u);
  // The timeline has the rounds, the failure and the loss, in order.
  std::vector<std::string> kinds;
  for (const auto& e : jm_->events().After(0, 0)) kinds.push_back(e.kind());
  EXPECT_THAT(kinds, ::testing::ElementsAre("node_joined", "node_joined", "node_joined", "round", "failure", "round",
                                            "node_lost", "round"));
}


TEST_F(JobMasterTest, BadLossRollsEveryNodeBackDroppingStepsAndSkippingItsSamplesOnce) {
  Make(Options(2, 2));
  Add("a");
  Add("b");
  Drain("a");
  Drain("b");
  const std::string dir = "/ckpt";
  for (int step : {3, 4, 5}) {
    ASSERT_TRUE(jm_->ReportShardDurable(Shard(dir, step, 0, 2)).ok());
    ASSERT_TRUE(jm_->ReportShardDurable(Shard(dir, step, 1, 2)).ok());
  }
  v1::FailureReport r;
  r.set_node_id("b");
  r.set_round(1);
  r.set_global_rank(1);
  r.set_kind("nan");
  r.set_cause("non-finite loss (nan) at step 5");
  r.set_health_step(5);
  r.set_health_value(std::nan(""));
  r.set_health_data("0:40:48");
  r.set_max_retries(-1);
  ASSERT_TRUE(jm_->ReportFailure(r).ok());
  for (const char* id : {"a", "b"}) {
    v1::Decision d = Last(id);
    ASSERT_TRUE(d.has_start_round()) << id;
    EXPECT_EQ(d.start_round().round(), 2);
    EXPECT_EQ(d.start_round().rollback_below(), 5) << id;
    EXPECT_EQ(d.start_round().skip_data(), "0:40:48") << id;
  }
  v1::JobStatus st = jm_->Status();
  ASSERT_GE(st.failures_size(), 1);
  EXPECT_EQ(st.failures(st.failures_size() - 1).action(), "rollback");
  EXPECT_EQ(st.failures(st.failures_size() - 1).kind(), "nan");
  // A persist of the dropped step that finishes late is not committed...
  v1::ShardDurableReport late = Shard(dir, 5, 0, 2);
  late.set_round(1);
  auto resp = jm_->ReportShardDurable(late);
  ASSERT_TRUE(resp.ok());
  EXPECT_FALSE(resp->commit());
  // ... the re-trained step 5 of round 2 is.
  v1::ShardDurableReport again0 = Shard(dir, 5, 0, 2), again1 = Shard(dir, 5, 1, 2);
  again0.set_round(2);
  again1.set_round(2);
  ASSERT_TRUE(jm_->ReportShardDurable(again0).ok());
  auto committed = jm_->ReportShardDurable(again1);
  ASSERT_TRUE(committed.ok());
  EXPECT_TRUE(committed->commit());
  // Once round 2 trained, a crash restart drops nothing; the samples stay skipped.
  v1::ProgressReport p = Progress("a", 2, 6);
  p.set_first_step_known(true);
  p.set_first_step(4);
  ASSERT_TRUE(jm_->ReportProgress(p).ok());
  ASSERT_TRUE(Fail("a", 2).ok());
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().rollback_below(), 0);
  EXPECT_EQ(d.start_round().skip_data(), "0:40:48");
}


TEST_F(JobMasterTest, ADivergedReplicaIsExcludedAndTheRestRollBackToTheLastAgreedStep) {
  Make(Options(2, 3));
  Add("a", 0);
  Add("b", 1);
  Add("c", 2);
  for (const char* id : {"a", "b", "c"}) Drain(id);
  auto fingerprints = [&](const std::string& id, int rank, int64_t step, uint64_t value) {
    return jm_->ReportProgress(test_reports::FingerprintReport(id, 1, rank, step, value));
  };
  for (auto [id, rank] : std::vector<std::pair<std::string, int>>{{"a", 0}, {"b", 1}, {"c", 2}}) {
    ASSERT_TRUE(fingerprints(id, rank, 100, 77).ok());
  }
  ASSERT_TRUE(fingerprints("a", 0, 200, 5).ok());
  ASSERT_TRUE(fingerprints("b", 1, 200, 5).ok());
  EXPECT_EQ(jm_->Status().round(), 1);
  ASSERT_TRUE(fingerprints("c", 2, 200, 6).ok());
  EXPECT_TRUE(Last("c").has_excluded());
  for (const char* id : {"a", "b"}) {
    v1::Decision d = Last(id);
    ASSERT_TRUE(d.has_start_round()) << id;
    EXPECT_EQ(d.start_round().world_size(), 2);
    EXPECT_EQ(d.start_round().rollback_below(), 101) << id;
  }
  v1::JobStatus st = jm_->Status();
  const v1::FailureRecord& rec = st.failures(st.failures_size() - 1);
  EXPECT_EQ(rec.kind(), "sdc");
  EXPECT_EQ(rec.action(), "exclude and roll back");
  EXPECT_EQ(rec.global_rank(), 2);
  EXPECT_THAT(rec.cause(), ::testing::HasSubstr("rank 2's parameter fingerprint 0000000000000006 differs"));
  // Its re-join is refused.
  EXPECT_FALSE(Join("c", 2).ok());
}

}  // namespace
}  // namespace ballast::master

namespace ballast::master {
namespace {

TEST_F(JobMasterTest, ProgressAnswersCarryTheNewestAgreedStepAndARestartedMasterTakesItBack) {
  Make(Options(2, 2));
  Add("a", 0);
  Add("b", 1);
  for (const char* id : {"a", "b"}) Drain(id);
  auto report = [&](const std::string& id, int rank, int64_t step, int64_t heard) {
    v1::ProgressReport p = Progress(id, 1, step);
    v1::Fingerprint* f = p.add_fingerprints();
    f->set_rank(rank);
    f->set_step(step);
    f->set_value(42);
    f->set_group(9);
    p.set_sdc_agreed_step(heard);
    v1::ProgressResponse r;
    EXPECT_TRUE(jm_->ReportProgress(p, &r).ok());
    return r.sdc_agreed_step();
  };
  // Step 10 is agreed once the last rank reports it, in that very answer.
  EXPECT_EQ(report("a", 0, 10, 0), 0);
  EXPECT_EQ(report("b", 1, 10, 0), 10);
  EXPECT_EQ(report("a", 0, 20, 0), 10);
  // What an agent heard from a master before this one (it restarted) is
  // taken back, never lowered.
  EXPECT_EQ(report("b", 1, 20, 40), 40);
  EXPECT_EQ(report("a", 0, 30, 5), 40);
}

}  // namespace
}  // namespace ballast::master
