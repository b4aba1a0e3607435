// Warm restart: pre-started worker interpreters. A restart spends most of
// its time in a new interpreter (Python start, `import torch`, the script's
// imports); a warm interpreter has done that before the restart comes:
// `python -u -c <bootstrap>` with the worker's environment, which imports
// torch (and a user-named list of modules), says "ready" on a control socket
// (fd 3) and waits there for its job. Given one, it takes the round's
// environment, cwd and argv and runs the script with runpy as __main__ (or
// the module, for -m), so the script sees what a cold start gives it:
// sys.argv, __main__, __file__, sys.path[0], cwd, env, signal handlers,
// stdin (inherited, as for a cold start). With forks (the default) one
// interpreter per node serves every local rank; without them one is kept
// per local rank and handed out.
//
// What the interpreter read at its start must not change. It starts with the
// *interpreter environment* (WorkerGroup::InterpreterEnvironment: the user's
// environment and what the agent adds for its whole life, e.g. PYTHONPATH);
// everything the agent sets per round or per local rank (RANK, MASTER_ADDR,
// BALLAST_CKPT_SHM, BALLAST_CKPT_REPLICAS, ...) comes with the job, like the
// torchrun variables, so nothing Ballast changes between rounds defeats a
// warm start. A warm process is only used when the new worker's interpreter
// environment equals the one it started with; otherwise (the user's
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
// Preloads: after torch the interpreter imports, one module at a time, what
// the agent sends: what the workers imported as far as it is known (this
// node's, other nodes', an earlier run's), WarmOptions::hints (what DDP/FSDP
// import), then what this node's workers import as the agent learns it. A job that comes before they are done runs as
// soon as the import under way finishes, with what is loaded: a restart
// soon after a start or after another restart is warm as far as its
// interpreter got, never waiting for a whole list. Take records what the
// interpreter it hands out had (TakenState; the agent logs it).
//
// Forks (WarmOptions::fork, the default): the node's interpreter is not
// handed out but forks a copy of itself for each worker (warm_pool.cc's
// bootstrap says how the copy becomes the agent's child) and stays,
// preloading on: every start, the second of two restarts 2 s apart as much
// as the first, gets an interpreter with all it had imported, in ~30 ms a
// worker. A job's first start forks it too: the forks wait for its `import
// torch`, under way since the agent joined, so a node imports torch once,
// not once per local rank, and keeps one interpreter waiting, not one per
// local rank (each holds what torch and the preload take: hundreds of MB).
// An interpreter whose fork fails is handed out itself to the worker that
// asked (the log says why) and the node's other workers start cold.
//
// Threading: one thread (the agent's main loop), the same that forks the
// workers (PR_SET_PDEATHSIG).
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/subprocess.h"

namespace ballast::agent {

// The first variable that differs between two environments ("" if none), for messages.
std::string FirstDifference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b);

// The bootstrap program (`python -u -c` it); exposed for tests.
const char* WarmBootstrap();

struct WarmOptions {
  std::string python = "python3";
  std::vector<std::string> modules = {"torch"};  // imported before the interpreter waits
  // Run waiting interpreters (their imports included) at SCHED_IDLE, so
  // preparing the next start never takes CPU from the workers training now;
  // Take gives a taken one back the normal policy. Only where that is
  // allowed (CanRestoreNormalPriority()).
  bool low_priority = false;
  // Imported after `modules` by every interpreter, each a hint (one that
  // fails is skipped): what a job needs before anything was learned from
  // its workers (DistributedHints()); after the learned list when one is
  // known as the interpreter starts.
  std::vector<std::string> hints = {};
  // Start workers as forks of the waiting interpreters, which stay (above).
  // Needs this process to be a child subreaper (the pool makes it one).
  bool fork = true;
};

// What DDP and FSDP import, beyond `import torch`, before or in their first
// construction (torch 2.x: torch._dynamo, ~900 modules with sympy); names a
// torch lacks are skipped. The hints the agent gives its pool: a job's first
// restart, whose interpreters start before the workers could say what they
// import, gets what every DDP/FSDP job needs.
const std::vector<std::string>& DistributedHints();

