#include "ckpt/slot_store.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>
#include <thread>

#include "ckpt/checkpoint.h"
#include "ckpt/checksum.h"
#include "ckpt/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::ckpt {
namespace {

using ::testing::HasSubstr;
using test_util::State;
using test_util::UniqueShmName;

WriterOptions Opts(int threads, uint64_t threshold = kDefaultParallelCopyThreshold,
                   uint64_t chunk = 4u << 20) {
  WriterOptions o;
  o.copy_threads = threads;
  o.parallel_threshold_bytes = threshold;
  o.chunk_bytes = chunk;
  return o;
}

SlotStoreOptions StoreOpts(int slots, uint64_t initial = 0) {
  SlotStoreOptions o;
  o.num_slots = slots;
  o.initial_slot_bytes = initial;
  return o;
}

// A state whose every byte is derived from `step`, so a restored snapshot can
// be checked against the step it claims to be.
struct StepState {
  std::vector<uint8_t> a, b;
  std::vector<EntryView> views;
  StepState(uint64_t step, uint64_t bytes) : a(bytes), b(1000) {
    Fill(step);
    views = {{"a", DType::kUInt8, {static_cast<int64_t>(bytes)}, a.data(), bytes},
             {"b", DType::kBlob, {}, b.data(), b.size()}};
  }
  void Fill(uint64_t step) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(step * 31 + i);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(step + i * 3);
  }
};

// Checks that a snapshot's bytes are exactly StepState(snap.step()).
void ExpectMatchesStep(const Snapshot& snap, uint64_t bytes) {
  StepState want(snap.step(), bytes);
  ASSERT_EQ(snap.entries().size(), 2u);
  ASSERT_EQ(snap.entries()[0].nbytes, bytes);
  EXPECT_EQ(std::memcmp(snap.EntryData(0), want.a.data(), bytes), 0) << "step " << snap.step();
  EXPECT_EQ(std::memcmp(snap.EntryData(1), want.b.data(), want.b.size()), 0);
}

TEST(CkptSlotStore, SaveThenRestoreRoundTrip) {
  auto store = SlotStore::Create(UniqueShmName("rt"));
  ASSERT_TRUE(store.ok()) << store.status();
  CheckpointWriter writer(store->get(), Opts(1));
  State state;
  state.Add("w", DType::kFloat32, {3, 7}, 1);
  state.Add("extra", DType::kBlob, {}, 55, 2);
  auto stats = writer.Save(10, state.views);
  ASSERT_TRUE(stats.ok()) << stats.status();
  auto snap = RestoreFromShm(store->get());
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 10u);
  const Entry* w = snap->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(std::memcmp(snap->Data(*w), state.buffers[0].data(), 84), 0);
}

TEST(CkptSlotStore, EmptyStoreRestoreIsNotFound) {
  auto store = SlotStore::Create(UniqueShmName("empty"));
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(RestoreFromShm(store->get()).status().code(), absl::StatusCode::kNotFound);
}

TEST(CkptSlotStore, ParallelCopyGivesSameImageAsSingleThreaded) {
  auto s1 = SlotStore::Create(UniqueShmName("p1"));
  auto s4 = SlotStore::Create(UniqueShmName("p4"));
  ASSERT_TRUE(s1.ok() && s4.ok());
  State state;
  state.Add("x", DType::kFloat32, {3, 1000, 1001}, 3);  // ~12 MB, not chunk aligned
  state.Add("y", DType::kInt8, {13}, 4);
  state.Add("z", DType::kBFloat16, {2000, 1500}, 5);
  CheckpointWriter w1(s1->get(), Opts(1));
  CheckpointWriter w4(s4->get(), Opts(4, 1, 1 << 20));
  auto r1 = w1.Save(1, state.views);
  auto r4 = w4.Save(1, state.views);
  ASSERT_TRUE(r1.ok() && r4.ok());
  EXPECT_EQ(r1->data_checksum, r4->data_checksum);
  // The same writer told to copy on the calling thread alone (an overlapped
  // save's first choice) writes the same image.
  auto s4one = SlotStore::Create(UniqueShmName("p4one"));
  ASSERT_TRUE(s4one.ok());
  CheckpointWriter w4one(s4one->get(), Opts(4, 1, 1 << 20));
  auto r4one = w4one.Save(1, state.views, /*parallel=*/false);
  ASSERT_TRUE(r4one.ok()) << r4one.status();
  EXPECT_EQ(r1->data_checksum, r4one->data_checksum);
  auto one = RestoreFromShm(s4one->get(), RestoreOptions{});
  ASSERT_TRUE(one.ok()) << one.status();
  for (size_t i = 0; i < state.views.size(); ++i) {
    EXPECT_EQ(std::memcmp(one->EntryData(i), state.buffers[i].data(), state.views[i].nbytes), 0);
  }
  CopyPool pool(3);
  RestoreOptions ro;
  ro.pool = &pool;
  auto snap = RestoreFromShm(s4->get(), ro);
  ASSERT_TRUE(snap.ok()) << snap.status();
  for (size_t i = 0; i < state.views.size(); ++i) {
    EXPECT_EQ(std::memcmp(snap->EntryData(i), state.buffers[i].data(), state.views[i].nbytes), 0);
  }
}

