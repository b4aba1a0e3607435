// HangResponder with fake workers, cells and stack dumps: which worker is
// blamed, that only it is killed, what its report says, and the log lines
// the integration tests look for.
#include "agent/hang_responder.h"

#include <signal.h>

#include <algorithm>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "health/failure_class.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kS = 1'000'000'000ull;
constexpr uint64_t kStarted = 100 * kS;  // the round's workers started here

// faulthandler dumps (see health/stack_dump_test.cc): one rank waits in
// backward for the gradient allreduce, the other sleeps in the script.
constexpr char kInCollective[] =
    "Current thread 0x00007f8489e282c0 (most recent call first):\n"
    "  File \"/usr/lib/python3/dist-packages/torch/autograd/__init__.py\", line 197 in backward\n"
    "  File \"/tmp/stk/w.py\", line 12 in <module>\n";
constexpr char kOutside[] =
    "Current thread 0x00007f7b45a012c0 (most recent call first):\n"
    "  File \"/tmp/stk/w.py\", line 10 in <module>\n";

// The node's workers as the hooks see them, and what was done to them.
struct FakeNode {
  std::vector<WorkerInfo> workers;
  std::map<int, CellSnapshot> cells;  // by local rank; missing: no cell
  std::map<int, std::string> dumps;   // what a worker writes on SIGUSR1
  std::vector<int> dump_requests;     // local ranks
  std::map<int, std::string> capturing;
  std::vector<pid_t> killed;

  void Add(int local_rank, std::optional<CellSnapshot> cell, const std::string& dump = "") {
    WorkerInfo w;
    w.local_rank = local_rank;
    w.global_rank = 10 + local_rank;
    w.pid = 1000 + local_rank;
    workers.push_back(w);
    if (cell.has_value()) cells[local_rank] = *cell;
    if (!dump.empty()) dumps[local_rank] = dump;
  }
  HangHooks Hooks() {
    HangHooks h;
    h.workers = [this] { return workers; };
    h.read_cell = [this](int lr) -> std::optional<CellSnapshot> {
      auto it = cells.find(lr);
      if (it == cells.end()) return std::nullopt;
      return it->second;
    };
    h.request_dump = [this](const WorkerInfo& w) {
      dump_requests.push_back(w.local_rank);
      capturing[w.local_rank] = dumps.count(w.local_rank) ? dumps[w.local_rank] : "";
    };
    h.dump_lines = [this](int lr) -> size_t {
      const std::string& text = capturing[lr];
      return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
    };
    h.take_dump = [this](int lr) {
      std::string text = capturing[lr];
      capturing.erase(lr);
      return text;
    };
    h.kill_group = [this](const WorkerInfo& w) { killed.push_back(w.pid); };
    return h;
  }
};

// A worker at `step`, last stepped at `at_s` (0: never).
CellSnapshot Cell(uint64_t step, uint64_t at_s) { return CellSnapshot{step, at_s * kS, 0, step, 0, 0}; }

class HangResponderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = spdlog::default_logger();
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("hang_responder_test", sink));
  }
  void TearDown() override { spdlog::set_default_logger(saved_); }

  HangResponder Responder(double timeout_s = 10) {
    HangResponderOptions o;
    o.node_id = "node-a";
    o.hang.timeout_s = timeout_s;
    o.hang.first_step_grace_s = 300;
    o.hang.checkpoint_grace_s = 600;
    o.dump_wait_s = 0.2;  // workers with no dump cost their share of it
    return HangResponder(o, node_.Hooks(), [] { return std::string("node=node-a round=4"); });
  }

  FakeNode node_;
  std::ostringstream log_;
  std::shared_ptr<spdlog::logger> saved_;
};

TEST_F(HangResponderTest, NoHungWorkerDoesNothing) {
  node_.Add(0, Cell(5, 195));
  node_.Add(1, Cell(5, 198));
  node_.Add(2, std::nullopt);  // no cell: not judged
  node_.workers.push_back(WorkerInfo{3, 13, 1003, WorkerState::kFailed});
  node_.cells[3] = Cell(1, 101);  // not running: not judged
  HangResponder r = Responder();
  EXPECT_FALSE(r.Check(200 * kS, kStarted, 4).has_value());
  EXPECT_TRUE(node_.dump_requests.empty());
  EXPECT_TRUE(node_.killed.empty());
  EXPECT_EQ(log_.str(), "");
}