// Whether this process may move a SCHED_IDLE child back to SCHED_OTHER
// (CAP_SYS_NICE, or an RLIMIT_NICE of 20 or more).
bool CanRestoreNormalPriority();

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

  // Starts a warm interpreter for local rank `lr` with `env` (the interpreter
  // environment) unless one with that environment waits already. No-op once
  // disabled.
  absl::Status Prepare(int lr, const std::map<std::string, std::string>& env);
  // Reads "ready" and notices interpreters that died (which disables the pool).
  void Poll();
  // Modules the workers imported after their start (WorkerGroup's learned
  // modules): the waiting interpreters import them now, and the ones started
  // later too. Failures are ignored (a hint, unlike WarmOptions::modules).
  void Preload(const std::vector<std::string>& modules);
  // Every module handed to Preload so far, in order.
  const std::vector<std::string>& preloaded() const { return learned_; }
  bool low_priority() const { return options_.low_priority; }

  // What a taken interpreter had imported when Take handed it out (its
  // imports under way finish before the script runs, the rest of its
  // preload is left to the script): for the log, and for tests.
  struct TakenState {
    int local_rank = 0;
    int pid = -1;
    double age_s = 0;          // since it was spawned
    std::string modules;       // WarmOptions::modules, ", "-joined ("torch")
    bool imported = false;     // ... imported
    bool forked = false;       // a fork of the waiting interpreter (which stays)
    bool hints_done = false;   // WarmOptions::hints tried (true when there are none)
    size_t hints = 0;
    size_t learned_done = 0;   // preloaded modules it tried (counted in messages of kPreloadChunk) ...
    size_t learned_sent = 0;   // ... of those sent to it
    // "torch imported, DDP/FSDP modules preloaded, 809 of 809 learned
    // modules preloaded, spawned 4.2 s before"
    std::string Describe() const;
  };
  // The states recorded by Take since the last call.
  std::vector<TakenState> TakeTakenStates();
  // Learned modules go out in messages of at most this many names, each
  // answered when its names were tried: what TakenState counts.
  static constexpr size_t kPreloadChunk = 100;
  // Asks for the forks of local ranks [0, n) (of interpreters that started
  // with `env`) at once, so they are made while the first is collected;
  // Take collects them. Optional (Take asks when not asked).
  void RequestForks(int n, const std::map<std::string, std::string>& env);
  // The waiting interpreter of `lr` (or a fork of it) when it started with
  // `env` (the new worker's interpreter environment), else nullopt with
  // *why_not set.
  std::optional<WarmProcess> Take(int lr, const std::map<std::string, std::string>& env, std::string* why_not);
  // Hands `process` its job: the full environment, cwd and argv (the script
  // and its arguments, or the module and its arguments). Non-blocking.
  static absl::Status Hand(WarmProcess* process, const std::map<std::string, std::string>& env,
                           const std::string& cwd, const std::vector<std::string>& argv, bool module);

  // Whether local rank lr's interpreter waits, its imports (the preloaded
  // modules too) done (after Poll).
  bool ready(int lr) const;
  // Whether it waits with WarmOptions::modules and hints imported (what
  // DDP/FSDP need), the modules learned later perhaps not yet.
  bool hints_ready(int lr) const;
  bool disabled() const { return !disabled_reason_.empty(); }
  const std::string& disabled_reason() const { return disabled_reason_; }

 private:
  struct Slot {
    std::optional<WarmProcess> warm;
    std::string handed_to;  // with forks: "local rank N", when it was handed out itself
    std::map<std::string, std::string> env;  // the interpreter environment it started with
    std::string buffer;                      // partial control-socket line
    size_t preload_sent = 0;                 // learned_[0, preload_sent) were sent to it
    struct Sent {
      size_t names = 0;
      bool hints = false;
    };
    std::deque<Sent> unanswered;  // preload messages not yet answered, in order
    bool hints_done = false;
    size_t learned_done = 0;
  };
  // A fork asked for (RequestForks) and not yet taken: the agent's ends of
  // the copy's stdout and stderr pipes and control socket.
  struct Fork {
    int out = -1, err = -1, control = -1;
    double asked_at_s = 0;
  };
  // The slot that serves local rank lr: the node's one interpreter with forks.
  int SlotOf(int lr) const { return fork_ ? 0 : lr; }
  // Asks lr's interpreter for a fork for lr (when forks are on; one still
  // importing reads the request once its imports of WarmOptions::modules end).
  void RequestFork(int lr);
  // Waits for lr's requested fork to say "forked <pid>": the copy, or
  // nullopt with *why_not set (the request is dropped).
  std::optional<Subprocess> CollectFork(int lr, std::string* why_not);
  void CloseFork(int lr);
  // Every requested fork not yet taken (their interpreter is gone or handed out).
  void CloseForks();
  // Stops the slot's interpreter (and, with forks, drops the forks asked of it).
  void Drop(Slot* slot);
  // Sends the learned modules the slot's interpreter has not been sent.
  void SendPreload(Slot* slot);
  // Sends one preload message.
  void Send(Slot* slot, const std::vector<std::string>& names, bool hints);

  const WarmOptions options_;
  std::map<int, Slot> slots_;
  std::map<int, Fork> forks_;  // by local rank
  std::vector<std::string> learned_;
  std::set<std::string> learned_set_;
  std::string disabled_reason_;
  std::vector<TakenState> taken_;
  bool fork_ = false;  // options_.fork, and this process is a child subreaper
  double strays_reaped_at_ = 0;
};

}  // namespace ballast::agent