TEST(CkptSlotStore, WorkerGrowsSlotAndAgentRemaps) {
  auto agent = SlotStore::Create(UniqueShmName("grow"), StoreOpts(2, 4096));
  ASSERT_TRUE(agent.ok());
  auto worker = SlotStore::Open((*agent)->name());
  ASSERT_TRUE(worker.ok()) << worker.status();
  CheckpointWriter writer(worker->get(), Opts(2));
  for (uint64_t step : {1, 2, 3}) {
    StepState st(step, step * 3'000'000);
    ASSERT_TRUE(writer.Save(step, st.views).ok());
    auto snap = RestoreFromShm(agent->get());
    ASSERT_TRUE(snap.ok()) << snap.status();
    EXPECT_EQ(snap->step(), step);
    ExpectMatchesStep(*snap, step * 3'000'000);
  }
}

// Bytes of memory the shm object `name` holds (its pages that were faulted in).
uint64_t AllocatedBytes(const std::string& name) {
  struct stat st {};
  if (stat(("/dev/shm" + name).c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

bool WaitGrown(SlotStore* store) {
  for (int i = 0; i < 2000 && store->growing(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return !store->growing();
}

// Bytes of the mapping that contains `addr` that are mapped in this process's
// page tables (Rss in /proc/self/smaps); -1 if no mapping contains it.
int64_t MappedBytesAt(const void* addr) {
  std::FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return -1;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  char line[512];
  bool in = false;
  int64_t rss = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo = 0, hi = 0;  // NOLINT(runtime/int): sscanf's %lx
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {  // a mapping's first line; its fields follow
      in = a >= lo && a < hi;
      continue;
    }
    long kb = 0;  // NOLINT(runtime/int)
    if (in && std::sscanf(line, "Rss: %ld kB", &kb) == 1) {
      rss = static_cast<int64_t>(kb) * 1024;
      break;
    }
  }
  std::fclose(f);
  return rss;
}

TEST(CkptSlotStore, OpenWithPrefaultMapsTheSlotsPagesAndTheImageReadsBackWhole) {
  auto agent = SlotStore::Create(UniqueShmName("openfault"), StoreOpts(3, 4096));
  ASSERT_TRUE(agent.ok());
  constexpr uint64_t kBytes = 24u << 20;
  {
    // A worker saved a step before it died: its slot holds 24 MiB.
    auto first = SlotStore::Open((*agent)->name());
    ASSERT_TRUE(first.ok()) << first.status();
    CheckpointWriter writer(first->get(), Opts(3));
    StepState st(7, kBytes);
    ASSERT_TRUE(writer.Save(7, st.views).ok());
  }
  // Without prefault nothing is mapped until it is read.
  auto lazy = SlotStore::Open((*agent)->name(), /*prefault=*/false);
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  auto lazy_pin = (*lazy)->PinLatest();
  ASSERT_TRUE(lazy_pin.ok()) << lazy_pin.status();
  ASSERT_GE(lazy_pin->image_bytes(), kBytes);
  EXPECT_LT(MappedBytesAt(lazy_pin->image()), int64_t{1} << 20);
  lazy_pin->Release();
  // The restarted worker's Open: the same slot is mapped once the background
  // faulting is done, and the image reads back whole.
  auto worker = SlotStore::Open((*agent)->name());
  ASSERT_TRUE(worker.ok()) << worker.status();
  (*worker)->WaitPrefaulted();
  auto pin = (*worker)->PinLatest();
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->step(), 7u);
  EXPECT_GE(MappedBytesAt(pin->image()), static_cast<int64_t>(kBytes));
  pin->Release();
  auto snap = RestoreFromShm(worker->get());
  ASSERT_TRUE(snap.ok()) << snap.status();
  ExpectMatchesStep(*snap, kBytes);
  // A store closed while it faults stops the thread between chunks.
  auto closing = SlotStore::Open((*agent)->name());
  ASSERT_TRUE(closing.ok());
  closing->reset();
  // A process forked meanwhile (a DataLoader worker) closes its copy of the
  // store without joining a thread it does not have.
  auto forking = SlotStore::Open((*agent)->name());
  ASSERT_TRUE(forking.ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    forking->reset();
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

TEST(CkptSlotStore, ReserveSizesAndFaultsTheSlotTheFirstSaveTakesSoThatSaveOnlyCopies) {
  auto agent = SlotStore::Create(UniqueShmName("reserve"), StoreOpts(3, 4096));
  ASSERT_TRUE(agent.ok());
  auto worker = SlotStore::Open((*agent)->name());
  ASSERT_TRUE(worker.ok()) << worker.status();
  constexpr uint64_t kBytes = 9'000'000;
  StepState st(7, kBytes);
  CheckpointWriter writer(worker->get(), Opts(2));
  auto planned = writer.Reserve(st.views);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_GT(*planned, kBytes);
  ASSERT_TRUE(WaitGrown(worker->get()));
  std::vector<SlotInfo> info = (*worker)->Inspect();  // the agent's mappings are stale until it refreshes
  ASSERT_EQ(info.size(), 3u);
  EXPECT_GE(info[0].capacity, *planned);
  // Faulted, not only sized: tmpfs holds the pages.
  EXPECT_GE(AllocatedBytes(SlotStore::SlotName((*agent)->name(), 0)), *planned);
  EXPECT_LT(info[1].capacity, kBytes) << "the first save grows the others";
  // Nothing left to do: a second call starts nothing.
  EXPECT_FALSE((*worker)->Reserve(*planned, 1));
  // The first save goes to the reserved slot without growing it, then grows
  // the slot the next save takes.
  auto stats = writer.Save(7, st.views);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->slot, 0);
  ASSERT_TRUE(WaitGrown(worker->get()));
  info = (*worker)->Inspect();
  EXPECT_GE(info[1].capacity, kBytes);
  EXPECT_LT(info[2].capacity, kBytes) << "a blocking writer uses two slots; the third stays small";
  auto snap = RestoreFromShm(agent->get());
  ASSERT_TRUE(snap.ok()) << snap.status();
  ExpectMatchesStep(*snap, kBytes);
}

TEST(CkptSlotStore, AFirstSaveGrowsTheOtherSlotOnlyAfterItsCopyAndEveryGrownSlotHoldsWhatWasSaved) {
  auto agent = SlotStore::Create(UniqueShmName("grow-after"), StoreOpts(2, 4096));
  ASSERT_TRUE(agent.ok());
  auto worker = SlotStore::Open((*agent)->name());
  ASSERT_TRUE(worker.ok()) << worker.status();
  constexpr uint64_t kBytes = 12'000'000;
  WriterOptions opts = Opts(2);
  // While the first save copies into the slot it grew, the other slot is not
  // grown yet: the growth would compete with the copy for the CPUs.
  std::atomic<int> checked{0};
  opts.before_commit_for_test = [&] {
    if (checked.exchange(1) != 0) return;
    EXPECT_FALSE((*worker)->growing());
    std::vector<SlotInfo> info = (*worker)->Inspect();
    EXPECT_LT(std::min(info[0].capacity, info[1].capacity), kBytes);
  };
  CheckpointWriter writer(worker->get(), opts);
  for (uint64_t step : {1, 2, 3}) {
    StepState st(step, kBytes);
    auto stats = writer.Save(step, st.views);
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (step == 1) {
      // Committed: now the other slot grows (allocated and faulted) in the background.
      ASSERT_TRUE(WaitGrown(worker->get()));
      for (const SlotInfo& info : (*worker)->Inspect()) {
        EXPECT_GE(info.capacity, kBytes) << "slot " << info.slot;
        EXPECT_GE(AllocatedBytes(SlotStore::SlotName((*agent)->name(), info.slot)), kBytes) << "slot " << info.slot;
      }
    }
    // Each grown slot (the one the first save grew, the one grown behind it)
    // holds exactly the saved bytes, read through the agent's own mapping.
    auto snap = RestoreFromShm(agent->get());
    ASSERT_TRUE(snap.ok()) << snap.status();
    EXPECT_EQ(snap->step(), step);
    ExpectMatchesStep(*snap, kBytes);
  }
  EXPECT_EQ(checked.load(), 1);
}

TEST(CkptShmSegment, GrowingWithPrefaultAllocatesTheNewPagesKeepsTheOldBytesAndZeroesTheRest) {
  // Big enough (>= 64 MiB) for the parallel path: one thread fallocates
  // while the others populate behind it.
  const std::string name = UniqueShmName("seg-grow");
  auto seg = ShmSegment::Create(name, 0, true);
  ASSERT_TRUE(seg.ok()) << seg.status();
  constexpr uint64_t kOld = 3u << 20, kNew = 80u << 20;
  ASSERT_TRUE((*seg)->EnsureCapacity(kOld, /*prefault=*/true).ok());
  for (uint64_t i = 0; i < kOld; ++i) (*seg)->data()[i] = static_cast<uint8_t>(i * 13 + 1);
  absl::Status grown = (*seg)->EnsureCapacity(kNew, /*prefault=*/true);
  ASSERT_TRUE(grown.ok()) << grown;
  ASSERT_EQ((*seg)->size(), kNew);
  EXPECT_GE(AllocatedBytes(name), kNew);
  const uint8_t* d = (*seg)->data();
  uint64_t bad = 0;
  for (uint64_t i = 0; i < kOld; ++i) bad += d[i] != static_cast<uint8_t>(i * 13 + 1);
  for (uint64_t i = kOld; i < kNew; ++i) bad += d[i] != 0;
  EXPECT_EQ(bad, 0u);
  // Another process's view (Open + Refresh) sees the same bytes.
  auto other = ShmSegment::Open(name);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(std::memcmp((*other)->data(), d, kNew), 0);
}

TEST(CkptSlotStore, AFirstSaveBigEnoughForParallelGrowthHoldsExactlyWhatWasSaved) {
  auto store = SlotStore::Create(UniqueShmName("grow-big"), StoreOpts(2, 4096));
  ASSERT_TRUE(store.ok());
  constexpr uint64_t kBytes = 70u << 20;
  CheckpointWriter writer(store->get(), Opts(2));
  for (uint64_t step : {1, 2}) {
    StepState st(step, kBytes);
    auto stats = writer.Save(step, st.views);
    ASSERT_TRUE(stats.ok()) << stats.status();
    auto snap = RestoreFromShm(store->get());
    ASSERT_TRUE(snap.ok()) << snap.status();
    ExpectMatchesStep(*snap, kBytes);
  }
  ASSERT_TRUE(WaitGrown(store->get()));
}

TEST(CkptSlotStore, AnAbortedSaveStillGrowsTheOtherSlot) {
  auto store = SlotStore::Create(UniqueShmName("grow-abort"), StoreOpts(2, 4096));
  ASSERT_TRUE(store.ok());
  constexpr uint64_t kBytes = 6'000'000;
  auto w = (*store)->BeginSave(1, kBytes);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE((*store)->growing());
  (*store)->Abort(&*w);
  ASSERT_TRUE(WaitGrown(store->get()));
  for (const SlotInfo& info : (*store)->Inspect()) EXPECT_GE(info.capacity, kBytes) << "slot " << info.slot;
}

TEST(CkptSlotStore, ASaveRightAfterReserveWaitsForItsSlotAndIsWhole) {
  auto store = SlotStore::Create(UniqueShmName("reserve-race"), StoreOpts(2, 4096));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(2));
  for (uint64_t step : {1, 2, 3}) {
    StepState st(step, 20'000'000 * step);
    ASSERT_TRUE(writer.Reserve(st.views).ok());
    ASSERT_TRUE(writer.Save(step, st.views).ok());  // while the slots grow
    auto snap = RestoreFromShm(store->get());
    ASSERT_TRUE(snap.ok()) << snap.status();
    ExpectMatchesStep(*snap, 20'000'000 * step);
  }
  ASSERT_TRUE(WaitGrown(store->get()));
}

TEST(CkptSlotStore, ReserveRejectsBadEntriesAndDoesNothingWithoutPrefault) {
  auto store = SlotStore::Create(UniqueShmName("reserve-bad"));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(1));
  std::vector<EntryView> bad = {{"w", DType::kFloat32, {4}, nullptr, 15}};
  EXPECT_EQ(writer.Reserve(bad).status().code(), absl::StatusCode::kInvalidArgument);
  SlotStoreOptions no_prefault = StoreOpts(2);
  no_prefault.prefault = false;
  auto lazy = SlotStore::Create(UniqueShmName("reserve-lazy"), no_prefault);
  ASSERT_TRUE(lazy.ok());
  EXPECT_FALSE((*lazy)->Reserve(1 << 20, 2));
}

TEST(CkptSlotStore, AlternatesSlotsAndNeverOverwritesNewestCommitted) {
  auto store = SlotStore::Create(UniqueShmName("alt"));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(1));
  StepState st(0, 100);
  int prev_slot = -1;
  for (uint64_t step = 1; step <= 6; ++step) {
    st.Fill(step);
    auto r = writer.Save(step, st.views);
    ASSERT_TRUE(r.ok());
    EXPECT_NE(r->slot, prev_slot) << "step " << step << " overwrote the newest committed slot";
    prev_slot = r->slot;
  }
  // A save that is begun but not committed leaves the newest step readable.
  auto w = (*store)->BeginSave(7, 1000);
  ASSERT_TRUE(w.ok());
  EXPECT_NE(w->slot(), prev_slot);
  std::memset(w->image(), 0xAB, 1000);
  auto snap = RestoreFromShm(store->get());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->step(), 6u);
  ExpectMatchesStep(*snap, 100);
}

