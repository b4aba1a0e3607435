// The agent's checkpoint persister against real shared-memory stores, a real
// checkpoint directory and a fake master (the ShardReporter seam). The test
// plays the worker: it opens the store by name, saves images and uses the
// persistence channel as the Python Checkpointer does.
#include "agent/ckpt_persister.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/agent.h"
#include "agent/worker_group.h"
#include "ckpt/persister.h"
#include "ckpt/reader.h"
#include "ckpt/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

namespace fs = std::filesystem;
using ckpt::test_util::BuildImage;
using ckpt::test_util::MakeTempDir;
using ckpt::test_util::State;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::vector<uint8_t> ImageForStep(uint64_t step) {
  State st;
  st.Add("w", ckpt::DType::kFloat32, {256}, static_cast<uint8_t>(step));
  return BuildImage(step, st.views);
}

// The master's commit rule (job_master.cc), in miniature and thread-safe.
class FakeCommitMaster {
 public:
  ShardReporter Reporter() {
    return [this](const v1::ShardDurableReport& r, double) -> absl::StatusOr<v1::ShardDurableResponse> {
      std::lock_guard<std::mutex> lock(mu_);
      reports.push_back(r);
      if (!unavailable.ok()) return unavailable;
      v1::ShardDurableResponse resp;
      auto& ranks = ranks_[{r.dir(), r.step()}];
      ranks.insert(r.rank());
      if (static_cast<int>(ranks.size()) == r.world_size() && committed_.insert({r.dir(), r.step()}).second)
        resp.set_commit(true);
      return resp;
    };
  }
  std::mutex mu_;
  std::vector<v1::ShardDurableReport> reports;
  absl::Status unavailable;

 private:
  std::map<std::pair<std::string, int64_t>, std::set<int>> ranks_;
  std::set<std::pair<std::string, int64_t>> committed_;
};

class AgentCkptPersisterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("agentckpt");
    CkptPersisterOptions o;
    o.node_id = "node-a";
    o.local_world_size = 2;
    o.name_prefix = CkptStorePrefix(absl::StrCat("test-", dir_), getpid());
    o.retry_after_s = 0;
    o.latest_check_interval_s = 0;
    auto p = CkptPersister::Create(o, master_.Reporter());
    ASSERT_TRUE(p.ok()) << p.status();
    persister_ = std::move(*p);
    for (int lr = 0; lr < 2; ++lr) {
      auto w = ckpt::SlotStore::Open(persister_->store_name(lr));
      ASSERT_TRUE(w.ok()) << w.status();
      workers_.push_back(std::move(*w));
    }
  }
  void TearDown() override {
    workers_.clear();
    persister_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // What the Python Checkpointer does for save(step, ..., persist=...).
  void Save(int lr, uint64_t step, bool persist, int world_size = 2) {
    ckpt::SlotStore* w = workers_[lr].get();
    std::vector<uint8_t> img = ImageForStep(step);
    auto write = w->BeginSave(step, img.size());
    ASSERT_TRUE(write.ok()) << write.status();
    std::memcpy(write->image(), img.data(), img.size());
    ASSERT_TRUE(w->Commit(&*write, img.size()).ok());
    if (persist) {
      ASSERT_TRUE(w->SetPersistConfig({dir_, lr, world_size, 3}).ok());
      w->RequestPersist(step);
    }
  }

  std::string dir_;
  FakeCommitMaster master_;
  std::unique_ptr<CkptPersister> persister_;
  std::vector<std::unique_ptr<ckpt::SlotStore>> workers_;
};

TEST_F(AgentCkptPersisterTest, StoreNamesAreValidAndUniquePerAgent) {
  EXPECT_THAT(persister_->store_name(0), MatchesRegex("/ballast-[0-9a-f]{8}-[0-9]+-0"));
  EXPECT_THAT(persister_->store_name(1), MatchesRegex("/ballast-[0-9a-f]{8}-[0-9]+-1"));
  EXPECT_EQ(CkptStorePrefix("job", 42), CkptStorePrefix("job", 42));
  EXPECT_NE(CkptStorePrefix("job", 42), CkptStorePrefix("job", 43));
  EXPECT_NE(CkptStorePrefix("job-a", 42), CkptStorePrefix("job-b", 42));
  EXPECT_TRUE(persister_->store(0)->owner());
}

