// Warm restart: pre-started worker interpreters. A restart spends most of
// its time in a new interpreter (Python start, `import torch`, the script's
// imports); a warm interpreter has done that before the restart comes. One is
// kept per local rank: `python -u -c <bootstrap>` with the worker's
// environment, which imports torch (and a user-named list of modules), says
// "ready" on a control socket (fd 3) and waits there for its job. Given one,
// it takes the round's environment, cwd and argv and runs the script with
// runpy as __main__ (or the module, for -m), so the script sees what a cold
// start gives it: sys.argv, __main__, __file__, sys.path[0], cwd, env, signal
// handlers, stdin (inherited, as for a cold start).
//
// What the interpreter read at its start must not change: a warm process is
// only used when its environment, minus the per-round variables (RANK,
// WORLD_SIZE, MASTER_ADDR, ...), equals the new worker's. Otherwise (say
// OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, NCCL_* or PYTHON* changed) the
// worker starts cold and the log says why. An interpreter that died before
// its job (the preload failed) turns warm starts off for the node, saying why.
//
// The bootstrap wraps torch.distributed.init_process_group: it reports on the
// socket when it was called and returned (the recovery timeline), and, for
// ranks other than 0 with env:// init, first waits until rank 0's TCPStore
// accepts connections (polling every 5 ms): torch 1.13's store client that
// dials before the store listens retries only after a second or more, and a
// warm start usually gets there first.
//
// Threading: one thread (the agent's main loop), the same that forks the
// workers (PR_SET_PDEATHSIG).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/subprocess.h"

namespace ballast::agent {

// The per-round variables a warm interpreter learns from its job.
bool IsRoundVariable(const std::string& name);
// env without the per-round variables.
std::map<std::string, std::string> WithoutRoundVariables(const std::map<std::string, std::string>& env);
// The first variable that differs between two environments ("" if none), for messages.
std::string FirstDifference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b);

// The bootstrap program (`python -u -c` it); exposed for tests.
const char* WarmBootstrap();

struct WarmOptions {
  std::string python = "python3";
  std::vector<std::string> modules = {"torch"};  // imported before the interpreter waits
};

// A warm interpreter handed out for a worker: the process (its stdout/stderr
// pipes and control socket included) and when it became ready.
struct WarmProcess {
  Subprocess process;
  double ready_at_s = -1;   // CLOCK_MONOTONIC seconds it said "ready"; -1: still importing
  double spawned_at_s = 0;
};

class WarmPool {
 public:
  explicit WarmPool(WarmOptions options);
  ~WarmPool();  // kills the waiting interpreters

  // Starts a warm interpreter for local rank `lr` with `env` (the worker
  // environment of any round: the per-round variables are dropped) unless
  // one with that environment waits already. No-op once disabled.
  absl::Status Prepare(int lr, const std::map<std::string, std::string>& env);
  // Reads "ready" and notices interpreters that died (which disables the pool).
  void Poll();
  // The waiting interpreter of `lr` when its environment matches `env` (the
  // new worker's full environment), else nullopt with *why_not set.
  std::optional<WarmProcess> Take(int lr, const std::map<std::string, std::string>& env, std::string* why_not);
  // Hands `process` its job: the full environment, cwd and argv (the script
  // and its arguments, or the module and its arguments). Non-blocking.
  static absl::Status Hand(WarmProcess* process, const std::map<std::string, std::string>& env,
                           const std::string& cwd, const std::vector<std::string>& argv, bool module);

  // Whether local rank lr's interpreter waits, its imports done (after Poll).
  bool ready(int lr) const;
  bool disabled() const { return !disabled_reason_.empty(); }
  const std::string& disabled_reason() const { return disabled_reason_; }

 private:
  struct Slot {
    std::optional<WarmProcess> warm;
    std::map<std::string, std::string> env;  // without the round variables
    std::string buffer;                      // partial control-socket line
  };
  const WarmOptions options_;
  std::map<int, Slot> slots_;
  std::string disabled_reason_;
};

// Reads whole lines the bootstrap wrote on a control socket (non-blocking):
// "ready <t>", "pg <t_call> <t_return>", ... ; appends partial input to *buffer.
std::vector<std::string> ReadControlLines(int fd, std::string* buffer, bool* closed);

}  // namespace ballast::agent
