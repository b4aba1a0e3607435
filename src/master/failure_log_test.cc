// FailureLog, EventLog and the Prometheus text: pure logic, fake clock.
#include "master/failure_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "master/event_log.h"
#include "master/metrics.h"

namespace ballast::master {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Histogram, CountsAreCumulativePerUpperBound) {
  Histogram h({1, 5});
  h.Observe(0.5);
  h.Observe(1);
  h.Observe(3);
  h.Observe(7);
  EXPECT_EQ(h.counts, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(h.count, 4u);
  EXPECT_DOUBLE_EQ(h.sum, 11.5);
}

v1::FailureRecord Record(int64_t round, double at_s, const std::string& kind) {
  v1::FailureRecord r;
  r.set_round(round);
  r.set_at_s(at_s);
  r.set_kind(kind);
  return r;
}

TEST(FailureLog, AResumptionCompletesTheRecordsOfEarlierRoundsOnly) {
  FailureLog log;
  log.Add(Record(1, 10, "killed"));
  log.Add(Record(1, 10.5, "node-lost"));
  log.Resumed(1, 11, 5, 9);  // the same round: nothing resumed yet
  EXPECT_FALSE(log.records()[0].resumed());
  log.Resumed(2, 12, 7, 9);  // round 2 made step 7 at 12 s; step 9 was reached before
  ASSERT_EQ(log.records().size(), 2u);
  EXPECT_TRUE(log.records()[0].resumed());
  EXPECT_DOUBLE_EQ(log.records()[0].resume_s(), 2);
  EXPECT_EQ(log.records()[0].steps_lost(), 3);  // 7, 8 and 9 again
  EXPECT_DOUBLE_EQ(log.records()[1].resume_s(), 1.5);
  log.Add(Record(2, 20, "killed"));
  log.Resumed(3, 21, 10, 9);  // resumed past the high-water step: nothing lost
  EXPECT_EQ(log.records()[2].steps_lost(), 0);
  EXPECT_DOUBLE_EQ(log.records()[0].resume_s(), 2);  // not touched again
  EXPECT_EQ(log.recovery().count, 3u);
  EXPECT_EQ(log.total(), 3);
  EXPECT_EQ(log.recovered_by_kind().at("killed"), 2);
  EXPECT_EQ(log.recovered_by_kind().at("node-lost"), 1);
  v1::FailureRecord fatal = Record(3, 30, "oom-killed");
  fatal.set_action("job failed");
  log.Add(fatal);
  EXPECT_EQ(log.recovered_by_kind().count("oom-killed"), 0u);  // not a recovery
  EXPECT_EQ(log.total(), 4);
}

TEST(FailureLog, KeepsTheNewestRecordsAndCountsAll) {
  FailureLog log;
  for (size_t i = 0; i < FailureLog::kMaxRecords + 5; ++i) log.Add(Record(static_cast<int64_t>(i + 1), 1.0 * i, "killed"));
  EXPECT_EQ(log.records().size(), FailureLog::kMaxRecords);
  EXPECT_EQ(log.total(), static_cast<int>(FailureLog::kMaxRecords + 5));
  EXPECT_EQ(log.records().front().round(), 6);
  log.Resumed(1000000, 1e6, 1, 0);
  for (const auto& r : log.records()) EXPECT_TRUE(r.resumed());
}

TEST(EventLog, ReadersGetWhatCameAfterTheirLastSeq) {
  FakeClock clock;
  EventLog log(&clock, clock.Now());
  clock.Advance(2);
  EXPECT_EQ(log.Append("round", 1, "", "rendezvous complete"), 1);
  EXPECT_EQ(log.Append("failure", 1, "n0", "rank 0: SIGKILL"), 2);
  std::vector<v1::Event> all = log.After(0, 0);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_DOUBLE_EQ(all[0].at_s(), 2);
  EXPECT_EQ(all[1].node_id(), "n0");
  EXPECT_GT(all[1].unix_ms(), 0);
  ASSERT_EQ(log.After(1, 0).size(), 1u);
  EXPECT_TRUE(log.After(2, 0).empty());
  EXPECT_EQ(log.After(-5, 0).size(), 2u);
}

TEST(EventLog, ALongPollWakesForTheNextEventAndOnClose) {
  FakeClock clock;
  EventLog log(&clock, 0);
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    log.Append("round", 2, "", "scale up");
  });
  std::vector<v1::Event> got = log.After(0, 10);
  writer.join();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].round(), 2);
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    log.Close();
  });
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(log.After(1, 10).empty());
  closer.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(EventLog, DropsTheOldestBeyondItsBound) {
  FakeClock clock;
  EventLog log(&clock, 0);
  for (size_t i = 0; i < EventLog::kMaxEvents + 3; ++i) log.Append("round", 1, "", "x");
  std::vector<v1::Event> all = log.After(0, 0, EventLog::kMaxEvents + 10);
  ASSERT_EQ(all.size(), EventLog::kMaxEvents);
  EXPECT_EQ(all.front().seq(), 4);
  EXPECT_EQ(log.After(static_cast<int64_t>(EventLog::kMaxEvents + 1), 0).size(), 2u);
}

TEST(PrometheusText, ExportsEachFamilyWithConventionalNames) {
  v1::JobStatus st;
  st.set_job_id("job \"1\"");
  st.set_state("running");
  st.set_round(3);
  st.set_world_size(4);
  st.set_failures_total(2);
  st.add_nodes()->set_state("training");
  st.add_nodes()->set_state("dead");
  v1::Goodput* g = st.mutable_goodput();
  g->set_known(true);
  g->set_goodput(0.75);
  g->set_high_water_step(42);
  v1::GoodputPart* p = g->add_parts();
  p->set_part("productive");
  p->set_seconds(30);
  Histogram recovery({1, 10});
  recovery.Observe(0.2);
  std::map<std::string, int> restarts{{"killed", 2}, {"nan", 1}};
  std::string text = PrometheusText({&st, &recovery, &restarts});
  EXPECT_THAT(text, HasSubstr("ballast_rollbacks_total{reason=\"nan\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ballast_rollbacks_total{reason=\"loss-spike\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE ballast_goodput_ratio gauge\nballast_goodput_ratio 0.75\n"));
  EXPECT_THAT(text, HasSubstr("ballast_time_seconds_total{part=\"productive\"} 30\n"));
  EXPECT_THAT(text, HasSubstr("ballast_restarts_total{cause=\"killed\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("ballast_nodes{state=\"training\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ballast_nodes{state=\"dead\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ballast_nodes{state=\"left\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("ballast_round 3\n"));
  EXPECT_THAT(text, HasSubstr("ballast_step 42\n"));
  EXPECT_THAT(text, HasSubstr("ballast_recovery_seconds_bucket{le=\"1\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ballast_recovery_seconds_bucket{le=\"+Inf\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("ballast_info{job_id=\"job \\\"1\\\"\",state=\"running\"} 1\n"));
  g->set_known(false);  // no steps seen: no made-up ratio
  EXPECT_THAT(PrometheusText({&st, &recovery, &restarts}), Not(HasSubstr("ballast_goodput_ratio")));
}

}  // namespace
}  // namespace ballast::master