TEST_F(AgentCkptPersisterTest, RequestedStepBecomesDurableAndTheLastReporterCommits) {
  EXPECT_EQ(workers_[0]->durable_write_s(), 0.0);
  Save(0, 3, true);
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 3u);
  // The worker hears what the write took (its pacing of persists weighs it).
  EXPECT_GT(workers_[0]->durable_write_s(), 0.0);
  EXPECT_LT(workers_[0]->durable_write_s(), 60.0);
  EXPECT_TRUE(fs::exists(ckpt::ShardPath(dir_, 3, 0)));
  EXPECT_FALSE(fs::exists(ckpt::LatestPath(dir_)));  // rank 1 not durable yet
  Save(1, 3, true);
  persister_->PollOnce();
  EXPECT_EQ(workers_[1]->durable_step(), 3u);
  auto latest = ckpt::ReadLatestStep(dir_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 3u);
  EXPECT_EQ(workers_[1]->committed_step(), 3u);  // the committer
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->committed_step(), 3u);  // learned from `latest`
  ASSERT_EQ(master_.reports.size(), 2u);
  EXPECT_EQ(master_.reports[0].node_id(), "node-a");
  EXPECT_EQ(master_.reports[0].step(), 3);
  EXPECT_EQ(master_.reports[0].world_size(), 2);
  EXPECT_EQ(master_.reports[0].dir(), dir_);
  auto snap = ckpt::ReadLatest(dir_, 1);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 3u);
}

TEST_F(AgentCkptPersisterTest, NothingIsPersistedWithoutARequestOrConfig) {
  Save(0, 1, false);
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 0u);
  EXPECT_TRUE(ckpt::ListSteps(dir_).empty());
  // A breakpoint save needs the persist config too (it says where and as what).
  EXPECT_EQ(persister_->BreakpointSave("test"), 0);
  EXPECT_TRUE(master_.reports.empty());
}

TEST_F(AgentCkptPersisterTest, ARequestedStepSurvivesNewerSavesUntilItIsPersisted) {
  // A slow persister: steps 2 and 3 (not requested) are saved before it
  // polls. The requested step 1 keeps its slot; they share the other.
  Save(0, 1, true);
  Save(0, 2, false);
  Save(0, 3, false);
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 1u);
  EXPECT_TRUE(fs::exists(ckpt::ShardPath(dir_, 1, 0)));
}

TEST_F(AgentCkptPersisterTest, ARequestOverwrittenWhileEveryOtherSlotIsPinnedIsReportedAndSkippedUntilTheNextRequest) {
  Save(0, 1, true);
  Save(0, 2, false);
  Save(0, 3, false);
  {
    // Readers hold steps 2 and 3: step 4 can only go over the requested step 1.
    auto reader2 = workers_[0]->PinStep(2);
    auto reader3 = workers_[0]->PinStep(3);
    ASSERT_TRUE(reader2.ok() && reader3.ok());
    Save(0, 4, false);
  }
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 0u);
  EXPECT_TRUE(ckpt::ListSteps(dir_).empty());
  auto err = workers_[0]->GetPersistError();
  ASSERT_TRUE(err.has_value());  // the worker's wait() says why instead of waiting
  EXPECT_EQ(err->step, 1u);
  EXPECT_THAT(err->message, HasSubstr("was overwritten in shared memory by newer saves"));
  Save(0, 5, true);
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 5u);
  EXPECT_TRUE(fs::exists(ckpt::ShardPath(dir_, 5, 0)));
  EXPECT_FALSE(fs::exists(ckpt::ShardPath(dir_, 4, 0)));
}

