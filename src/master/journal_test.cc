#include "master/journal.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "master/job_master.h"
#include "master/test_reports.h"

namespace ballast::master {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  std::string dir = std::filesystem::temp_directory_path() /
                    ("ballast-journal-" + name + "-" + std::to_string(getpid()) + "-" + std::to_string(rand()));
  std::filesystem::remove_all(dir);
  return dir;
}

v1::JournalRecord Kv(const std::string& key, const std::string& value) {
  v1::JournalRecord r;
  r.mutable_kv()->set_key(key);
  r.mutable_kv()->set_value(value);
  return r;
}

std::unique_ptr<Journal> OpenOrDie(const std::string& dir, size_t compact_bytes = 16u << 20) {
  auto j = Journal::Open(Journal::Options{dir, compact_bytes});
  EXPECT_TRUE(j.ok()) << j.status();
  return j.ok() ? *std::move(j) : nullptr;
}

size_t FileSize(const std::string& path) { return std::filesystem::file_size(path); }

TEST(JournalTest, RecordsSurviveReopenInOrder) {
  const std::string dir = TempDir("reopen");
  {
    auto j = OpenOrDie(dir);
    EXPECT_FALSE(j->recovered());
    v1::JournalRecord job;
    job.mutable_job()->set_job_id("j1");
    ASSERT_TRUE(j->Append(job, true).ok());
    ASSERT_TRUE(j->Append(Kv("a", "1"), false).ok());
    ASSERT_TRUE(j->Append(Kv("a", "2"), true).ok());
  }
  auto j = OpenOrDie(dir);
  ASSERT_TRUE(j->recovered());
  v1::MasterSnapshot s = j->state();
  EXPECT_EQ(s.job().job_id(), "j1");
  EXPECT_EQ(s.kv().at("a"), "2");
  EXPECT_EQ(s.last_seq(), 3u);
  EXPECT_THAT(j->recovery_note(), HasSubstr("replayed 3 records"));
  std::filesystem::remove_all(dir);
}

TEST(JournalTest, TornTailIsCutAtTheLastGoodRecord) {
  const std::string dir = TempDir("torn");
  {
    auto j = OpenOrDie(dir);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(j->Append(Kv("k" + std::to_string(i), "v"), true).ok());
  }
  const std::string log = dir + "/journal.log";
  const size_t full = FileSize(log);
  std::filesystem::resize_file(log, full - 3);  // a crash mid-write of the last record
  {
    auto j = OpenOrDie(dir);
    v1::MasterSnapshot s = j->state();
    EXPECT_EQ(s.kv_size(), 4);
    EXPECT_EQ(s.kv().count("k4"), 0u);
    EXPECT_THAT(j->recovery_note(), HasSubstr("cut off"));
    EXPECT_LT(FileSize(log), full - 3);  // truncated to the good records
    // Appending after the cut continues the sequence.
    ASSERT_TRUE(j->Append(Kv("after", "x"), true).ok());
  }
  auto j = OpenOrDie(dir);
  EXPECT_EQ(j->state().kv().at("after"), "x");
  EXPECT_EQ(j->state().kv_size(), 5);
  std::filesystem::remove_all(dir);
}

TEST(JournalTest, CorruptRecordEndsReplayThere) {
  const std::string dir = TempDir("corrupt");
  {
    auto j = OpenOrDie(dir);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(j->Append(Kv("k" + std::to_string(i), "value"), true).ok());
  }
  const std::string log = dir + "/journal.log";
  // Flip one byte in the payload of the third record.
  const size_t record = FrameJournalRecord([] {
                          v1::JournalRecord r = Kv("k0", "value");
                          r.set_seq(1);
                          return r;
                        }()).size();
  {
    std::fstream f(log, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(kJournalMagic.size() + 2 * record + record - 2));
    f.put('\x7f');
  }
  auto j = OpenOrDie(dir);
  EXPECT_EQ(j->state().kv_size(), 2);
  EXPECT_THAT(j->recovery_note(), HasSubstr("checksum"));
  std::filesystem::remove_all(dir);
}

