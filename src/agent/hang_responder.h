// The agent's response to a hang (--hang-timeout): decides from the progress
// cells which running workers hang (CheckHang), dumps every running worker's
// Python stacks, blames one hung worker, kills its process group (unless it
// waits in a collective: then the hang started on another node, and the
// master's next round stops it) and builds the failure report with the hang
// evidence.
//
// Blame: in data-parallel training the healthy ranks end up waiting in a
// collective for the hung one, so a rank stopped outside any collective is
// blamed first, then the lowest step, then the oldest progress.
//
// Side effects go through HangHooks (the workers, their cells, the stack
// dumps, the kill), so the decisions are tested with fakes; ForWorkers gives
// the real ones. The report goes back to the caller, which owns the round's
// "failure already reported" state and the reporting itself.
//
// Threading: not thread-safe; the agent's main loop owns it. Check blocks
// for up to dump_wait_s while the stacks are written.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "agent/progress_monitor.h"
#include "agent/worker_group.h"
#include "ballast/v1/master.pb.h"

namespace ballast::agent {

struct HangHooks {
  // The node's workers now (only kRunning ones are judged and dumped).
  std::function<std::vector<WorkerInfo>()> workers;
  // The progress cell of a local rank; nullopt when it has none.
  std::function<std::optional<CellSnapshot>(int local_rank)> read_cell;
  // Starts capturing the worker's stderr and asks it for its stacks (SIGUSR1).
  std::function<void(const WorkerInfo&)> request_dump;
  // Lines captured so far from the worker's stderr.
  std::function<size_t(int local_rank)> dump_lines;
  // Ends the capture and returns what it got ('\n'-joined).
  std::function<std::string(int local_rank)> take_dump;
  // SIGKILLs the worker's process group.
  std::function<void(const WorkerInfo&)> kill_group;

  // The real ones; workers and progress are not owned and outlive the hooks.
  static HangHooks ForWorkers(WorkerGroup* workers, ProgressMonitor* progress);
};

struct HangResponderOptions {
  std::string node_id;
  HangOptions hang;        // hang.timeout_s <= 0: hang detection off
  double dump_wait_s = 1;  // BALLAST_HANG_DUMP_WAIT_S, shared by the workers' dumps
};

class HangResponder {
 public:
  // log_keys gives the "node=... round=..." suffix of its log lines.
  HangResponder(HangResponderOptions options, HangHooks hooks, std::function<std::string()> log_keys);

  // One check of round `round`, whose workers started at round_started_ns.
  // With a hung worker: dumps the stacks, kills the blamed worker's process
  // group unless it waits in a collective, and returns its failure report (cause and kind from
  // health::Classify); else nullopt.
  std::optional<v1::FailureReport> Check(uint64_t now_ns, uint64_t round_started_ns, int64_t round);

 private:
  const HangResponderOptions options_;
  HangHooks hooks_;
  std::function<std::string()> log_keys_;
};

}  // namespace ballast::agent
