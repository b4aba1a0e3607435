#include "agent/hang_responder.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "health/failure_class.h"
#include "health/stack_dump.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {

using Clock = std::chrono::steady_clock;

HangHooks HangHooks::ForWorkers(WorkerGroup* workers, ProgressMonitor* progress) {
  HangHooks h;
  h.workers = [workers] { return workers->Workers(); };
  h.read_cell = [progress](int local_rank) -> std::optional<CellSnapshot> {
    if (local_rank >= progress->num_cells()) return std::nullopt;
    return progress->Read(local_rank);
  };
  // `import ballast` registered faulthandler on SIGUSR1 (all threads, to
  // stderr), which the output reader forwards, logs and captures here. Only
  // the worker process, not its group: its children did not install the
  // handler and SIGUSR1 would end them.
  h.request_dump = [workers](const WorkerInfo& w) {
    workers->StartStderrCapture(w.local_rank);
    kill(w.pid, SIGUSR1);
  };
  h.dump_lines = [workers](int local_rank) { return workers->CapturedLines(local_rank); };
  h.take_dump = [workers](int local_rank) { return workers->TakeStderrCapture(local_rank); };
  h.kill_group = [](const WorkerInfo& w) { kill(-w.pid, SIGKILL); };
  return h;
}

HangResponder::HangResponder(HangResponderOptions options, HangHooks hooks, std::function<std::string()> log_keys)
    : options_(std::move(options)), hooks_(std::move(hooks)), log_keys_(std::move(log_keys)) {}