TEST(JournalTest, CompactionKeepsTheStateAndCheckpointCommits) {
  const std::string dir = TempDir("compact");
  {
    auto j = OpenOrDie(dir, /*compact_bytes=*/512);
    for (int i = 0; i < 40; ++i) ASSERT_TRUE(j->Append(Kv("k" + std::to_string(i), std::string(20, 'x')), false).ok());
    for (int rank = 0; rank < 2; ++rank) {
      v1::JournalRecord r;
      auto* sh = r.mutable_shard();
      sh->set_dir("/ckpt");
      sh->set_step(7);
      sh->set_rank(rank);
      sh->set_world_size(2);
      ASSERT_TRUE(j->Append(r, true).ok());
    }
    EXPECT_TRUE(std::filesystem::exists(dir + "/snapshot.pb"));
    EXPECT_LT(j->log_bytes(), 512u);
  }
  auto j = OpenOrDie(dir);
  v1::MasterSnapshot s = j->state();
  EXPECT_EQ(s.kv_size(), 40);
  EXPECT_EQ(s.last_seq(), 42u);
  ASSERT_EQ(s.ckpt_dirs_size(), 1);
  EXPECT_EQ(s.ckpt_dirs(0).committed(), 7);
  std::filesystem::remove_all(dir);
}

v1::JournalRecord ShardRecord(int64_t step, int rank) {
  v1::JournalRecord r;
  auto* sh = r.mutable_shard();
  sh->set_dir("/ckpt");
  sh->set_step(step);
  sh->set_rank(rank);
  sh->set_world_size(2);
  return r;
}

// A round record as JobMaster::RecordRound writes it; rollback_round 0: none yet.
v1::JournalRecord RoundRecord(int64_t round, int64_t rollback_below, int64_t rollback_round, int64_t rolled_back_below) {
  v1::JournalRecord r;
  auto* jr = r.mutable_round();
  jr->set_state("running");
  jr->set_round(round);
  jr->set_rollback_below(rollback_below);
  jr->set_rollback_round(rollback_round);
  jr->set_rolled_back_below(rolled_back_below);
  return r;
}

int64_t Committed(const Journal& j) {
  v1::MasterSnapshot s = j.state();
  return s.ckpt_dirs_size() == 1 ? s.ckpt_dirs(0).committed() : -1;
}

TEST(JournalTest, ARollbackDropsTheCommitsFromItsStepOnceWhereItStandsInTheLog) {
  const std::string dir = TempDir("rollback");
  // What the master writes: commits, a rollback at step 5 (round 2), the
  // re-trained step 5, the rollback done (rollback_below cleared), a plain
  // restart (round 3); then a second rollback at the same step (round 4).
  std::vector<std::pair<v1::JournalRecord, int64_t>> script;  // record, committed after it
  for (int64_t step : {4, 6}) {
    script.emplace_back(ShardRecord(step, 0), step == 4 ? 0 : 4);
    script.emplace_back(ShardRecord(step, 1), step);
  }
  script.emplace_back(RoundRecord(2, 5, 2, 5), 4);
  script.emplace_back(ShardRecord(5, 0), 4);
  script.emplace_back(ShardRecord(5, 1), 5);
  script.emplace_back(RoundRecord(2, 0, 2, 5), 5);
  script.emplace_back(RoundRecord(3, 0, 2, 5), 5);
  script.emplace_back(ShardRecord(6, 0), 5);
  script.emplace_back(ShardRecord(6, 1), 6);
  script.emplace_back(RoundRecord(4, 5, 4, 5), 4);
  script.emplace_back(ShardRecord(5, 0), 4);
  for (size_t cut = 1; cut <= script.size(); ++cut) {
    // The live state after each record, and the state replayed from the log
    // and from a snapshot, are the same.
    SCOPED_TRACE(cut);
    std::filesystem::remove_all(dir);
    {
      auto j = OpenOrDie(dir);
      for (size_t i = 0; i < cut; ++i) ASSERT_TRUE(j->Append(script[i].first, false).ok());
      EXPECT_EQ(Committed(*j), script[cut - 1].second);
    }
    EXPECT_EQ(Committed(*OpenOrDie(dir)), script[cut - 1].second);
    ASSERT_TRUE(OpenOrDie(dir)->Compact().ok());
    EXPECT_EQ(Committed(*OpenOrDie(dir)), script[cut - 1].second);
  }
  std::filesystem::remove_all(dir);
}

