// Microbenchmark: the cost of one progress report, i.e. what `ballast.step(n)`
// does below Python (clock_gettime + the stores into the shared cell), next to
// the bare stores. Run: build/bin/progress_microbench (or wherever the build
// puts it).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "agent/progress_monitor.h"
#include "common/progress_cell.h"

namespace ballast {
namespace {

void BM_RecordStepWithClock(benchmark::State& state) {
  auto monitor = agent::ProgressMonitor::Create(1);
  if (!monitor.ok()) {
    state.SkipWithError("cannot create the progress shm object");
    return;
  }
  // A second mapping stands in for the worker's.
  int fd = shm_open((*monitor)->name().c_str(), O_RDWR, 0);
  void* base = mmap(nullptr, ProgressShmSize(1), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ProgressCell* cell = ProgressCellAt(base, 0);
  uint64_t step = 0;
  for (auto _ : state) RecordStep(cell, ++step, MonotonicNowNs());
  benchmark::DoNotOptimize(cell->step.load());
  munmap(base, ProgressShmSize(1));
}
BENCHMARK(BM_RecordStepWithClock);

void BM_RecordStepStoresOnly(benchmark::State& state) {
  ProgressCell cell;
  uint64_t step = 0;
  for (auto _ : state) RecordStep(&cell, ++step, step);
  benchmark::DoNotOptimize(cell.step.load());
}
BENCHMARK(BM_RecordStepStoresOnly);

}  // namespace
}  // namespace ballast

BENCHMARK_MAIN();