std::optional<v1::FailureReport> HangResponder::Check(uint64_t now, uint64_t round_started_ns, int64_t round) {
  if (options_.hang.timeout_s <= 0) return std::nullopt;
  const std::vector<WorkerInfo> workers = hooks_.workers();
  struct Hung {
    const WorkerInfo* worker;
    CellSnapshot cell;
    HangVerdict verdict;
    health::StackSummary stack;
  };
  std::vector<Hung> hung;
  // Adds the running workers hung at `at` that are not in `hung` yet.
  auto judge = [&](uint64_t at) {
    for (const WorkerInfo& w : workers) {
      if (w.state != WorkerState::kRunning) continue;
      if (std::any_of(hung.begin(), hung.end(), [&](const Hung& h) { return h.worker == &w; })) continue;
      const std::optional<CellSnapshot> c = hooks_.read_cell(w.local_rank);
      if (!c.has_value()) continue;
      const HangVerdict cv = CheckHang(*c, at, round_started_ns, options_.hang);
      if (cv.hung) hung.push_back({&w, *c, cv, {}});
    }
  };
  judge(now);
  if (hung.empty()) return std::nullopt;
  const auto check_started = Clock::now();
  spdlog::error("{} worker(s) hung: no progress for {:.1f} s (limit {:.0f} s, {}) {}; dumping the Python stacks "
                "of this node's workers",
                hung.size(), hung[0].verdict.idle_s, hung[0].verdict.limit_s, hung[0].verdict.phase, log_keys_());
  // Every worker, not only the hung ones: the others usually wait in a
  // collective, and their stacks show where. One at a time, so their dumps
  // do not interleave.
  // A dump is done when its lines stop coming (50 ms quiet); a worker that
  // writes none costs its share of BALLAST_HANG_DUMP_WAIT_S.
  const auto share = std::chrono::duration<double>(options_.dump_wait_s / std::max<size_t>(1, workers.size()));
  std::vector<const WorkerInfo*> dumped;
  for (const WorkerInfo& o : workers) {
    if (o.state != WorkerState::kRunning || o.pid <= 0) continue;
    spdlog::info("Python stacks of rank {} (local rank {}, pid {}):", o.global_rank, o.local_rank, o.pid);
    hooks_.request_dump(o);
    dumped.push_back(&o);
    const auto deadline = Clock::now() + share;
    size_t lines = 0;
    auto last_change = Clock::now();
    while (Clock::now() < deadline) {
      const size_t n = hooks_.dump_lines(o.local_rank);
      if (n != lines) {
        lines = n;
        last_change = Clock::now();
      } else if (n > 0 && Clock::now() - last_change >= std::chrono::milliseconds(50)) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // The one that stopped the others can cross the limit a moment after them:
  // a rank SIGSTOPped just after its step, whose peers reached that step a few
  // ms before it and wait for it in the next collective. Judged again at the
  // end of the dumps (which take at least 50 ms a worker), it is among the
  // hung ones the blame below chooses from.
  const uint64_t after_dumps =
      now + static_cast<uint64_t>(
                std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - check_started).count());
  judge(after_dumps);
  std::vector<std::pair<const WorkerInfo*, health::StackSummary>> silent;  // dumped, not hung, no dump came
  for (const WorkerInfo* o : dumped) {
    health::StackSummary st = health::SummarizeStackDump(hooks_.take_dump(o->local_rank));
    spdlog::info("rank {} (local rank {}): {}", o->global_rank, o->local_rank,
                 !st.found          ? "no stack dump (stopped, stuck outside Python, or it did not import ballast)"
                 : st.in_collective ? absl::StrCat("waiting in a collective at ", st.top_frame)
                                    : absl::StrCat("stopped outside any collective at ", st.top_frame));
    bool is_hung = false;
    for (Hung& h : hung) {
      if (h.worker->local_rank == o->local_rank) {
        h.stack = st;
        is_hung = true;
      }
    }
    if (!is_hung && !st.found) silent.emplace_back(o, st);
  }
  // Every hung rank waits in a collective, and a rank of this node that is not
  // past its own limit (inside a checkpoint save's grace, say) did not answer
  // the dump: stopped or stuck outside Python, it is the one they wait for
  // (SIGSTOPped inside a save: the drill `hang` on a loaded machine). A rank
  // that answers from outside a collective (a long save still running) is
  // not: the others wait for it, and nothing hangs.
  const bool all_wait = std::all_of(hung.begin(), hung.end(),
                                    [](const Hung& h) { return h.stack.found && h.stack.in_collective; });
  if (all_wait) {
    for (const auto& [o, st] : silent) {
      const std::optional<CellSnapshot> c = hooks_.read_cell(o->local_rank);
      if (!c.has_value()) continue;
      hung.push_back({o, *c, CheckHang(*c, after_dumps, round_started_ns, options_.hang), st});
    }
  }
  // Blame: a rank outside a collective (the others wait for it), then one
  // that did not answer the dump (stopped, or stuck outside Python), then
  // the lowest step, then the oldest progress.
  auto key = [](const Hung& h) {
    const int64_t step = h.cell.timestamp_ns == 0 ? -1 : static_cast<int64_t>(h.cell.step);
    return std::make_tuple(health::HangBlameTier(h.stack.found, h.stack.in_collective), step, h.cell.timestamp_ns);
  };
  const Hung* blamed = &hung[0];
  for (const Hung& h : hung) {
    if (key(h) < key(*blamed)) blamed = &h;
  }
  const WorkerInfo& w = *blamed->worker;
  // Killed when it is where the hang starts as far as this node can tell
  // (outside a collective, or not answering the dump: the other ranks wait for
  // it). A rank that waits in a collective waits for another node's: killing it
  // would make that node's ranks fail with "connection closed", a crash that
  // can reach the master before that node's own hang report. The master
  // blames among the nodes' reports, and its next round stops every worker.
  const bool kill = health::HangBlameTier(blamed->stack.found, blamed->stack.in_collective) < 2;
  const std::string last_step = blamed->cell.timestamp_ns == 0 ? "none" : absl::StrCat(blamed->cell.step);
  spdlog::error("worker hung: no progress for {:.1f} s (limit {:.0f} s, {}; last step {}) node={} rank={} "
                "local_rank={} round={}{}{}",
                blamed->verdict.idle_s, blamed->verdict.limit_s, blamed->verdict.phase, last_step, options_.node_id,
                w.global_rank, w.local_rank, round,
                blamed->stack.found ? absl::StrCat("; at ", blamed->stack.top_frame) : "",
                kill ? "" : "; left running: it waits in a collective, and the next round stops it");
  if (kill) hooks_.kill_group(w);
  // Reported with the hang as its cause; the reaped SIGKILL (and the other
  // workers' failures that follow it) are then consequences.
  v1::FailureReport report;
  report.set_node_id(options_.node_id);
  report.set_round(round);
  report.set_local_rank(w.local_rank);
  report.set_global_rank(w.global_rank);
  if (kill) report.set_signal(SIGKILL);
  report.set_stderr_tail(absl::StrCat("no progress for ", static_cast<int>(blamed->verdict.idle_s), " s (",
                                      blamed->verdict.phase, ", last step ", last_step, ")",
                                      blamed->stack.found ? absl::StrCat("; stack top: ", blamed->stack.top_frame,
                                                                         blamed->stack.in_collective
                                                                             ? " (waiting in a collective)"
                                                                             : "")
                                                          : "",
                                      "; Python stacks are in the agent's log"));
  report.set_hang_last_step(blamed->cell.timestamp_ns == 0 ? -1 : static_cast<int64_t>(blamed->cell.step));
  report.set_hang_idle_s(blamed->verdict.idle_s);
  report.set_hang_stack_found(blamed->stack.found);
  report.set_hang_in_collective(blamed->stack.in_collective);
  report.set_hang_top_frame(blamed->stack.top_frame);
  health::FailureEvidence evidence;
  evidence.signal = kill ? SIGKILL : 0;
  evidence.hang = true;
  health::FailureClass fc = health::Classify(evidence);
  report.set_cause(fc.cause);
  report.set_kind(health::FailureKindName(fc.kind));
  report.set_max_retries(fc.max_retries);
  return report;
}

}  // namespace ballast::agent