TEST(JournalTest, CorruptSnapshotIsAnErrorNotAReset) {
  const std::string dir = TempDir("badsnap");
  {
    auto j = OpenOrDie(dir);
    ASSERT_TRUE(j->Append(Kv("a", "1"), true).ok());
    ASSERT_TRUE(j->Compact().ok());
  }
  {
    std::fstream f(dir + "/snapshot.pb", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x01');
  }
  auto j = Journal::Open(Journal::Options{dir});
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(j.status().message(), HasSubstr("snapshot.pb is corrupt"));
  EXPECT_THAT(j.status().message(), HasSubstr("move the directory away"));
  std::filesystem::remove_all(dir);
}

TEST(JournalTest, ParseStopsAtAnyGarbage) {
  // Short header, huge length, garbage: never past the end, never a crash.
  for (const std::string& junk : {std::string("\x01\x02"), std::string(12, '\xff'), std::string(40, '\0')}) {
    ParsedJournal p = ParseJournalRecords(junk);
    EXPECT_LE(p.good_bytes, junk.size());
  }
}

// --- A JobMaster that restarts from its journal. ---

class JournalRestartTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = TempDir("master"); }
  void TearDown() override {
    jm_.reset();
    journal_.reset();
    std::filesystem::remove_all(dir_);
  }
  JobMasterOptions Options() {
    JobMasterOptions o;
    o.job_id = "job1";
    o.min_nodes = 2;
    o.max_nodes = 2;
    o.max_restarts = 3;
    o.last_call_s = 1.0;
    o.heartbeat_interval_s = 1.0;
    o.heartbeat_timeout_s = 5.0;
    o.clock = &clock_;
    return o;
  }
  // (Re)starts the master on the journal, as a crash and restart would.
  void Start(JobMasterOptions o) {
    jm_.reset();
    journal_.reset();
    handles_.clear();
    auto j = Journal::Open(Journal::Options{dir_});
    ASSERT_TRUE(j.ok()) << j.status();
    journal_ = *std::move(j);
    o.journal = journal_.get();
    jm_ = std::make_unique<JobMaster>(o);
  }
  void Join(const std::string& id) {
    v1::JoinRequest req;
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_local_world_size(1);
    req.mutable_node()->set_host(id + ".host");
    auto r = jm_->Join(req);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  v1::Decision Last(const std::string& id) {
    if (handles_.count(id) == 0) {
      auto h = jm_->OpenWatch(id);
      EXPECT_TRUE(h.ok()) << h.status();
      if (!h.ok()) return {};
      handles_[id] = *h;
    }
    v1::Decision last;
    while (true) {
      auto next = jm_->NextDecision(handles_[id], 0);
      if (!next.ok() || !next->has_value()) break;
      last = **next;
    }
    return last;
  }
  void Advance(double seconds, const std::vector<std::string>& alive) {
    for (double t = 0; t < seconds - 1e-9; t += 0.5) {
      clock_.Advance(0.5);
      for (const auto& id : alive) {
        v1::HeartbeatRequest hb;
        hb.set_node_id(id);
        (void)jm_->Heartbeat(hb);
      }
      jm_->Tick();
    }
  }
  absl::Status Fail(const std::string& id, int64_t round) {
    v1::FailureReport r;
    r.set_node_id(id);
    r.set_round(round);
    r.set_global_rank(0);
    r.set_exit_code(1);
    return jm_->ReportFailure(r);
  }
  // Two nodes in round 1, training.
  void RunningJob(JobMasterOptions o) {
    Start(o);
    Join("a");
    Join("b");
    ASSERT_TRUE(Last("a").has_start_round());
    ASSERT_TRUE(Last("b").has_start_round());
  }

  std::string dir_;
  FakeClock clock_;
  std::unique_ptr<Journal> journal_;
  std::unique_ptr<JobMaster> jm_;
  std::map<std::string, JobMaster::WatchHandle> handles_;
};

