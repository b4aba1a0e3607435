// The checkpoint replica channel (replica.h): real sockets and real
// shared-memory stores in one process.
#include "agent/replica.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/fake_kv.h"
#include "ckpt/checkpoint.h"
#include "ckpt/test_util.h"
#include "common/thread_priority.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using ckpt::test_util::BuildImage;
using ckpt::test_util::State;
using ckpt::test_util::UniqueShmName;
using ::testing::HasSubstr;

std::vector<uint8_t> ImageForStep(uint64_t step, uint64_t floats = 4096) {
  State st;
  st.Add("w", ckpt::DType::kFloat32, {static_cast<int64_t>(floats)}, static_cast<uint8_t>(step));
  return BuildImage(step, st.views);
}

// Saves image as `step` into store, as a worker would.
void Save(ckpt::SlotStore* store, uint64_t step, const std::vector<uint8_t>& image) {
  auto w = store->BeginSave(step, image.size());
  ASSERT_TRUE(w.ok()) << w.status();
  std::memcpy(w->image(), image.data(), image.size());
  ASSERT_TRUE(store->Commit(&*w, image.size()).ok());
}

std::unique_ptr<ckpt::SlotStore> NewStore(const std::string& tag) {
  auto s = ckpt::SlotStore::Create(UniqueShmName(tag));
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

std::string Addr(const ReplicaServer& s) { return absl::StrCat("127.0.0.1:", s.port()); }

TEST(ReplicaRecord, RoundTripsAndRejectsGarbage) {
  ReplicaRecord r{"node-2", "10.0.0.3:4100", 42, 6};
  auto back = ReplicaRecord::FromKvValue(r.ToKvValue());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->holder, "node-2");
  EXPECT_EQ(back->addr, "10.0.0.3:4100");
  EXPECT_EQ(back->step, 42u);
  EXPECT_EQ(back->world, 6);
  EXPECT_FALSE(ReplicaRecord::FromKvValue("node-2 10.0.0.3:4100 step=x world=6").ok());
  EXPECT_FALSE(ReplicaRecord::FromKvValue("").ok());
}