TEST_F(HangResponderTest, OffWithoutATimeout) {
  node_.Add(0, Cell(5, 101));
  HangResponder r = Responder(/*timeout_s=*/0);
  EXPECT_FALSE(r.Check(1000 * kS, kStarted, 4).has_value());
  EXPECT_TRUE(node_.killed.empty());
}

TEST_F(HangResponderTest, OneHungWorkerIsBlamedAndKilledAfterEveryWorkerIsDumped) {
  node_.Add(0, Cell(8, 199), kInCollective);
  node_.Add(1, Cell(7, 180), kOutside);  // 20 s without a step
  node_.workers.push_back(WorkerInfo{2, 12, 0, WorkerState::kRunning});  // no process: not dumped
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_THAT(node_.dump_requests, ElementsAre(0, 1));
  EXPECT_THAT(node_.killed, ElementsAre(1001));  // the process group of local rank 1 only
  EXPECT_EQ(report->node_id(), "node-a");
  EXPECT_EQ(report->round(), 4);
  EXPECT_EQ(report->local_rank(), 1);
  EXPECT_EQ(report->global_rank(), 11);
  EXPECT_EQ(report->signal(), SIGKILL);
  EXPECT_EQ(report->hang_last_step(), 7);
  EXPECT_DOUBLE_EQ(report->hang_idle_s(), 20.0);
  EXPECT_TRUE(report->hang_stack_found());
  EXPECT_FALSE(report->hang_in_collective());
  EXPECT_EQ(report->hang_top_frame(), "/tmp/stk/w.py:10 in <module>");
  EXPECT_EQ(report->stderr_tail(),
            "no progress for 20 s (training, last step 7); stack top: /tmp/stk/w.py:10 in <module>; "
            "Python stacks are in the agent's log");
  // The log lines the integration tests look for, worded as before.
  const std::string log = log_.str();
  EXPECT_THAT(log, HasSubstr("1 worker(s) hung: no progress for 20.0 s (limit 10 s, training) node=node-a round=4; "
                             "dumping the Python stacks of this node's workers"));
  EXPECT_THAT(log, HasSubstr("Python stacks of rank 10 (local rank 0, pid 1000):"));
  EXPECT_THAT(log, HasSubstr("Python stacks of rank 11 (local rank 1, pid 1001):"));
  EXPECT_THAT(log, HasSubstr("rank 10 (local rank 0): waiting in a collective at "
                             "/usr/lib/python3/dist-packages/torch/autograd/__init__.py:197 in backward"));
  EXPECT_THAT(log, HasSubstr("rank 11 (local rank 1): stopped outside any collective at /tmp/stk/w.py:10 in <module>"));
  EXPECT_THAT(log, HasSubstr("worker hung: no progress for 20.0 s (limit 10 s, training; last step 7) node=node-a "
                             "rank=11 local_rank=1 round=4; at /tmp/stk/w.py:10 in <module>"));
}

// The ranks waiting in a collective wait for the one that is not: it is
// blamed even at a higher step.
TEST_F(HangResponderTest, BlamesTheWorkerOutsideACollectiveFirst) {
  node_.Add(0, Cell(3, 150), kInCollective);
  node_.Add(1, Cell(9, 170), kOutside);
  node_.Add(2, Cell(5, 160), kInCollective);
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->local_rank(), 1);
  EXPECT_THAT(node_.killed, ElementsAre(1001));
}

// The chaos drill `hang` on torch 1.13: rank 1 is SIGSTOPped right after its
// step 9; rank 0 had reported step 9 a few ms earlier and waits for it in the
// next allreduce, so rank 0 crosses the limit first. Rank 1 crosses it while
// the stacks are dumped (its own dump, which never comes, takes its share of
// the wait) and is the one blamed, not the rank waiting for it.
TEST_F(HangResponderTest, AWorkerThatCrossesTheLimitDuringTheDumpsIsJudgedToo) {
  node_.Add(0, Cell(9, 185), kInCollective);
  CellSnapshot stopped = Cell(9, 190);
  stopped.timestamp_ns += 5'000'000;  // 9.995 s idle at the check: under the 10 s limit
  node_.Add(1, stopped);              // no dump: stopped
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->local_rank(), 1);
  EXPECT_FALSE(report->hang_stack_found());
  EXPECT_THAT(node_.killed, ElementsAre(1001));
}