TEST_F(JournalRestartTest, RestartedMasterResumesTheRoundWithoutARestart) {
  RunningJob(Options());
  ASSERT_TRUE(Fail("a", 1).ok());  // one restart: round 2
  ASSERT_EQ(Last("b").start_round().round(), 2);
  ASSERT_TRUE(jm_->KvSet("round/2/master_endpoint", "a.host:1234").ok());
  v1::ShardDurableReport sh;
  sh.set_dir("/ckpt");
  sh.set_step(9);
  sh.set_world_size(2);
  sh.set_rank(0);
  ASSERT_FALSE(jm_->ReportShardDurable(sh)->commit());
  sh.set_rank(1);
  ASSERT_TRUE(jm_->ReportShardDurable(sh)->commit());

  Start(Options());  // the crash and restart
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.state(), "running");
  EXPECT_EQ(st.round(), 2);
  EXPECT_EQ(st.restart_count(), 1);
  EXPECT_EQ(st.failures_total(), 1);
  // The agents reconnect: the same round, the same ranks; nothing restarts.
  Join("a");
  Join("b");
  v1::Decision da = Last("a");
  ASSERT_TRUE(da.has_start_round());
  EXPECT_EQ(da.start_round().round(), 2);
  EXPECT_EQ(da.start_round().restart_count(), 1);
  EXPECT_EQ(Last("b").start_round().group_rank(), 1 - da.start_round().group_rank());
  EXPECT_EQ(*jm_->KvGet("round/2/master_endpoint", 0), "a.host:1234");
  // The commit is remembered: the step does not commit twice.
  sh.set_rank(0);
  EXPECT_FALSE(jm_->ReportShardDurable(sh)->commit());
  EXPECT_EQ(jm_->ReportShardDurable(sh)->committed_step(), 9);
  Advance(12, {"a", "b"});
  EXPECT_EQ(jm_->Status().round(), 2);  // both heartbeat: nobody is lost
  // Failures are handled as before the crash: the next is restart 2.
  ASSERT_TRUE(Fail("b", 2).ok());
  EXPECT_EQ(jm_->Status().restart_count(), 2);
  EXPECT_EQ(Last("a").start_round().round(), 3);
}

// The time a Kubernetes job waited for Kueue before its first master
// (GoodputBefore) is in the journaled parts: a master restarted from the
// journal keeps it, and the parts still add up to the wall.
TEST_F(JournalRestartTest, TheTimeQueuedBeforeTheFirstMasterSurvivesItsRestart) {
  JobMasterOptions o = Options();
  o.goodput_before.queued_s = 30;
  RunningJob(o);
  Advance(12, {"a", "b"});
  auto parts = [](const v1::Goodput& g) {
    std::map<std::string, double> m;
    double sum = 0;
    for (const auto& p : g.parts()) {
      m[p.part()] = p.seconds();
      sum += p.seconds();
    }
    m["sum"] = sum;
    return m;
  };
  v1::Goodput before = jm_->Status().goodput();
  EXPECT_DOUBLE_EQ(parts(before)["queued"], 30);
  EXPECT_NEAR(before.wall_s(), 42, 1e-6);
  EXPECT_NEAR(parts(before)["sum"], before.wall_s(), 1e-6);

  Start(Options());  // the crash and restart: nothing passed this time
  v1::Goodput after = jm_->Status().goodput();
  EXPECT_DOUBLE_EQ(parts(after)["queued"], 30);
  EXPECT_GE(after.wall_s(), 42 - 2.0 - 1e-6);  // the journal marks goodput every 2 s
  EXPECT_NEAR(parts(after)["sum"], after.wall_s(), 1e-6);
}