TEST(Replica, PutThenFetchIntoAnEmptyStoreIsAReplicaStepTheWorkerCanRestore) {
  auto server = ReplicaServer::Start(UniqueShmName("replica-holder"), "tok");
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<uint8_t> image = ImageForStep(7);
  ASSERT_TRUE(PutReplica(Addr(**server), "tok", 3, 4, 7, image.data(), image.size(), 5).ok());
  auto held = (*server)->Pin(3, 0);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->step(), 7u);

  auto into = NewStore("replica-into");
  auto step = FetchReplica(Addr(**server), "tok", 3, 7, into.get(), 5);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 7u);
  ckpt::RestoreOptions ro;
  ro.verify_data = true;
  auto snap = ckpt::RestoreFromShm(into.get(), ro);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 7u);
  EXPECT_THAT(snap->source(), ::testing::StartsWith("replica:shm:"));
  // The fetching agent gave up the writer role: the worker can save next.
  auto child = fork();
  if (child == 0) {
    auto opened = ckpt::SlotStore::Open(into->name());
    _exit(opened.ok() && (*opened)->BeginSave(8, image.size()).ok() ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(Replica, PutsAreTakenAtTheCopyNiceValueAndGetsAtTheAgents) {
  const int base = ThisThreadNice();
  auto server = ReplicaServer::Start(UniqueShmName("replica-nice"), "tok", /*copy_nice=*/13);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<uint8_t> image = ImageForStep(7);
  ASSERT_TRUE(PutReplica(Addr(**server), "tok", 3, 4, 7, image.data(), image.size(), 5).ok());
  EXPECT_EQ((*server)->last_put_nice(), std::max(base, 13));
  // A restore is on the critical path: not lowered.
  auto into = NewStore("replica-nice-into");
  ASSERT_TRUE(FetchReplica(Addr(**server), "tok", 3, 7, into.get(), 5).ok());
  EXPECT_EQ((*server)->last_get_nice(), base);
  EXPECT_EQ(ThisThreadNice(), base);
}

TEST(Replica, HolderKeepsAtMostTwoStepsPerSourceRank) {
  auto server = ReplicaServer::Start(UniqueShmName("replica-two"), "tok");
  ASSERT_TRUE(server.ok());
  for (uint64_t step = 1; step <= 4; ++step) {
    std::vector<uint8_t> image = ImageForStep(step);
    ASSERT_TRUE(PutReplica(Addr(**server), "tok", 0, 2, step, image.data(), image.size(), 5).ok());
  }
  EXPECT_TRUE((*server)->Pin(0, 4).ok());
  EXPECT_TRUE((*server)->Pin(0, 3).ok());
  EXPECT_TRUE(absl::IsNotFound((*server)->Pin(0, 2).status()));
  EXPECT_TRUE(absl::IsNotFound((*server)->Pin(1, 0).status())) << "no replica of another rank";
  // Finished connections do not pile up threads.
  for (uint64_t step = 5; step <= 40; ++step) {
    std::vector<uint8_t> image = ImageForStep(step, 16);
    ASSERT_TRUE(PutReplica(Addr(**server), "tok", 0, 2, step, image.data(), image.size(), 5).ok());
  }
  int threads = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) threads += e.is_directory() ? 1 : 0;
  EXPECT_LT(threads, 10);
}

TEST(Replica, WrongTokenAndTornImagesAreRefused) {
  auto server = ReplicaServer::Start(UniqueShmName("replica-refuse"), "tok");
  ASSERT_TRUE(server.ok());
  std::vector<uint8_t> image = ImageForStep(5);
  absl::Status s = PutReplica(Addr(**server), "other", 0, 2, 5, image.data(), image.size(), 5);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  std::vector<uint8_t> torn = image;
  torn[3] ^= 0xff;  // header magic
  s = PutReplica(Addr(**server), "tok", 0, 2, 5, torn.data(), torn.size(), 5);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  s = PutReplica(Addr(**server), "tok", 0, 2, 6, image.data(), image.size(), 5);
  EXPECT_THAT(s.message(), HasSubstr("holds step 5")) << s;
  EXPECT_TRUE(absl::IsNotFound((*server)->Pin(0, 0).status())) << "nothing refused was kept";
}

TEST(Replica, CorruptReplicaDataIsCaughtByTheVerifiedRestore) {
  auto server = ReplicaServer::Start(UniqueShmName("replica-corrupt"), "tok");
  ASSERT_TRUE(server.ok());
  std::vector<uint8_t> image = ImageForStep(9);
  ASSERT_TRUE(PutReplica(Addr(**server), "tok", 1, 2, 9, image.data(), image.size(), 5).ok());
  {
    auto held = (*server)->Pin(1, 9);
    ASSERT_TRUE(held.ok());
    // Flip a data byte of the held replica (a bad DIMM, a stray write).
    const_cast<uint8_t*>(held->image())[held->image_bytes() - 1] ^= 0x5a;
  }
  auto into = NewStore("replica-corrupt-into");
  ASSERT_TRUE(FetchReplica(Addr(**server), "tok", 1, 9, into.get(), 5).ok());
  ckpt::RestoreOptions ro;
  ro.verify_data = true;
  auto snap = ckpt::RestoreFromShm(into.get(), ro);
  EXPECT_TRUE(absl::IsDataLoss(snap.status())) << snap.status();
}

TEST(Replica, FetchOfAMissingReplicaSaysSoAndLeavesTheStoreEmpty) {
  auto server = ReplicaServer::Start(UniqueShmName("replica-missing"), "tok");
  ASSERT_TRUE(server.ok());
  auto into = NewStore("replica-missing-into");
  auto step = FetchReplica(Addr(**server), "tok", 5, 0, into.get(), 5);
  EXPECT_TRUE(absl::IsNotFound(step.status())) << step.status();
  EXPECT_TRUE(absl::IsNotFound(into->PinLatest().status()));
}

TEST(ReplicaSender, SendsEachNewSaveToTheRingPeerAndRecordsWhereItIs) {
  auto holder = ReplicaServer::Start(UniqueShmName("sender-holder"), "tok");
  ASSERT_TRUE(holder.ok());
  FakeKv kv;
  kv.Setter()(ReplicaEndpointKey("node-b"), Addr(**holder)).IgnoreError();
  auto own0 = NewStore("sender-own0");
  auto own1 = NewStore("sender-own1");
  Save(own0.get(), 1, ImageForStep(1));  // saved before the round: not this round's ranks
  ReplicaSender sender("node-a", "tok", {own0.get(), own1.get()}, kv.Setter(), kv.Getter(), /*poll=*/3600);
  sender.SetPeers({{"node-b", ""}}, /*rank_offset=*/4, /*world=*/6);
  EXPECT_EQ(sender.PollOnce(), 0) << "nothing saved in this round yet";
  Save(own0.get(), 2, ImageForStep(2));
  Save(own1.get(), 2, ImageForStep(2));
  EXPECT_EQ(sender.PollOnce(), 2);
  EXPECT_EQ(sender.PollOnce(), 0) << "each step goes once";
  EXPECT_EQ(kv.Get(ReplicaKey(4, 0)), absl::StrCat("node-b ", Addr(**holder), " step=2 world=6"));
  EXPECT_EQ(kv.Get(ReplicaKey(5, 0)), absl::StrCat("node-b ", Addr(**holder), " step=2 world=6"));
  EXPECT_TRUE((*holder)->Pin(4, 2).ok());
  EXPECT_TRUE((*holder)->Pin(5, 2).ok());
  Save(own0.get(), 3, ImageForStep(3));
  EXPECT_EQ(sender.PollOnce(), 1);
  EXPECT_TRUE((*holder)->Pin(4, 3).ok());
  // Not one master RPC per save: the record is refreshed every few seconds.
  EXPECT_EQ(kv.Get(ReplicaKey(4, 0)), absl::StrCat("node-b ", Addr(**holder), " step=2 world=6"));
  // A new round's holder is recorded at once.
  auto holder2 = ReplicaServer::Start(UniqueShmName("sender-holder2"), "tok");
  ASSERT_TRUE(holder2.ok());
  sender.SetPeers({{"node-c", Addr(**holder2)}}, 4, 6);
  Save(own0.get(), 4, ImageForStep(4));
  EXPECT_EQ(sender.PollOnce(), 1);
  EXPECT_EQ(kv.Get(ReplicaKey(4, 0)), absl::StrCat("node-c ", Addr(**holder2), " step=4 world=6"));
}

TEST(ReplicaSender, SendsTheStepTheWorkerAskedForAndTellsTheStoreWhatItCost) {
  auto holder = ReplicaServer::Start(UniqueShmName("paced-holder"), "tok");
  ASSERT_TRUE(holder.ok());
  FakeKv kv;
  ckpt::SlotStoreOptions so;
  so.num_slots = 4;
  auto made = ckpt::SlotStore::Create(UniqueShmName("paced-own"), so);
  ASSERT_TRUE(made.ok()) << made.status();
  ckpt::SlotStore* own = made->get();
  ReplicaSender sender("node-a", "tok", {own}, kv.Setter(), kv.Getter(), /*poll=*/3600);
  sender.SetPeers({{"node-b", Addr(**holder)}}, /*rank_offset=*/2, /*world=*/4);
  // Never asked: the newest step goes, as for a worker that does not pace.
  Save(own, 1, ImageForStep(1));
  EXPECT_EQ(sender.PollOnce(), 1);
  EXPECT_EQ(own->replicated_step(), 1u);
  EXPECT_GT(own->replica_put_s(), 0);
  // Asked for step 4 (every 4th step, say), saves 5 and 6 came after it.
  for (uint64_t step = 2; step <= 4; ++step) Save(own, step, ImageForStep(step));
  own->RequestReplica(4);
  for (uint64_t step = 5; step <= 6; ++step) Save(own, step, ImageForStep(step));
  EXPECT_EQ(sender.PollOnce(), 1);
  EXPECT_TRUE((*holder)->Pin(2, 4).ok());
  EXPECT_FALSE((*holder)->Pin(2, 6).ok()) << "a step the worker did not ask for was sent";
  EXPECT_EQ(own->replicated_step(), 4u);
  EXPECT_EQ(sender.PollOnce(), 0) << "each step goes once";
  // The asked-for step not committed yet (or gone): nothing goes.
  own->RequestReplica(8);
  EXPECT_EQ(sender.PollOnce(), 0);
  EXPECT_EQ(own->replicated_step(), 4u);
  for (uint64_t step = 7; step <= 8; ++step) Save(own, step, ImageForStep(step));
  EXPECT_EQ(sender.PollOnce(), 1);
  EXPECT_TRUE((*holder)->Pin(2, 8).ok());
  EXPECT_TRUE((*holder)->Pin(2, 4).ok()) << "the holder keeps the two newest";
  // This store keeps both replicated steps (4, 8) while newer saves rotate.
  for (uint64_t step = 9; step <= 14; ++step) {
    Save(own, step, ImageForStep(step));
    EXPECT_TRUE(own->PinStep(4).ok() && own->PinStep(8).ok()) << "save " << step;
  }
}

TEST(ReplicaSender, AnUnreachablePeerIsRetriedWithoutBlockingTheOthers) {
  auto good = ReplicaServer::Start(UniqueShmName("sender-good"), "tok");
  ASSERT_TRUE(good.ok());
  FakeKv kv;
  auto own = NewStore("sender-retry");
  ReplicaSender sender("node-a", "tok", {own.get()}, kv.Setter(), kv.Getter(), /*poll=*/3600);
  // Port 1 on loopback refuses at once.
  sender.SetPeers({{"node-dead", "127.0.0.1:1"}, {"node-c", Addr(**good)}}, 0, 3);
  Save(own.get(), 5, ImageForStep(5));
  EXPECT_EQ(sender.PollOnce(), 1);
  EXPECT_EQ(kv.Get(ReplicaKey(0, 1)), absl::StrCat("node-c ", Addr(**good), " step=5 world=3"));
  EXPECT_EQ(kv.Get(ReplicaKey(0, 0)), "");
}

}  // namespace
}  // namespace ballast::agent

namespace ballast::agent {
namespace {

TEST(SlotStoreIncoming, ReadersWaitForALiveFillerOnly) {
  auto store = NewStore("incoming");
  EXPECT_FALSE(store->incoming());
  store->SetIncoming(true);
  auto child = fork();
  if (child == 0) {
    auto opened = ckpt::SlotStore::Open(store->name());
    // Marked by a live process: a reader waits (here: times out).
    _exit(opened.ok() && (*opened)->incoming() && !(*opened)->WaitIncoming(0.05) ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  store->SetIncoming(false);
  EXPECT_TRUE(store->WaitIncoming(0));

  // A marker left by a process that died does not hold readers.
  child = fork();
  if (child == 0) {
    auto opened = ckpt::SlotStore::Open(store->name());
    if (opened.ok()) (*opened)->SetIncoming(true);
    _exit(0);
  }
  waitpid(child, &status, 0);
  EXPECT_FALSE(store->incoming());
  EXPECT_TRUE(store->WaitIncoming(0));
}

}  // namespace
}  // namespace ballast::agent