TEST(CkptSlotStore, DiscardFromDropsNewerStepsAndClampsThePersistChannel) {
  auto store = SlotStore::Create(UniqueShmName("discard"), StoreOpts(3));
  ASSERT_TRUE(store.ok());
  {
    // A blocking saver keeps the newest step and the one before it.
    CheckpointWriter writer(store->get(), Opts(1));
    StepState st(0, 100);
    for (uint64_t step = 4; step <= 6; ++step) {
      st.Fill(step);
      ASSERT_TRUE(writer.Save(step, st.views).ok());
    }
    (*store)->RequestPersist(6);
    (*store)->MarkDurable(6);
    (*store)->MarkCommitted(5);
    (*store)->ReleaseWriter();
  }
  auto agent = SlotStore::Open((*store)->name());
  ASSERT_TRUE(agent.ok());
  auto n = (*agent)->DiscardFrom(6);  // step 6 went bad
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 1);
  auto snap = RestoreFromShm(agent->get());
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 5u);
  ExpectMatchesStep(*snap, 100);
  EXPECT_EQ((*store)->requested_persist_step(), 5u);
  EXPECT_EQ((*store)->durable_step(), 5u);
  EXPECT_EQ((*store)->committed_step(), 5u);
  // The next worker writes again; step 6 of the new history is the newest.
  CheckpointWriter writer(store->get(), Opts(1));
  StepState st(6, 100);
  ASSERT_TRUE(writer.Save(6, st.views).ok());
  snap = RestoreFromShm(store->get());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->step(), 6u);
  ExpectMatchesStep(*snap, 100);
}