TEST_F(JournalRestartTest, HeldFailureIsDecidedOnceAfterTheRestart) {
  JobMasterOptions o = Options();
  o.failure_settle_s = 0.5;
  RunningJob(o);
  ASSERT_TRUE(Fail("a", 1).ok());  // held for the settle time; then the master dies
  EXPECT_EQ(jm_->Status().round(), 1);
  Start(o);
  Join("a");
  Join("b");
  Advance(1, {"a", "b"});
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 2);
  EXPECT_EQ(st.restart_count(), 1);
  // The agent's retry of the same report after reconnecting is stale now.
  EXPECT_EQ(Fail("a", 1).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(jm_->Status().restart_count(), 1);
}

TEST_F(JournalRestartTest, NodeThatNeverReconnectsIsLostAfterTwoHeartbeatTimeouts) {
  JobMasterOptions o = Options();
  o.min_nodes = 1;
  RunningJob(o);
  Start(o);
  Join("a");  // b's agent died with the master
  Advance(6, {"a"});
  EXPECT_EQ(jm_->Status().round(), 1);  // still within its reconnect window
  Advance(6, {"a"});
  v1::JobStatus st = jm_->Status();
  EXPECT_EQ(st.round(), 2);  // scaled down to a
  EXPECT_EQ(st.restart_count(), 0);
  EXPECT_EQ(st.world_size(), 1);
}

// A node its scheduler reported gone (Ray, Slurm) may not join again; a
// master restarted from the journal still refuses its agent, which may
// outlive the notice and reconnect to the new master.
TEST_F(JournalRestartTest, ANodeTheSchedulerLostIsStillRefusedAfterTheRestart) {
  JobMasterOptions o = Options();
  o.min_nodes = 1;
  RunningJob(o);
  v1::LeaveRequest lost;
  lost.set_node_id("b");
  lost.set_reason("its Ray node 8f3c died");
  lost.set_lost(true);
  ASSERT_TRUE(jm_->Leave(lost).ok());
  Start(o);
  Join("a");
  v1::JoinRequest req;
  req.mutable_node()->set_node_id("b");
  req.mutable_node()->set_local_world_size(1);
  req.mutable_node()->set_host("b.host");
  auto again = jm_->Join(req);
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(again.status())) << again.status();
  EXPECT_THAT(again.status().message(), HasSubstr("node b is gone from the job (its Ray node 8f3c died)"));
  Join("c");  // its replacement
}

TEST_F(JournalRestartTest, AMemberLostJustBeforeTheCrashComesBackAndIsLostAgain) {
  // The crash came between the record of b's loss and the round it made:
  // the journal's round still lists b. It must not be a member nobody waits
  // for (the round could never finish): b is known again, and lost again
  // when it does not come back.
  JobMasterOptions o = Options();
  o.min_nodes = 1;
  RunningJob(o);
  v1::JournalRecord gone;
  gone.mutable_node_gone()->set_node_id("b");
  gone.mutable_node_gone()->set_state("dead");
  gone.mutable_node_gone()->set_reason("heartbeat timeout");
  ASSERT_TRUE(journal_->Append(gone, true).ok());
  Start(o);
  v1::JobStatus st = jm_->Status();
  ASSERT_EQ(st.nodes_size(), 2);
  EXPECT_EQ(st.nodes(1).node_id(), "b");
  EXPECT_EQ(st.nodes(1).state(), "training");
  Join("a");
  Advance(12, {"a"});
  st = jm_->Status();
  EXPECT_EQ(st.round(), 2);  // scaled down to a
  EXPECT_EQ(st.world_size(), 1);
}

TEST_F(JournalRestartTest, FinishedJobTellsReconnectingAgentsItsEnd) {
  RunningJob(Options());
  for (const char* id : {"a", "b"}) {
    v1::WorkersDoneRequest d;
    d.set_node_id(id);
    d.set_round(1);
    ASSERT_TRUE(jm_->ReportWorkersDone(d).ok());
  }
  ASSERT_TRUE(jm_->outcome().has_value());
  Start(Options());
  ASSERT_TRUE(jm_->outcome().has_value());
  EXPECT_TRUE(jm_->outcome()->succeeded);
  EXPECT_FALSE(jm_->AllFinalDecisionsSent());  // its agents have not heard it yet
  Join("a");
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_job_finished());
  EXPECT_TRUE(d.job_finished().succeeded());
}

