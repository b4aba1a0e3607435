#include "agent/progress_monitor.h"

#include <bit>
#include <cmath>

#include "agent/health_watch.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

namespace ballast::agent {
namespace {

constexpr uint64_t kS = 1000000000ULL;

HangOptions Opts() {
  HangOptions o;
  o.timeout_s = 3;
  o.first_step_grace_s = 30;
  o.checkpoint_grace_s = 60;
  return o;
}

TEST(CheckHang, OffWhenTimeoutIsZero) {
  HangOptions o;
  o.timeout_s = 0;
  EXPECT_FALSE(CheckHang(CellSnapshot{}, 1000 * kS, 0, o).hung);
}

TEST(CheckHang, FirstStepGetsTheGracePeriod) {
  CellSnapshot c;
  HangVerdict v = CheckHang(c, 100 * kS + 29 * kS, 100 * kS, Opts());
  EXPECT_FALSE(v.hung);
  EXPECT_EQ(v.phase, "first step");
  v = CheckHang(c, 100 * kS + 31 * kS, 100 * kS, Opts());
  EXPECT_TRUE(v.hung);
  EXPECT_DOUBLE_EQ(v.limit_s, 30);
}

TEST(CheckHang, StepOlderThanTimeoutIsHung) {
  CellSnapshot c;
  c.step = 7;
  c.timestamp_ns = 200 * kS;
  EXPECT_FALSE(CheckHang(c, 202 * kS, 100 * kS, Opts()).hung);
  HangVerdict v = CheckHang(c, 204 * kS, 100 * kS, Opts());
  EXPECT_TRUE(v.hung);
  EXPECT_EQ(v.phase, "training");
  EXPECT_DOUBLE_EQ(v.idle_s, 4);
}

TEST(CheckHang, CheckpointSaveGetsItsGrace) {
  CellSnapshot c;
  c.step = 7;
  c.timestamp_ns = 200 * kS;
  c.checkpoint_ns = 201 * kS;
  EXPECT_FALSE(CheckHang(c, 250 * kS, 100 * kS, Opts()).hung);
  HangVerdict v = CheckHang(c, 262 * kS, 100 * kS, Opts());
  EXPECT_TRUE(v.hung);
  EXPECT_EQ(v.phase, "checkpoint");
}

TEST(CheckHang, AnExitingWorkerGetsTheExitGrace) {
  CellSnapshot c;
  c.step = 14;
  c.timestamp_ns = 200 * kS;
  c.exiting_ns = 201 * kS;
  HangOptions o = Opts();
  o.exit_grace_s = 30;
  HangVerdict v = CheckHang(c, 220 * kS, 100 * kS, o);  // 19 s into the teardown: more than the 3 s timeout
  EXPECT_FALSE(v.hung);
  EXPECT_EQ(v.phase, "exiting");
  v = CheckHang(c, 232 * kS, 100 * kS, o);  // stuck at exit for good is still a hang
  EXPECT_TRUE(v.hung);
  EXPECT_DOUBLE_EQ(v.limit_s, 30);
  c.exiting_ns = 0;
  EXPECT_TRUE(CheckHang(c, 220 * kS, 100 * kS, o).hung);  // the same silence in training is one
}

TEST(CheckHang, GraceIsNeverShorterThanTheTimeout) {
  HangOptions o = Opts();
  o.timeout_s = 100;
  EXPECT_FALSE(CheckHang(CellSnapshot{}, 150 * kS, 100 * kS, o).hung);  // 50 s < 100 s
}

TEST(StepTime, MeanOverTheInterval) {
  CellSnapshot a{10, 100 * kS, 0, 10}, b{14, 102 * kS, 0, 14};
  EXPECT_DOUBLE_EQ(StepTime(a, b), 0.5);
  EXPECT_EQ(StepTime(b, b), 0);
  EXPECT_EQ(StepTime(CellSnapshot{}, b), 0);
}

TEST(ProgressMonitor, WorkerWritesAreSeenAndSummarized) {
  auto m = ProgressMonitor::Create(2);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->name().rfind("/ballast-progress-", 0), 0u);
  ProgressSummary s = (*m)->Summarize();
  EXPECT_FALSE(s.any_step);
  // Map it a second time, as a worker does, and write as ballast.step does.
  int fd = shm_open((*m)->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  void* base = mmap(nullptr, ProgressShmSize(2), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(base, MAP_FAILED);
  EXPECT_EQ(reinterpret_cast<ProgressHeader*>(base)->magic, kProgressMagic);
  RecordStep(ProgressCellAt(base, 0), 5, 10 * kS);
  RecordStep(ProgressCellAt(base, 1), 3, 10 * kS);
  s = (*m)->Summarize();
  EXPECT_TRUE(s.any_step);
  EXPECT_EQ(s.min_step, 3u);
  RecordStep(ProgressCellAt(base, 0), 9, 12 * kS);   // 0.5 s/step
  RecordStep(ProgressCellAt(base, 1), 4, 12 * kS);   // 2 s/step: the slowest
  s = (*m)->Summarize();
  EXPECT_EQ(s.min_step, 4u);
  EXPECT_DOUBLE_EQ(s.step_time_s, 2.0);
  EXPECT_EQ((*m)->Read(0).reports, 2u);
  (*m)->Reset();
  EXPECT_EQ((*m)->Read(0).timestamp_ns, 0u);
  EXPECT_FALSE((*m)->Summarize().any_step);
  munmap(base, ProgressShmSize(2));
}

TEST(ProgressMonitor, ABadLossInACellBecomesTheReportTheMasterDecidesOn) {
  auto m = ProgressMonitor::Create(2);
  ASSERT_TRUE(m.ok()) << m.status();
  int fd = shm_open((*m)->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  void* base = mmap(nullptr, ProgressShmSize(2), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(base, MAP_FAILED);
  EXPECT_FALSE((*m)->ReadHealth(1).has_value());
  // What ballast.health writes (python/bindings: progress_health).
  ProgressCell* c = ProgressCellAt(base, 1);
  c->health_step.store(17);
  c->health_value.store(std::bit_cast<uint64_t>(std::nan("")));
  c->health_epoch.store(1);
  c->health_begin.store(64);
  c->health_end.store(72);
  c->health_kind.store(static_cast<uint64_t>(HealthKind::kNonFinite), std::memory_order_release);
  std::optional<HealthRecord> bad = (*m)->ReadHealth(1);
  ASSERT_TRUE(bad.has_value());
  v1::FailureReport r = HealthFailureReport(*bad, "node-1", 3, 1, 5);
  EXPECT_EQ(r.kind(), "nan");
  EXPECT_EQ(r.health_step(), 17);
  EXPECT_EQ(r.health_data(), "1:64:72");
  EXPECT_EQ(r.cause(), "non-finite loss (nan) at step 17");
  EXPECT_EQ(r.node_id(), "node-1");
  EXPECT_EQ(r.global_rank(), 5);
  EXPECT_EQ(r.round(), 3);
  // A spike names its z-score and median; a new round starts clean.
  c->health_kind.store(static_cast<uint64_t>(HealthKind::kSpike));
  c->health_value.store(std::bit_cast<uint64_t>(40.0));
  c->health_median.store(std::bit_cast<uint64_t>(2.5));
  c->health_z.store(std::bit_cast<uint64_t>(12.25));
  r = HealthFailureReport(*(*m)->ReadHealth(1), "node-1", 3, 1, 5);
  EXPECT_EQ(r.kind(), "loss-spike");
  EXPECT_EQ(r.cause(), "loss spike at step 17: 40, 12.25 robust deviations above the recent median 2.5");
  (*m)->Reset();
  EXPECT_FALSE((*m)->ReadHealth(1).has_value());
  munmap(base, ProgressShmSize(2));
}

}  // namespace
}  // namespace ballast::agent