TEST(CkptSlotStore, SaveWhilePersistingGoesToTheOtherSlot) {
  auto store = SlotStore::Create(UniqueShmName("pin"));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(1));
  StepState st(1, 5000);
  ASSERT_TRUE(writer.Save(1, st.views).ok());
  // The persister pins step 1.
  auto pin = (*store)->PinLatest();
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(pin->step(), 1u);
  for (uint64_t step = 2; step <= 5; ++step) {
    st.Fill(step);
    auto r = writer.Save(step, st.views);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NE(r->slot, pin->slot()) << "a save wrote into the slot being persisted";
  }
  // The pinned slot still holds step 1, intact.
  auto parsed = ParseImage(pin->image(), pin->image_bytes(), "pinned");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->header.step, 1u);
  pin->Release();
  auto snap = RestoreFromShm(store->get());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->step(), 5u);
}

TEST(CkptSlotStore, ThreeSlotsKeepNewestWhileOlderIsPersisted) {
  auto store = SlotStore::Create(UniqueShmName("three"), StoreOpts(3));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(1));
  StepState st(1, 100);
  ASSERT_TRUE(writer.Save(1, st.views).ok());
  auto pin = (*store)->PinLatest();
  ASSERT_TRUE(pin.ok());
  int last_slot = -1;
  for (uint64_t step = 2; step <= 6; ++step) {
    st.Fill(step);
    auto r = writer.Save(step, st.views);
    ASSERT_TRUE(r.ok());
    EXPECT_NE(r->slot, pin->slot());
    EXPECT_NE(r->slot, last_slot);  // newest committed never overwritten
    last_slot = r->slot;
  }
}