TEST_F(JournalRestartTest, OneDoneNodeStaysDoneAcrossTheRestart) {
  RunningJob(Options());
  v1::WorkersDoneRequest d;
  d.set_node_id("a");
  d.set_round(1);
  ASSERT_TRUE(jm_->ReportWorkersDone(d).ok());
  Start(Options());
  Join("a");
  Join("b");
  d.set_node_id("b");
  ASSERT_TRUE(jm_->ReportWorkersDone(d).ok());
  ASSERT_TRUE(jm_->outcome().has_value());
  EXPECT_TRUE(jm_->outcome()->succeeded);
}

TEST_F(JournalRestartTest, AMasterRestartedAfterARollbackResumesBelowItsStep) {
  RunningJob(Options());
  auto shard = [&](int64_t round, int64_t step, int rank) {
    v1::ShardDurableReport sh;
    sh.set_node_id(rank == 0 ? "a" : "b");
    sh.set_round(round);
    sh.set_dir("/ckpt");
    sh.set_step(step);
    sh.set_world_size(2);
    sh.set_rank(rank);
    auto r = jm_->ReportShardDurable(sh);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : v1::ShardDurableResponse();
  };
  for (int64_t step : {4, 6}) {
    shard(1, step, 0);
    ASSERT_TRUE(shard(1, step, 1).commit());
  }
  // A NaN at step 5: every step from 5 on is dropped, step 6's commit too.
  v1::FailureReport nan;
  nan.set_node_id("b");
  nan.set_round(1);
  nan.set_global_rank(1);
  nan.set_kind("nan");
  nan.set_cause("non-finite loss (nan) at step 5");
  nan.set_health_step(5);
  nan.set_health_value(std::nan(""));
  nan.set_max_retries(-1);
  ASSERT_TRUE(jm_->ReportFailure(nan).ok());
  ASSERT_EQ(Last("a").start_round().rollback_below(), 5);

  Start(Options());  // the crash and restart, before the rollback round trained
  ASSERT_EQ(journal_->state().ckpt_dirs_size(), 1);
  EXPECT_EQ(journal_->state().ckpt_dirs(0).committed(), 4);
  Join("a");
  Join("b");
  v1::Decision d = Last("a");
  ASSERT_TRUE(d.has_start_round());
  EXPECT_EQ(d.start_round().round(), 2);
  EXPECT_EQ(d.start_round().rollback_below(), 5);  // an agent that missed it still rolls back
  // The dropped step, persisted late by round 1, does not come back...
  EXPECT_FALSE(shard(1, 6, 0).commit());
  EXPECT_FALSE(shard(1, 6, 1).commit());
  // ... and the re-trained step 5 commits: the newest commit is 4, not 6.
  v1::ShardDurableResponse r = shard(2, 5, 0);
  EXPECT_FALSE(r.commit());
  EXPECT_EQ(r.committed_step(), 4);
  r = shard(2, 5, 1);
  EXPECT_TRUE(r.commit());
  EXPECT_EQ(r.committed_step(), 5);
  // Round 2 trains on (the rollback is done), then the master restarts again:
  // the commits made since the rollback stay, and round 1's late persists of
  // the dropped steps stay refused.
  v1::ProgressReport p;
  p.set_node_id("a");
  p.set_round(2);
  p.set_step(6);
  p.set_first_step_known(true);
  p.set_first_step(5);
  ASSERT_TRUE(jm_->ReportProgress(p).ok());
  Start(Options());
  Join("a");
  Join("b");
  EXPECT_EQ(Last("a").start_round().rollback_below(), 0);
  EXPECT_EQ(journal_->state().ckpt_dirs(0).committed(), 5);
  EXPECT_FALSE(shard(1, 6, 0).commit());
  EXPECT_FALSE(shard(1, 6, 1).commit());
  EXPECT_EQ(shard(2, 6, 0).committed_step(), 5);
  EXPECT_TRUE(shard(2, 6, 1).commit());
  // A restart of the round that is no rollback keeps them too.
  ASSERT_TRUE(Fail("a", 2).ok());
  Start(Options());
  EXPECT_EQ(jm_->Status().round(), 3);
  EXPECT_EQ(journal_->state().ckpt_dirs(0).committed(), 6);
}