// The drill `hang` on a loaded machine: rank 1 is SIGSTOPped inside its
// checkpoint save, so its own limit is the checkpoint grace and it is not hung;
// rank 0 waits for it in the next allreduce and is. Rank 1 answers no dump:
// it is the one blamed and killed, not the rank that waits for it.
TEST_F(HangResponderTest, ARankStoppedInsideASaveIsBlamedOverTheRankWaitingForIt) {
  node_.Add(0, Cell(10, 185), kInCollective);
  CellSnapshot saving = Cell(10, 186);
  saving.checkpoint_ns = 186 * kS;  // inside a save: the checkpoint grace (600 s) applies
  node_.Add(1, saving);             // no dump: stopped
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->local_rank(), 1);
  EXPECT_FALSE(report->hang_stack_found());
  EXPECT_EQ(report->signal(), SIGKILL);
  EXPECT_THAT(node_.killed, ElementsAre(1001));
}

// A rank that answers from outside a collective inside its save's grace is
// still saving (a long save): the rank waiting for it is reported, and
// nobody is killed.
TEST_F(HangResponderTest, ARankStillSavingIsNotBlamed) {
  node_.Add(0, Cell(10, 185), kInCollective);
  CellSnapshot saving = Cell(10, 186);
  saving.checkpoint_ns = 186 * kS;
  node_.Add(1, saving, kOutside);
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->local_rank(), 0);
  EXPECT_TRUE(report->hang_in_collective());
  EXPECT_TRUE(node_.killed.empty());
}

TEST_F(HangResponderTest, ThenTheLowestStepThenTheOldestProgress) {
  {
    FakeNode& n = node_;
    n.Add(0, Cell(5, 150), kInCollective);
    n.Add(1, Cell(3, 170), kInCollective);  // lower step, newer progress
    n.Add(2, Cell(2, 140), kInCollective);  // the lowest step wins among equals
    HangResponder r = Responder();
    std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
    ASSERT_TRUE(report.has_value());
    EXPECT_EQ(report->local_rank(), 2);
    EXPECT_TRUE(report->hang_in_collective());
    EXPECT_THAT(report->stderr_tail(), HasSubstr("(waiting in a collective)"));
    // Every rank here waits for another node's: none is killed (their
    // "connection closed" would reach the master as a crash, maybe before that
    // node's hang report), and the report says hung, not killed.
    EXPECT_TRUE(n.killed.empty());
    EXPECT_EQ(report->signal(), 0);
    EXPECT_EQ(report->cause(), "hung (no progress)");
    EXPECT_EQ(report->kind(), "hang");
  }
  // A worker that does not answer the dump (SIGSTOPped, stuck outside
  // Python) while the others wait in a collective is blamed before them,
  // even at a higher step.
  node_ = FakeNode{};
  node_.Add(0, Cell(3, 150), kInCollective);
  node_.Add(1, Cell(4, 170));
  {
    HangResponder r = Responder();
    std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
    ASSERT_TRUE(report.has_value());
    EXPECT_EQ(report->local_rank(), 1);
    EXPECT_FALSE(report->hang_stack_found());
  }
  node_ = FakeNode{};
  node_.Add(0, Cell(3, 170));
  node_.Add(1, Cell(3, 150));  // same step, older progress
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(200 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->local_rank(), 1);
  EXPECT_FALSE(report->hang_stack_found());
  EXPECT_THAT(log_.str(), HasSubstr("no stack dump (stopped, stuck outside Python, or it did not import ballast)"));
}

// A worker that never stepped: hung after the first-step grace, its last
// step "none" (-1 in the report, below any step when blamed).
TEST_F(HangResponderTest, AWorkerWithNoStepReportsNoneAndIsBlamedBeforeStepZero) {
  node_.Add(0, Cell(0, 120));  // step 0, 480 s ago
  node_.Add(1, Cell(0, 0));    // never stepped, 500 s since the start
  HangResponder r = Responder();
  std::optional<v1::FailureReport> report = r.Check(600 * kS, kStarted, 4);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->local_rank(), 1);
  EXPECT_EQ(report->hang_last_step(), -1);
  EXPECT_EQ(report->stderr_tail(),
            "no progress for 500 s (first step, last step none); Python stacks are in the agent's log");
  health::FailureEvidence evidence;
  evidence.signal = SIGKILL;
  evidence.hang = true;
  const health::FailureClass fc = health::Classify(evidence);
  EXPECT_EQ(report->cause(), fc.cause);
  EXPECT_EQ(report->kind(), "hang");
  EXPECT_EQ(report->kind(), health::FailureKindName(fc.kind));
  EXPECT_EQ(report->max_retries(), fc.max_retries);
  EXPECT_THAT(log_.str(), HasSubstr("(limit 300 s, first step; last step none)"));
}

}  // namespace
}  // namespace ballast::agent