TEST_F(AgentCkptPersisterTest, AFailingDiskIsRetriedAFewTimesThenTheStepIsGivenUp) {
  // The checkpoint "directory" is a regular file: every shard write fails.
  const std::string file = dir_ + "/not-a-dir";
  fs::create_directories(dir_);
  std::ofstream(file) << "x";
  ckpt::SlotStore* w = workers_[0].get();
  std::vector<uint8_t> img = ImageForStep(1);
  auto write = w->BeginSave(1, img.size());
  ASSERT_TRUE(write.ok());
  std::memcpy(write->image(), img.data(), img.size());
  ASSERT_TRUE(w->Commit(&*write, img.size()).ok());
  ASSERT_TRUE(w->SetPersistConfig({file, 0, 2, 3}).ok());
  w->RequestPersist(1);
  for (int attempt = 1; attempt <= CkptPersisterOptions::kMaxWriteAttempts; ++attempt) {
    persister_->PollOnce();
    auto err = w->GetPersistError();
    ASSERT_TRUE(err.has_value());
    EXPECT_EQ(err->step, 1u);
    if (attempt < CkptPersisterOptions::kMaxWriteAttempts) {
      EXPECT_THAT(err->message, HasSubstr("it retries every"));
    } else {
      EXPECT_THAT(err->message, HasSubstr("gave up writing step 1"));
      EXPECT_THAT(err->message, HasSubstr("after 3 attempts"));
    }
  }
  // No more attempts for that step; the message stays the give-up.
  persister_->PollOnce();
  EXPECT_THAT(w->GetPersistError()->message, HasSubstr("gave up"));
  EXPECT_EQ(w->durable_step(), 0u);
  EXPECT_TRUE(master_.reports.empty());
}