// Silent data corruption on node c: c is excluded and the others roll back
// below the bad step. A master that restarts before c's agent read its
// decision re-sends the exclusion with the rollback in it, so c still drops
// its newest steps and writes the rollback target before it exits.
TEST_F(JournalRestartTest, AnExclusionReSentAfterARestartStillCarriesTheRollback) {
  JobMasterOptions o = Options();
  o.max_nodes = 3;
  Start(o);
  for (const char* id : {"a", "b", "c"}) Join(id);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(Last(id).has_start_round()) << id;
  auto fingerprint = [&](const std::string& id, int rank, int64_t step, uint64_t value) {
    return jm_->ReportProgress(test_reports::FingerprintReport(id, 1, rank, step, value));
  };
  for (auto [id, rank] : std::vector<std::pair<std::string, int>>{{"a", 0}, {"b", 1}, {"c", 2}}) {
    ASSERT_TRUE(fingerprint(id, rank, 100, 77).ok());
  }
  ASSERT_TRUE(fingerprint("a", 0, 200, 5).ok());
  ASSERT_TRUE(fingerprint("b", 1, 200, 5).ok());
  ASSERT_TRUE(fingerprint("c", 2, 200, 6).ok());
  ASSERT_EQ(Last("a").start_round().rollback_below(), 101);

  Start(o);  // the crash and restart; c's agent had not read its exclusion
  v1::Decision d = Last("c");
  ASSERT_TRUE(d.has_excluded()) << d.DebugString();
  EXPECT_EQ(d.excluded().rollback_below(), 101);
  EXPECT_NE(d.excluded().reason().find("silent data corruption"), std::string::npos) << d.excluded().reason();
  EXPECT_EQ(Last("a").start_round().rollback_below(), 101);
}

TEST_F(JournalRestartTest, ARestartedMasterStillPromotesTheLongestWaitingSpare) {
  auto join = [&](const std::string& id, int hint) {
    v1::JoinRequest req;
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_node_rank_hint(hint);
    req.mutable_node()->set_local_world_size(1);
    req.mutable_node()->set_host(id + ".host");
    ASSERT_TRUE(jm_->Join(req).ok());
  };
  Start(Options());
  join("a", 0);
  join("b", 1);
  ASSERT_EQ(jm_->Status().round(), 1);
  // Spares, in this order; hint order and the journal's node map would put
  // them the other way round.
  for (const char* id : {"s9", "s2", "s5"}) {
    join(id, id[1] - '0');
    Advance(0.5, {"a", "b", "s9", "s2", "s5"});
  }
  Start(Options());  // the crash and restart
  // They reconnect in another order: each keeps its place.
  for (const char* id : {"s5", "b", "s2", "a", "s9"}) join(id, id[0] == 's' ? id[1] - '0' : id[0] - 'a');
  v1::LeaveRequest leave;
  leave.set_node_id("a");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  EXPECT_THAT(jm_->Status().message(), HasSubstr("spare node s9 takes the place of node a "));
  leave.set_node_id("b");
  ASSERT_TRUE(jm_->Leave(leave).ok());
  EXPECT_THAT(jm_->Status().message(), HasSubstr("spare node s2 takes the place of node b "));
}

TEST_F(JournalRestartTest, OtherSettingsAreRefusedNamingTheDifference) {
  RunningJob(Options());
  JobMasterOptions o = Options();
  o.max_nodes = 3;
  absl::Status s = CheckJournalMatches(o, journal_->job());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("--nnodes 2:3 (the journal's is 2:2)"));
  EXPECT_THAT(s.message(), HasSubstr("new --journal directory"));
  EXPECT_TRUE(CheckJournalMatches(Options(), journal_->job()).ok());
}

}  // namespace
}  // namespace ballast::master