TEST(CkptSlotStore, AStepAskedToPersistSurvivesNewerSavesWhileASlowPersisterWritesAnOlderOne) {
  // A slow disk: the persister still writes step 3 (its slot pinned) when
  // the worker asks for step 4 and saves 5, 6 and 7. Step 4 must still be
  // there when the persister gets to it; the newest step is kept as well
  // while a slot is free, and overwritten before the request when none is.
  auto store = SlotStore::Create(UniqueShmName("pending"), StoreOpts(3));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(1));
  StepState st(1, 100);
  for (uint64_t step = 3; step <= 4; ++step) {
    st.Fill(step);
    ASSERT_TRUE(writer.Save(step, st.views).ok());
  }
  auto writing = (*store)->PinStep(3);
  ASSERT_TRUE(writing.ok());
  (*store)->RequestPersist(4);
  for (uint64_t step = 5; step <= 7; ++step) {
    st.Fill(step);
    ASSERT_TRUE(writer.Save(step, st.views).ok());
    auto held = (*store)->PinStep(4);
    ASSERT_TRUE(held.ok()) << "step " << step << " overwrote the requested step 4: " << held.status();
  }
  auto newest = (*store)->PinLatest();
  ASSERT_TRUE(newest.ok());
  EXPECT_EQ(newest->step(), 7u);
  // Once durable it is an ordinary older step again.
  writing->Release();
  (*store)->MarkDurable(4);
  for (uint64_t step = 8; step <= 9; ++step) {
    st.Fill(step);
    ASSERT_TRUE(writer.Save(step, st.views).ok());
  }
  EXPECT_FALSE((*store)->PinStep(4).ok());
}

