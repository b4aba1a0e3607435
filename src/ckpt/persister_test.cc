#include "ckpt/persister.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "ckpt/checkpoint.h"
#include "ckpt/reader.h"
#include "ckpt/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::ckpt {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using test_util::BuildImage;
using test_util::MakeTempDir;
using test_util::State;
using test_util::UniqueShmName;

std::vector<uint8_t> ImageForStep(uint64_t step, uint64_t bytes = 3000) {
  State st;
  st.Add("w", DType::kFloat32, {static_cast<int64_t>(bytes / 4)}, static_cast<uint8_t>(step));
  st.Add("meta", DType::kBlob, {}, 10, static_cast<uint8_t>(step + 1));
  return BuildImage(step, st.views);
}

absl::Status WriteAndCommit(const std::string& dir, uint64_t step, int world, int keep) {
  for (int r = 0; r < world; ++r) {
    auto img = ImageForStep(step);
    absl::Status s = WriteShardFile(dir, step, r, img.data(), img.size());
    if (!s.ok()) return s;
  }
  return CommitStep(dir, step, world, keep);
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

TEST(CkptPersister, ShardFileRoundTrip) {
  const std::string dir = MakeTempDir("rt");
  auto img = ImageForStep(12);
  ASSERT_TRUE(WriteShardFile(dir, 12, 3, img.data(), img.size()).ok());
  EXPECT_TRUE(fs::exists(dir + "/step-12/rank-3.ballast"));
  EXPECT_FALSE(fs::exists(dir + "/step-12/rank-3.ballast.tmp"));
  auto snap = ReadCheckpointFile(ShardPath(dir, 12, 3));
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 12u);
  ASSERT_EQ(snap->entries().size(), 2u);
  auto parsed = ParseImage(img.data(), img.size(), "mem");
  EXPECT_EQ(std::memcmp(snap->EntryData(0), parsed->data, snap->entries()[0].nbytes), 0);
}

TEST(CkptPersister, LatestOnlyWhenEveryRankIsDurable) {
  const std::string dir = MakeTempDir("world");
  LocalCommitCoordinator coord(dir, /*world_size=*/3, /*keep_last=*/2);
  for (int r = 0; r < 3; ++r) {
    auto img = ImageForStep(5);
    ASSERT_TRUE(WriteShardFile(dir, 5, r, img.data(), img.size()).ok());
    auto committed = coord.OnShardDurable(5, r);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(*committed, r == 2);
    EXPECT_EQ(ReadLatestStep(dir).ok(), r == 2);
  }
  EXPECT_EQ(*ReadLatestStep(dir), 5u);
  EXPECT_THAT(ListCompleteSteps(dir), ElementsAre(5));
  EXPECT_EQ(CommitStep(dir, 6, 3, 2).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CkptPersister, RecommitBySmallerWorldDropsTheLargerWorldsShards) {
  // World 2 commits step 7; the job scales down and world 1 redoes step 7.
  const std::string dir = MakeTempDir("recommit");
  for (int r = 0; r < 2; ++r) {
    auto img = ImageForStep(7);
    ASSERT_TRUE(WriteShardFile(dir, 7, r, img.data(), img.size()).ok());
  }
  ASSERT_TRUE(CommitStep(dir, 7, 2, 5).ok());
  auto img = ImageForStep(7);
  ASSERT_TRUE(WriteShardFile(dir, 7, 0, img.data(), img.size()).ok());
  ASSERT_TRUE(CommitStep(dir, 7, 1, 5).ok());
  // Rank 1's file was of the other history: gone, and the marker says who saved the step.
  EXPECT_FALSE(fs::exists(dir + "/step-7/rank-1.ballast"));
  EXPECT_TRUE(fs::exists(dir + "/step-7/rank-0.ballast"));
  std::ifstream marker(dir + "/step-7/COMPLETE");
  std::string text((std::istreambuf_iterator<char>(marker)), {});
  EXPECT_EQ(text, "world_size=1\n");
}

TEST(CkptPersister, LatestNeverMovesBackwards) {
  const std::string dir = MakeTempDir("back");
  ASSERT_TRUE(WriteAndCommit(dir, 20, 1, 5).ok());
  ASSERT_TRUE(WriteAndCommit(dir, 10, 1, 5).ok());  // a late commit of an older step
  EXPECT_EQ(*ReadLatestStep(dir), 20u);
}

TEST(CkptPersister, RewindDeletesTheDroppedStepsAndMovesLatestBack) {
  const std::string dir = MakeTempDir("rewind");
  for (uint64_t step : {2, 4, 6}) ASSERT_TRUE(WriteAndCommit(dir, step, 2, 5).ok());
  auto img = ImageForStep(7);
  ASSERT_TRUE(WriteShardFile(dir, 7, 0, img.data(), img.size()).ok());  // in progress
  auto gone = RewindSteps(dir, 5);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_THAT(*gone, ElementsAre(6, 7));
  EXPECT_THAT(ListSteps(dir), ElementsAre(2, 4));
  EXPECT_EQ(*ReadLatestStep(dir), 4u);
  // The re-trained step 6 commits again; a rewind below every step leaves no latest.
  ASSERT_TRUE(WriteAndCommit(dir, 6, 2, 5).ok());
  EXPECT_EQ(*ReadLatestStep(dir), 6u);
  ASSERT_TRUE(RewindSteps(dir, 1).ok());
  EXPECT_TRUE(ListSteps(dir).empty());
  EXPECT_FALSE(ReadLatestStep(dir).ok());
  EXPECT_TRUE(RewindSteps(dir + "/missing", 1)->empty());
}

TEST(CkptPersister, RetentionKeepsNewestKCompleteSteps) {
  const std::string dir = MakeTempDir("keep");
  ASSERT_TRUE(WriteAndCommit(dir, 1, 2, 2).ok());
  ASSERT_TRUE(WriteAndCommit(dir, 2, 2, 2).ok());
  // Step 3: only rank 0 got its shard out (abandoned); step 5 is in progress.
  auto img = ImageForStep(3);
  ASSERT_TRUE(WriteShardFile(dir, 3, 0, img.data(), img.size()).ok());
  EXPECT_THAT(ListSteps(dir), ElementsAre(1, 2, 3));  // nothing deleted before a newer commit
  ASSERT_TRUE(WriteAndCommit(dir, 4, 2, 2).ok());
  img = ImageForStep(5);
  ASSERT_TRUE(WriteShardFile(dir, 5, 0, img.data(), img.size()).ok());
  ASSERT_TRUE(ApplyRetention(dir, 2).ok());
  EXPECT_THAT(ListSteps(dir), ElementsAre(2, 4, 5));
  EXPECT_THAT(ListCompleteSteps(dir), ElementsAre(2, 4));
  ASSERT_TRUE(WriteAndCommit(dir, 6, 2, 1).ok());
  EXPECT_THAT(ListSteps(dir), ElementsAre(6));
  auto snap = ReadLatest(dir, 1);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 6u);
}

