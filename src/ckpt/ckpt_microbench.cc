// Microbenchmark: blocking time of a flash-checkpoint save vs its floor, a
// plain memcpy of the same bytes into pre-faulted shared memory.
//   ./bin/ckpt_microbench --benchmark_filter=.   (BALLAST_CKPT_COPY_THREADS unused here)
// Args: {bytes, threads}. Target: Save within 1.2x of Memcpy at equal threads.
// BM_FirstWrite: a job's first save, which also creates its memory: ways to
// fault a fresh tmpfs object while copying into it (see FirstWriteMode).
//   ./bin/ckpt_microbench --benchmark_filter=FirstWrite
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "ckpt/checksum.h"
#include "ckpt/copy_pool.h"
#include "ckpt/shm_segment.h"
#include "ckpt/slot_store.h"

namespace ballast::ckpt {
namespace {

constexpr int kTensors = 32;

std::vector<uint8_t>& Source(uint64_t bytes) {
  static std::vector<uint8_t> src;
  if (src.size() != bytes) {
    src.assign(bytes, 0);
    for (uint64_t i = 0; i < bytes; i += 4096) src[i] = static_cast<uint8_t>(i >> 12);
  }
  return src;
}

std::string Name(const char* tag) { return absl::StrCat("/ballast-bench-", tag, "-", getpid()); }

void BM_MemcpyToShm(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  auto& src = Source(bytes);
  auto seg = *ShmSegment::Create(Name("memcpy"), bytes, true);
  if (!seg->Prefault(0, bytes).ok()) state.SkipWithError("prefault failed");
  CopyPool pool(threads);
  for (auto _ : state) {
    ParallelMemcpy(seg->data(), src.data(), bytes, &pool);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void BM_Save(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  auto& src = Source(bytes);
  std::vector<EntryView> views;
  const uint64_t per = bytes / kTensors;
  for (int i = 0; i < kTensors; ++i) {
    views.push_back({absl::StrCat("layer.", i, ".weight"), DType::kFloat32,
                     {static_cast<int64_t>(per / 4)}, src.data() + i * per, per / 4 * 4});
  }
  auto store = *SlotStore::Create(Name("save"));
  WriterOptions options;
  options.copy_threads = threads;
  CheckpointWriter writer(store.get(), options);
  // Grow and prefault both slots outside the timed loop (the agent does this
  // once; later saves of the same size reuse them).
  for (int i = 0; i < 2; ++i) {
    if (!writer.Save(i, views).ok()) state.SkipWithError("warm-up save failed");
  }
  uint64_t step = 2;
  for (auto _ : state) {
    auto r = writer.Save(step++, views);
    if (!r.ok()) state.SkipWithError(std::string(r.status().message()).c_str());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// How BM_FirstWrite sizes and faults a fresh object before or while copying
// `bytes` into it with `threads` threads (each copies its own range).
enum FirstWriteMode : int64_t {
  kTouch = 0,           // ftruncate; the copy's stores fault each page
  kPopulate = 1,        // ftruncate; MADV_POPULATE_WRITE over all threads; copy
  kFallocTouch = 2,     // ftruncate + fallocate; the copy faults (pages exist)
  kFallocPopulate = 3,  // ftruncate + fallocate; MADV_POPULATE_WRITE; copy
  kMapPopulate = 4,     // ftruncate; mmap(MAP_POPULATE); copy
  kFallocPopRead = 5,   // ftruncate + fallocate; MADV_POPULATE_READ (fault-around); copy
  kFused = 6,           // ftruncate; each thread populates then copies 2 MiB windows of its range
  kFallocFused = 7,     // ftruncate + fallocate; then as kFused
  kHugeAdvise = 8,      // ftruncate; MADV_HUGEPAGE; MADV_POPULATE_WRITE; copy (THP for shmem)
  kSlotStore = 9,       // today's product path: ShmSegment::EnsureCapacity(prefault) + ParallelMemcpy
  kPrefaulted = 10,     // the floor: copy into an object populated outside the timing
};

template <typename Fn>
void OnThreads(int threads, const Fn& fn) {
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(fn, i);
  fn(0);
  for (std::thread& t : pool) t.join();
}

// Args: {bytes, threads, mode}. Each iteration creates a fresh object, so
// pages come from the allocator as at a job's first save.
void BM_FirstWrite(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const auto mode = static_cast<FirstWriteMode>(state.range(2));
  auto& src = Source(bytes);
  const uint64_t per = (bytes / static_cast<uint64_t>(threads) + 4095) / 4096 * 4096;
  auto range = [&](int i) {
    const uint64_t lo = std::min(bytes, static_cast<uint64_t>(i) * per);
    return std::make_pair(lo, std::min(bytes, lo + per));
  };
  const std::string name = Name("first");
  for (auto _ : state) {
    state.PauseTiming();
    (void)ShmSegment::Unlink(name);
    std::unique_ptr<ShmSegment> seg;
    int fd = -1;
    if (mode == kSlotStore || mode == kPrefaulted) {
      seg = *ShmSegment::Create(name, 0, true);
      if (mode == kPrefaulted && !seg->EnsureCapacity(bytes, true).ok()) state.SkipWithError("prefault failed");
    } else {
      fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    state.ResumeTiming();
    uint8_t* p = nullptr;
    if (seg != nullptr) {
      if (mode == kSlotStore && !seg->EnsureCapacity(bytes, true).ok()) state.SkipWithError("grow failed");
      CopyPool pool(threads);
      ParallelMemcpy(seg->data(), src.data(), bytes, &pool);
    } else {
      if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) state.SkipWithError("ftruncate failed");
      if ((mode == kFallocTouch || mode == kFallocPopulate || mode == kFallocPopRead || mode == kFallocFused) &&
          posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
        state.SkipWithError("fallocate failed");
      }
      void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (mode == kMapPopulate ? MAP_POPULATE : 0),
                        fd, 0);
      if (addr == MAP_FAILED) state.SkipWithError("mmap failed");
      p = static_cast<uint8_t*>(addr);
      if (mode == kHugeAdvise) (void)madvise(p, bytes, MADV_HUGEPAGE);
      OnThreads(threads, [&](int i) {
        auto [lo, hi] = range(i);
        if (lo >= hi) return;
        if (mode == kFused || mode == kFallocFused) {
          for (uint64_t a = lo; a < hi; a += 2u << 20) {
            const uint64_t b = std::min(hi, a + (2u << 20));
            (void)madvise(p + a, b - a, MADV_POPULATE_WRITE);
            std::memcpy(p + a, src.data() + a, b - a);
          }
          return;
        }
        if (mode == kPopulate || mode == kFallocPopulate || mode == kHugeAdvise || mode == kFallocPopRead) {
          (void)madvise(p + lo, hi - lo, mode == kFallocPopRead ? MADV_POPULATE_READ : MADV_POPULATE_WRITE);
        }
      });
      if (mode != kFused && mode != kFallocFused) {
        OnThreads(threads, [&](int i) {
          auto [lo, hi] = range(i);
          if (lo < hi) std::memcpy(p + lo, src.data() + lo, hi - lo);
        });
      }
    }
    benchmark::ClobberMemory();
    state.PauseTiming();
    if (p != nullptr) {
      if (std::memcmp(p, src.data(), bytes) != 0) state.SkipWithError("copy mismatch");
      munmap(p, bytes);
    }
    if (fd >= 0) close(fd);
    seg.reset();
    (void)ShmSegment::Unlink(name);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void FirstWriteArgs(benchmark::internal::Benchmark* b) {
  for (int64_t t : {1, 2}) {
    for (int64_t mode = kTouch; mode <= kPrefaulted; ++mode) b->Args({1 << 30, t, mode});
  }
}

void BM_Checksum(benchmark::State& state) {
  const uint64_t bytes = static_cast<uint64_t>(state.range(0));
  std::vector<uint8_t> buf(bytes, 1);
  for (auto _ : state) benchmark::DoNotOptimize(ChecksumBytes(buf.data(), bytes));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void SizesAndThreads(benchmark::internal::Benchmark* b) {
  for (int64_t mb : {64, 512}) {
    for (int64_t t : {1, 2, 4}) b->Args({mb << 20, t});
  }
}

BENCHMARK(BM_MemcpyToShm)->Apply(SizesAndThreads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Save)->Apply(SizesAndThreads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FirstWrite)
    ->Apply(FirstWriteArgs)
    ->ArgNames({"bytes", "threads", "mode"})
    ->Iterations(1)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Checksum)->Arg(256 << 10)->Arg(64 << 20)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace ballast::ckpt

BENCHMARK_MAIN();