// The steps a store holds committed, oldest first.
std::vector<uint64_t> CommittedSteps(SlotStore* s) {
  std::vector<uint64_t> steps;
  for (const SlotInfo& info : s->Inspect()) {
    if (info.state == SlotState::kCommitted) steps.push_back(info.step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

TEST(CkptSlotStore, ABlockingSaverUsesTwoOfThreeSlotsAndAnOverlappedOneKeepsTwoSteps) {
  auto store = SlotStore::Create(UniqueShmName("keep"), StoreOpts(3));
  ASSERT_TRUE(store.ok());
  StepState st(1, 4096);
  {
    CheckpointWriter writer(store->get(), Opts(1));
    for (uint64_t step = 1; step <= 5; ++step) {
      st.Fill(step);
      ASSERT_TRUE(writer.Save(step, st.views).ok());
    }
  }
  EXPECT_EQ(CommittedSteps(store->get()), (std::vector<uint64_t>{4, 5}));
  int unsized = 0;
  for (const SlotInfo& info : (*store)->Inspect()) unsized += info.capacity == 0 ? 1 : 0;
  EXPECT_EQ(unsized, 1);  // the third slot costs no memory
  WriterOptions bg = Opts(1);
  bg.background = true;
  CheckpointWriter overlapped(store->get(), bg);
  for (uint64_t step = 6; step <= 9; ++step) {
    st.Fill(step);
    ASSERT_TRUE(overlapped.Save(step, st.views).ok());
    // The two newest before this save survive it.
    EXPECT_EQ(CommittedSteps(store->get()), (std::vector<uint64_t>{step - 2, step - 1, step}));
  }
}

TEST(CkptSlotStore, TheStepsAskedToReplicateAndTheLastTwoReplicatedOnesOutliveNewerSaves) {
  // An overlapped saver (keep_newest 2) on an agent's four slots with peer
  // replicas: the step asked for is kept until the sender says every holder
  // took it, then the last two replicated steps are kept over the step
  // before the newest; the writer never fails for them, and a rollback
  // forgets them.
  auto store = SlotStore::Create(UniqueShmName("replkeep"), StoreOpts(4));
  ASSERT_TRUE(store.ok());
  SlotStore* s = store->get();
  WriterOptions bg = Opts(1);
  bg.background = true;
  CheckpointWriter writer(s, bg);
  StepState st(1, 100);
  auto save = [&](uint64_t step) {
    st.Fill(step);
    ASSERT_TRUE(writer.Save(step, st.views).ok()) << "step " << step;
  };
  save(1);
  s->RequestReplica(1);
  EXPECT_EQ(s->requested_replica_step(), 1u);
  for (uint64_t step = 2; step <= 6; ++step) {
    save(step);
    EXPECT_TRUE(s->PinStep(1).ok()) << "save " << step << " overwrote the requested step 1";
  }
  s->MarkReplicated(1, 0.25);
  EXPECT_EQ(s->replicated_step(), 1u);
  EXPECT_DOUBLE_EQ(s->replica_put_s(), 0.25);
  save(7);
  save(8);
  EXPECT_EQ(CommittedSteps(s), (std::vector<uint64_t>{1, 6, 7, 8}));
  // Step 8 asked for and replicated: 1 and 8 are the last two now, kept over
  // the step before the newest.
  s->RequestReplica(8);
  s->MarkReplicated(8);
  EXPECT_DOUBLE_EQ(s->replica_put_s(), 0.25) << "an unmeasured copy keeps the last time";
  save(9);
  EXPECT_EQ(CommittedSteps(s), (std::vector<uint64_t>{1, 7, 8, 9}));
  for (uint64_t step = 10; step <= 12; ++step) {
    save(step);
    EXPECT_EQ(CommittedSteps(s), (std::vector<uint64_t>{1, 8, step - 1, step}));
  }
  // Every slot but one pinned by readers: the writer overwrites a kept step
  // (the older replicated one first) rather than fail.
  auto p11 = s->PinStep(11);
  auto p12 = s->PinStep(12);
  ASSERT_TRUE(p11.ok() && p12.ok());
  save(13);
  EXPECT_EQ(CommittedSteps(s), (std::vector<uint64_t>{8, 11, 12, 13}));
  auto p13 = s->PinStep(13);
  save(14);
  EXPECT_EQ(CommittedSteps(s), (std::vector<uint64_t>{11, 12, 13, 14}));
  p11->Release();
  p12->Release();
  p13->Release();
  // A rollback to before step 8 forgets the request and the replicated steps.
  ASSERT_TRUE(s->DiscardFrom(8).ok());
  EXPECT_EQ(s->requested_replica_step(), 0u);
  EXPECT_EQ(s->replicated_step(), 0u);
}

TEST(CkptSlotStore, AllSlotsPinnedMakesSaveUnavailable) {
  auto store = SlotStore::Create(UniqueShmName("full"));
  ASSERT_TRUE(store.ok());
  CheckpointWriter writer(store->get(), Opts(1));
  StepState st(1, 100);
  ASSERT_TRUE(writer.Save(1, st.views).ok());
  auto p1 = (*store)->PinLatest();
  ASSERT_TRUE(writer.Save(2, st.views).ok());
  auto p2 = (*store)->PinLatest();
  ASSERT_TRUE(p1.ok() && p2.ok());
  auto r = writer.Save(3, st.views);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("pinned"));
}

TEST(CkptSlotStore, SecondLiveWriterIsRefused) {
  auto store = SlotStore::Create(UniqueShmName("writer"));
  ASSERT_TRUE(store.ok());
  auto w = (*store)->BeginSave(1, 100);
  ASSERT_TRUE(w.ok());
  pid_t child = fork();
  if (child == 0) {
    auto other = SlotStore::Open((*store)->name());
    if (!other.ok()) _exit(2);
    auto s = (*other)->BeginSave(2, 100);
    _exit(s.status().code() == absl::StatusCode::kFailedPrecondition ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// Crash injection: a writer process is SIGKILLed after writing half of a new
// step into shared memory; the reader must get the previous complete step.
TEST(CkptSlotStoreCrash, WriterKilledMidSaveLeavesPreviousStep) {
  constexpr uint64_t kBytes = 8 << 20;
  auto agent = SlotStore::Create(UniqueShmName("kill"));
  ASSERT_TRUE(agent.ok());
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t child = fork();
  if (child == 0) {
    close(fds[0]);
    auto worker = SlotStore::Open((*agent)->name());
    if (!worker.ok()) _exit(2);
    CheckpointWriter writer(worker->get(), Opts(2));
    StepState st(1, kBytes);
    if (!writer.Save(1, st.views).ok()) _exit(3);
    // Step 2: begin, write half of the image, then tell the parent.
    auto w = (*worker)->BeginSave(2, kBytes * 2);
    if (!w.ok()) _exit(4);
    std::memset(w->image(), 0x5A, kBytes);
    char c = 'x';
    if (write(fds[1], &c, 1) != 1) _exit(5);
    pause();
    _exit(6);
  }
  ASSERT_TRUE(test_util::KillChildWhenReady(child, fds[0], fds[1]));

  auto snap = RestoreFromShm(agent->get());
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 1u);
  ExpectMatchesStep(*snap, kBytes);
  snap = absl::NotFoundError("release the pin");

  // A restarted writer takes over from the dead one and reuses the torn slot.
  CheckpointWriter writer(agent->get(), Opts(2));
  StepState st(3, kBytes);
  ASSERT_TRUE(writer.Save(3, st.views).ok());
  snap = RestoreFromShm(agent->get());
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->step(), 3u);
  ExpectMatchesStep(*snap, kBytes);
}

// A writer saving continuously is SIGKILLed at arbitrary moments; every time,
// the restore yields a complete, checksum-valid step that matches its bytes.
TEST(CkptSlotStoreCrash, RandomKillsNeverExposeATornStep) {
  constexpr uint64_t kBytes = 6 << 20;
  auto agent = SlotStore::Create(UniqueShmName("rkill"));
  ASSERT_TRUE(agent.ok());
  uint64_t last_seen = 0;
  for (int round = 0; round < 12; ++round) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t child = fork();
    if (child == 0) {
      close(fds[0]);
      auto worker = SlotStore::Open((*agent)->name());
      if (!worker.ok()) _exit(2);
      CheckpointWriter writer(worker->get(), Opts(2, 1));
      StepState st(0, kBytes);
      for (uint64_t step = 1000 * (round + 1);; ++step) {
        st.Fill(step);
        if (!writer.Save(step, st.views).ok()) _exit(3);
        if (step == 1000u * (round + 1)) {
          char c = 'x';
          if (write(fds[1], &c, 1) != 1) _exit(5);
        }
      }
    }
    // Land somewhere in a later save.
    ASSERT_TRUE(test_util::KillChildWhenReady(child, fds[0], fds[1], 1000 + round * 2777))
        << "child exited before the kill";
    auto snap = RestoreFromShm(agent->get());
    ASSERT_TRUE(snap.ok()) << snap.status();
    EXPECT_GE(snap->step(), 1000u * (round + 1));
    EXPECT_GT(snap->step(), last_seen);
    last_seen = snap->step();
    ExpectMatchesStep(*snap, kBytes);
  }
}

// Readers pin and verify while a writer saves as fast as it can.
TEST(CkptSlotStore, ConcurrentReadersOnlySeeCommittedSteps) {
  constexpr uint64_t kBytes = 1 << 20;
  auto store = SlotStore::Create(UniqueShmName("conc"), StoreOpts(3));
  ASSERT_TRUE(store.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0};
  std::thread writer_thread([&] {
    CheckpointWriter writer(store->get(), Opts(1));
    StepState st(0, kBytes);
    for (uint64_t step = 1; !stop.load(); ++step) {
      st.Fill(step);
      auto r = writer.Save(step, st.views);
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
      }
    }
  });
  auto reader = [&] {
    while (reads.load() < 300) {
      auto snap = RestoreFromShm(store->get());
      if (!snap.ok()) {
        ASSERT_EQ(snap.status().code(), absl::StatusCode::kNotFound) << snap.status();
        continue;
      }
      ExpectMatchesStep(*snap, kBytes);
      reads.fetch_add(1);
    }
  };
  std::thread r1(reader), r2(reader);
  r1.join();
  r2.join();
  stop = true;
  writer_thread.join();
}

}  // namespace
}  // namespace ballast::ckpt