// One agent with one store, whose master is `reporter` (a slow one in these
// tests), and the worker that saves into it.
struct OneStoreAgent {
  OneStoreAgent(const std::string& name, ShardReporter reporter) : dir(MakeTempDir(name)) {
    CkptPersisterOptions o;
    o.node_id = "node-s";
    o.local_world_size = 1;
    o.name_prefix = CkptStorePrefix(absl::StrCat(name, "-", dir), getpid());
    o.retry_after_s = 0;
    auto p = CkptPersister::Create(o, std::move(reporter));
    if (!p.ok()) {
      ADD_FAILURE() << p.status();
      return;
    }
    persister = std::move(*p);
    auto w = ckpt::SlotStore::Open(persister->store_name(0));
    if (!w.ok()) {
      ADD_FAILURE() << w.status();
      return;
    }
    worker = std::move(*w);
  }
  ~OneStoreAgent() {
    worker.reset();
    persister.reset();
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  // What the Python Checkpointer does for save(step, persist=...): world of one.
  void Save(uint64_t step, bool persist) {
    std::vector<uint8_t> img = ImageForStep(step);
    auto write = worker->BeginSave(step, img.size());
    ASSERT_TRUE(write.ok());
    std::memcpy(write->image(), img.data(), img.size());
    ASSERT_TRUE(worker->Commit(&*write, img.size()).ok());
    ASSERT_TRUE(worker->SetPersistConfig({dir, 0, 1, 3}).ok());
    if (persist) worker->RequestPersist(step);
  }
  const std::string dir;
  std::unique_ptr<CkptPersister> persister;
  std::unique_ptr<ckpt::SlotStore> worker;
};

TEST(AgentCkptPersisterSlowMaster, ABreakpointSaveAtARestartDoesNotWaitForAReportInFlight) {
  // The master takes 1 s to answer a durable report; meanwhile the agent's
  // event loop pins its breakpoint save (a restart): that must not wait.
  std::atomic<bool> in_report{false};
  OneStoreAgent a("slowmaster", [&](const v1::ShardDurableReport&, double) -> absl::StatusOr<v1::ShardDurableResponse> {
    in_report = true;
    std::this_thread::sleep_for(std::chrono::seconds(1));
    return v1::ShardDurableResponse();
  });
  ASSERT_NE(a.worker, nullptr);
  a.Save(1, true);
  std::thread poll([&] { a.persister->PollOnce(); });  // writes step 1, then reports it (1 s)
  while (!in_report) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  a.Save(2, false);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(a.persister->BreakpointSaveAsync("restart"), 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5);
  poll.join();
  a.persister->PollOnce();  // the poll thread writes the pending breakpoint save
  EXPECT_EQ(a.worker->durable_step(), 2u);
}

TEST(AgentCkptPersisterSlowMaster, AFinalBreakpointSaveWritesWhileTheLastReportIsStillInFlight) {
  // The master takes 1.5 s to answer the report of step 1; meanwhile the
  // agent exits and saves step 2 (BreakpointSave): its write and report must
  // not wait behind step 1's report (the store's lock is not held across it).
  std::atomic<bool> in_report{false};
  OneStoreAgent a("slowreport", [&](const v1::ShardDurableReport& r, double)
                                    -> absl::StatusOr<v1::ShardDurableResponse> {
    if (r.step() == 1) {
      in_report = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
    v1::ShardDurableResponse resp;
    resp.set_commit(true);  // one rank: every report completes its step
    return resp;
  });
  ASSERT_NE(a.worker, nullptr);
  a.Save(1, true);
  std::thread poll([&] { a.persister->PollOnce(); });  // writes step 1, then reports it (1.5 s)
  while (!in_report) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  a.Save(2, false);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(a.persister->BreakpointSave("the agent is exiting"), 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0)
      << "the breakpoint save waited for step 1's report";
  EXPECT_EQ(a.worker->durable_step(), 2u);
  EXPECT_EQ(*ckpt::ReadLatestStep(a.dir), 2u);
  poll.join();
  EXPECT_EQ(*ckpt::ReadLatestStep(a.dir), 2u) << "step 1's late commit does not move `latest` back";
}

TEST_F(AgentCkptPersisterTest, BreakpointSavePersistsTheNewestInMemoryStepOnce) {
  Save(0, 5, true);
  Save(1, 5, true);
  persister_->PollOnce();
  ASSERT_EQ(*ckpt::ReadLatestStep(dir_), 5u);
  // Step 6 only in memory (persist=False), then the workers die.
  Save(0, 6, false);
  Save(1, 6, false);
  EXPECT_EQ(persister_->BreakpointSave("worker failed"), 2);
  EXPECT_EQ(workers_[0]->durable_step(), 6u);
  EXPECT_EQ(workers_[1]->durable_step(), 6u);
  EXPECT_EQ(*ckpt::ReadLatestStep(dir_), 6u);  // committed synchronously
  EXPECT_EQ(persister_->BreakpointSave("again"), 0);
}

TEST_F(AgentCkptPersisterTest, BackgroundBreakpointSaveKeepsItsStepWhileTheNextWorkersSave) {
  Save(0, 5, false);
  Save(1, 5, false);
  ASSERT_TRUE(workers_[0]->SetPersistConfig({dir_, 0, 2, 3}).ok());
  ASSERT_TRUE(workers_[1]->SetPersistConfig({dir_, 1, 2, 3}).ok());
  // Ranks that never asked for disk: nothing at a restart (their last state
  // is written when the agent exits).
  EXPECT_EQ(persister_->BreakpointSaveAsync("a restart, nothing asked"), 0);
  workers_[0]->RequestPersist(1);  // asked once (an older step, already gone from memory)
  workers_[1]->RequestPersist(1);
  // The workers died with step 5 only in memory: pinned now, written later.
  EXPECT_EQ(persister_->BreakpointSaveAsync("round 2 replaces round 1"), 2);
  EXPECT_EQ(persister_->BreakpointSaveAsync("again"), 0);  // already pending
  EXPECT_EQ(workers_[0]->durable_step(), 0u);
  // The restarted worker saves twice before the persister's thread runs:
  // step 5's slot is pinned, so step 7 overwrites step 6 instead.
  Save(0, 6, false);
  Save(0, 7, false);
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 5u);
  EXPECT_EQ(workers_[1]->durable_step(), 5u);
  EXPECT_EQ(*ckpt::ReadLatestStep(dir_), 5u);
  auto snap = ckpt::ReadLatest(dir_, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 5u);
  EXPECT_EQ(persister_->BreakpointSaveAsync("nothing newer than durable"), 1);  // step 7 of rank 0
}

TEST_F(AgentCkptPersisterTest, StoppingThePersisterWritesAPendingBreakpointSave) {
  Save(0, 4, false);
  ASSERT_TRUE(workers_[0]->SetPersistConfig({dir_, 0, 2, 3}).ok());
  workers_[0]->RequestPersist(2);
  EXPECT_EQ(persister_->BreakpointSaveAsync("the agent is exiting"), 1);
  persister_->Stop();
  EXPECT_EQ(workers_[0]->durable_step(), 4u);
  EXPECT_TRUE(fs::exists(ckpt::ShardPath(dir_, 4, 0)));
}

TEST_F(AgentCkptPersisterTest, ARankThatNeverAskedForDiskIsWrittenWhenTheAgentExits) {
  // Flash checkpoints in memory only; the Checkpointer named its folder.
  Save(0, 7, false);
  Save(1, 7, false);
  ASSERT_TRUE(workers_[0]->SetPersistConfig({dir_, 0, 2, 3}).ok());
  ASSERT_TRUE(workers_[1]->SetPersistConfig({dir_, 1, 2, 3}).ok());
  EXPECT_EQ(persister_->BreakpointSaveAsync("a restart"), 0);
  persister_->PollOnce();
  EXPECT_FALSE(fs::exists(ckpt::ShardPath(dir_, 7, 0)));
  EXPECT_EQ(persister_->BreakpointSave("the agent got SIGTERM"), 2);  // a preemption
  EXPECT_EQ(*ckpt::ReadLatestStep(dir_), 7u);
}

TEST_F(AgentCkptPersisterTest, WithoutTheMasterAStepCommitsOnceAllShardsAreOnDisk) {
  master_.unavailable = absl::UnavailableError("master gone");
  Save(0, 7, true);
  persister_->PollOnce();
  EXPECT_EQ(workers_[0]->durable_step(), 7u);
  EXPECT_FALSE(fs::exists(ckpt::LatestPath(dir_)));
  Save(1, 7, true);
  persister_->PollOnce();
  auto latest = ckpt::ReadLatestStep(dir_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 7u);
}

TEST_F(AgentCkptPersisterTest, FailedReportIsRetriedUntilTheMasterAnswers) {
  master_.unavailable = absl::UnavailableError("master briefly away");
  Save(0, 8, true);
  persister_->PollOnce();
  size_t n = master_.reports.size();
  master_.unavailable = absl::OkStatus();
  persister_->PollOnce();
  ASSERT_EQ(master_.reports.size(), n + 1);
  persister_->PollOnce();  // acknowledged: not reported again
  EXPECT_EQ(master_.reports.size(), n + 1);
}

TEST_F(AgentCkptPersisterTest, ThePollThreadServesRequestsWhileTheWriterKeepsSaving) {
  persister_->Start();
  for (uint64_t step = 1; step <= 20; ++step) {
    Save(0, step, true, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // committed_step is marked after the whole commit (COMPLETE, latest,
  // retention); durable_step already before it, so waiting on that races.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (workers_[0]->committed_step() < 20 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(workers_[0]->durable_step(), 20u);
  EXPECT_EQ(workers_[0]->committed_step(), 20u);
  auto latest = ckpt::ReadLatestStep(dir_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 20u);
  EXPECT_LE(ckpt::ListCompleteSteps(dir_).size(), 3u);  // keep_last
  persister_->Stop();
}

TEST(AgentCkptStores, AreUnlinkedWhenThePersisterIsDestroyed) {
  CkptPersisterOptions o;
  o.local_world_size = 1;
  o.name_prefix = CkptStorePrefix("unlink-test", getpid());
  std::string name;
  {
    auto p = CkptPersister::Create(o, nullptr);
    ASSERT_TRUE(p.ok()) << p.status();
    name = (*p)->store_name(0);
    EXPECT_TRUE(fs::exists("/dev/shm" + name));
    EXPECT_TRUE(fs::exists("/dev/shm" + name + ".s1"));
  }
  EXPECT_FALSE(fs::exists("/dev/shm" + name));
  EXPECT_FALSE(fs::exists("/dev/shm" + name + ".s0"));
  EXPECT_FALSE(ckpt::SlotStore::Open(name).ok());
}

TEST(AgentCkptStores, StaleShmObjectsOfDeadAgentsAreRemoved) {
  const std::string dir = MakeTempDir("stale");
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // now a pid that does not exist
  auto touch = [&](const std::string& name) { std::ofstream(dir + "/" + name) << "x"; };
  const std::string dead = absl::StrCat("ballast-0123abcd-", child, "-0");
  const std::string alive = absl::StrCat("ballast-0123abcd-", getpid(), "-0");
  touch(dead);
  touch(dead + ".s1");
  touch(alive);
  touch(absl::StrCat("ballast-progress-", child));
  touch(absl::StrCat("ballast-progress-", getpid()));
  touch(absl::StrCat("ballast-test-x-", child, "-0"));  // not an agent object
  EXPECT_EQ(RemoveStaleAgentShmObjects(dir), 3);
  EXPECT_FALSE(fs::exists(dir + "/" + absl::StrCat("ballast-progress-", child)));
  EXPECT_TRUE(fs::exists(dir + "/" + absl::StrCat("ballast-progress-", getpid())));
  EXPECT_FALSE(fs::exists(dir + "/" + dead));
  EXPECT_TRUE(fs::exists(dir + "/" + alive));
  EXPECT_TRUE(fs::exists(dir + "/" + absl::StrCat("ballast-test-x-", child, "-0")));
  fs::remove_all(dir);
}

TEST(AgentCkptEnv, WorkersGetTheirOwnStoreAndThePythonPackage) {
  WorkerSpec spec;
  spec.base_env = {{"PATH", "/bin"}};
  spec.local_rank_env = {{{kCkptShmEnv, "/ballast-x-1-0"}}, {{kCkptShmEnv, "/ballast-x-1-1"}}};
  RoundSpec round;
  round.local_world_size = 2;
  EXPECT_EQ(WorkerEnvironment(spec, round, 0).at(kCkptShmEnv), "/ballast-x-1-0");
  EXPECT_EQ(WorkerEnvironment(spec, round, 1).at(kCkptShmEnv), "/ballast-x-1-1");
  spec.local_rank_env.clear();
  EXPECT_EQ(WorkerEnvironment(spec, round, 0).count(kCkptShmEnv), 0u);

  EXPECT_EQ(WorkerPythonPath("/b/python", ""), "/b/python");
  EXPECT_EQ(WorkerPythonPath("/b/python", "/u/lib"), "/b/python:/u/lib");
  EXPECT_EQ(WorkerPythonPath("/b/python", "/b/python:/u/lib"), "/b/python:/u/lib");
  EXPECT_EQ(WorkerPythonPath("", "/u/lib"), "/u/lib");

  const std::string root = MakeTempDir("pkg");
  fs::create_directories(root + "/bin");
  EXPECT_EQ(PythonPackageDir(root + "/bin/ballast"), "");  // no python/ next to bin/
  fs::create_directories(root + "/python/ballast");
  EXPECT_EQ(PythonPackageDir(root + "/bin/ballast"), fs::weakly_canonical(root + "/python").string());
  fs::remove_all(root);
}

}  // namespace
}  // namespace ballast::agent