TEST(CkptPersister, PersistsNewestCommittedSlotAndCommitsAlone) {
  const std::string dir = MakeTempDir("slot");
  auto store = SlotStore::Create(UniqueShmName("pers"));
  ASSERT_TRUE(store.ok());
  WriterOptions wo;
  wo.copy_threads = 1;
  CheckpointWriter writer(store->get(), wo);
  State st;
  st.Add("x", DType::kInt64, {100}, 1);
  ASSERT_TRUE(writer.Save(7, st.views).ok());
  LocalCommitCoordinator coord(dir, 1, 2);
  PersisterOptions po;
  po.dir = dir;
  Persister persister(store->get(), &coord, po);
  auto r = persister.PersistNewest();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->written);
  EXPECT_TRUE(r->committed);
  EXPECT_EQ(r->step, 7u);
  r = persister.PersistNewest();  // nothing new
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->written);
  auto snap = ReadLatest(dir, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 7u);
  EXPECT_EQ(std::memcmp(snap->EntryData(0), st.buffers[0].data(), 800), 0);
}

TEST(CkptPersister, PersistsTheRequestedStepNotANewerSave) {
  // save(5, persist=True) then save(6) before the persister ran: step 5 is
  // what reaches the disk (it was asked for), not 6.
  const std::string dir = MakeTempDir("req");
  auto store = SlotStore::Create(UniqueShmName("preq"));
  ASSERT_TRUE(store.ok());
  WriterOptions wo;
  wo.copy_threads = 1;
  CheckpointWriter writer(store->get(), wo);
  State st;
  st.Add("x", DType::kInt64, {100}, 1);
  ASSERT_TRUE(writer.Save(5, st.views).ok());
  ASSERT_TRUE(writer.Save(6, st.views).ok());
  LocalCommitCoordinator coord(dir, 1, 2);
  PersisterOptions po;
  po.dir = dir;
  Persister persister(store->get(), &coord, po);
  auto r = persister.Persist(5);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 5u);
  EXPECT_THAT(ListCompleteSteps(dir), ElementsAre(5));
  // Once every slot holds a newer step, the newest is written instead.
  ASSERT_TRUE(writer.Save(7, st.views).ok());
  ASSERT_TRUE(writer.Save(8, st.views).ok());
  ASSERT_TRUE(writer.Save(9, st.views).ok());
  r = persister.Persist(6);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 9u);
}

TEST(CkptPersister, AsyncPersisterMakesRequestedStepDurable) {
  const std::string dir = MakeTempDir("async");
  auto store = SlotStore::Create(UniqueShmName("async"));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get());
  LocalCommitCoordinator coord(dir, 1, 3);
  PersisterOptions po;
  po.dir = dir;
  Persister persister(store->get(), &coord, po);
  AsyncPersister async(&persister);
  State st;
  st.Add("x", DType::kFloat16, {1 << 20}, 1);
  for (uint64_t step = 1; step <= 10; ++step) {
    auto r = writer.Save(step, st.views);
    ASSERT_TRUE(r.ok() || absl::IsUnavailable(r.status())) << r.status();
    async.Request(step);
  }
  ASSERT_TRUE(async.WaitDurable(10, 30).ok());
  EXPECT_EQ(*ReadLatestStep(dir), 10u);
  EXPECT_LE(ListCompleteSteps(dir).size(), 3u);
}