namespace ballast::ckpt {
namespace {

TEST(CkptPersistChannel, ConfigRoundTripsAcrossOpenAndStepsAreMonotonic) {
  std::string name = "/ballast-test-chan-" + std::to_string(getpid());
  auto owner = SlotStore::Create(name);
  ASSERT_TRUE(owner.ok()) << owner.status();
  auto worker = SlotStore::Open(name);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_FALSE((*owner)->GetPersistConfig().has_value());
  ASSERT_TRUE((*worker)->SetPersistConfig({"/tmp/ckpt-dir", 3, 4, 2}).ok());
  auto cfg = (*owner)->GetPersistConfig();
  ASSERT_TRUE(cfg.has_value());
  EXPECT_EQ(cfg->dir, "/tmp/ckpt-dir");
  EXPECT_EQ(cfg->rank, 3);
  EXPECT_EQ(cfg->world_size, 4);
  EXPECT_EQ(cfg->keep_last, 2);
  (*worker)->RequestPersist(7);
  (*worker)->RequestPersist(5);  // older: ignored
  EXPECT_EQ((*owner)->requested_persist_step(), 7u);
  (*owner)->MarkDurable(7, 0.25);
  (*owner)->MarkDurable(6, 9.0);  // older: neither the step nor its write time
  (*owner)->MarkCommitted(6);
  EXPECT_EQ((*worker)->durable_step(), 7u);
  EXPECT_DOUBLE_EQ((*worker)->durable_write_s(), 0.25);
  EXPECT_EQ((*worker)->committed_step(), 6u);
}

TEST(CkptPersistChannel, RejectsBadConfig) {
  std::string name = "/ballast-test-chan-bad-" + std::to_string(getpid());
  auto owner = SlotStore::Create(name);
  ASSERT_TRUE(owner.ok());
  EXPECT_EQ((*owner)->SetPersistConfig({"", 0, 1, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*owner)->SetPersistConfig({"/d", 2, 2, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*owner)->SetPersistConfig({"/d", 0, 1, 0}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ballast::ckpt

namespace ballast::ckpt {
namespace {

TEST(CkptPersistChannel, PersistErrorIsSeenByTheOtherSide) {
  std::string name = "/ballast-test-chan-err-" + std::to_string(getpid());
  auto owner = SlotStore::Create(name);
  ASSERT_TRUE(owner.ok());
  auto worker = SlotStore::Open(name);
  ASSERT_TRUE(worker.ok());
  EXPECT_FALSE((*worker)->GetPersistError().has_value());
  (*owner)->ReportPersistError(5, "disk full");
  auto err = (*worker)->GetPersistError();
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->step, 5u);
  EXPECT_EQ(err->message, "disk full");
  (*owner)->ReportPersistError(6, std::string(2000, 'x'));  // truncated, not overflowing
  EXPECT_EQ((*worker)->GetPersistError()->message.size(), SlotStore::kMaxPersistErrorBytes - 1);
}

TEST(CopyOutAndChecksum, CopiesTheExtractsAndChecksumsTheWholeRegionLikeOnePass) {
  // 24 MiB of data: parallel, several windows per chunk, extracts crossing chunk edges.
  const uint64_t n = 24u << 20;
  std::vector<uint8_t> data(n);
  for (uint64_t i = 0; i < n; ++i) data[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  std::vector<uint8_t> a(5u << 20), b(100), c(9u << 20);
  std::vector<Extract> extracts = {{64, a.size(), a.data()}, {(8u << 20) - 10, b.size(), b.data()},
                                   {(12u << 20) + 3, c.size(), c.data()}};
  CopyPool pool(3);
  const uint64_t want = ChecksumBytes(data.data(), n);
  EXPECT_EQ(CopyOutAndChecksum(data.data(), n, extracts, &pool), want);
  EXPECT_EQ(0, std::memcmp(a.data(), data.data() + 64, a.size()));
  EXPECT_EQ(0, std::memcmp(b.data(), data.data() + (8u << 20) - 10, b.size()));
  EXPECT_EQ(0, std::memcmp(c.data(), data.data() + (12u << 20) + 3, c.size()));
  // The calling thread alone gives the same.
  std::vector<uint8_t> a2(a.size());
  EXPECT_EQ(CopyOutAndChecksum(data.data(), n, {{64, a2.size(), a2.data()}}, nullptr), want);
  EXPECT_EQ(a2, a);
  // A flipped byte anywhere (copied or not) changes the digest.
  data[n - 7] ^= 1;
  EXPECT_NE(CopyOutAndChecksum(data.data(), n, extracts, &pool), want);
}

}  // namespace
}  // namespace ballast::ckpt