// Crash injection: the persisting process is SIGKILLed in the middle of
// writing a shard. `latest` keeps naming the previous step, which loads; the
// partial file is never read as a step.
TEST(CkptPersisterCrash, KilledMidWriteKeepsPreviousDurableStep) {
  const std::string dir = MakeTempDir("kill");
  auto store = SlotStore::Create(UniqueShmName("pkill"));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get());
  State one;
  one.Add("w", DType::kUInt8, {4 << 20}, 1);
  ASSERT_TRUE(writer.Save(1, one.views).ok());
  {
    LocalCommitCoordinator coord(dir, 1, 2);
    PersisterOptions po;
    po.dir = dir;
    Persister p(store->get(), &coord, po);
    ASSERT_TRUE(p.PersistNewest().ok());
  }
  State two;
  two.Add("w", DType::kUInt8, {4 << 20}, 2);
  ASSERT_TRUE(writer.Save(2, two.views).ok());

  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    auto agent = SlotStore::Open((*store)->name());
    if (!agent.ok()) _exit(2);
    LocalCommitCoordinator coord(dir, 1, 2);
    PersisterOptions po;
    po.dir = dir;
    po.write.chunk_bytes = 1 << 20;
    po.write.after_chunk_for_test = [&](uint64_t written) {
      if (written >= (2u << 20)) {
        char c = 'x';
        if (write(fds[1], &c, 1) != 1) _exit(5);
        pause();
      }
    };
    Persister p(agent->get(), &coord, po);
    p.PersistNewest().IgnoreError();
    _exit(3);
  }
  ASSERT_TRUE(test_util::KillChildWhenReady(child, fds[0], fds[1]));

  EXPECT_EQ(*ReadLatestStep(dir), 1u);
  EXPECT_TRUE(fs::exists(ShardPath(dir, 2, 0) + ".tmp"));
  EXPECT_EQ(ReadCheckpointFile(ShardPath(dir, 2, 0)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(ListCompleteSteps(dir), ElementsAre(1));
  auto snap = ReadLatest(dir, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 1u);
  EXPECT_EQ(std::memcmp(snap->EntryData(0), one.buffers[0].data(), 4 << 20), 0);

  // The dead persister's pin is cleared, so saves keep alternating slots, and
  // a new persister finishes step 2 over the partial temp file.
  State three;
  three.Add("w", DType::kUInt8, {4 << 20}, 3);
  ASSERT_TRUE(writer.Save(3, three.views).ok());
  ASSERT_TRUE(writer.Save(4, three.views).ok());
  LocalCommitCoordinator coord(dir, 1, 2);
  PersisterOptions po;
  po.dir = dir;
  Persister p(store->get(), &coord, po);
  ASSERT_TRUE(p.PersistNewest().ok());
  EXPECT_EQ(*ReadLatestStep(dir), 4u);
  EXPECT_THAT(ListCompleteSteps(dir), ElementsAre(1, 4));
  EXPECT_THAT(ListSteps(dir), ElementsAre(1, 4));  // the partial step 2 is gone
}

TEST(CkptReader, CorruptAndTruncatedFilesGiveDataLossWithFileName) {
  const std::string dir = MakeTempDir("corrupt");
  auto img = ImageForStep(9, 100000);
  const std::string path = dir + "/x.ballast";
  for (uint64_t len : {uint64_t{0}, uint64_t{1}, uint64_t{127}, uint64_t{128}, uint64_t{500},
                       img.size() / 2, img.size() - 1}) {
    WriteFile(path, std::vector<uint8_t>(img.begin(), img.begin() + len));
    auto snap = ReadCheckpointFile(path);
    ASSERT_EQ(snap.status().code(), absl::StatusCode::kDataLoss) << len;
    EXPECT_THAT(snap.status().message(), HasSubstr("truncated")) << snap.status();
    EXPECT_THAT(snap.status().message(), HasSubstr(path));
  }
  auto bad = img;
  bad[bad.size() / 2] ^= 4;
  WriteFile(path, bad);
  auto snap = ReadCheckpointFile(path);
  EXPECT_EQ(snap.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(snap.status().message(), HasSubstr("data checksum mismatch"));
  ReadOptions no_verify;
  no_verify.verify_data = false;
  EXPECT_TRUE(ReadCheckpointFile(path, no_verify).ok());
  EXPECT_EQ(ReadCheckpointFile(dir + "/missing.ballast").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(CkptReader, MissingOrCorruptLatest) {
  const std::string dir = MakeTempDir("latest");
  auto s = ReadLatest(dir, 0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("no complete checkpoint"));
  WriteFile(dir + "/latest", {'x', 'y', '\n'});
  EXPECT_EQ(ReadLatestStep(dir).status().code(), absl::StatusCode::kDataLoss);
  WriteFile(dir + "/latest", {'4', '\n'});
  s = ReadLatest(dir, 0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("rank 0 has no shard"));
}

}  // namespace
}  // namespace ballast::ckpt
