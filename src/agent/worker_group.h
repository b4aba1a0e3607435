// The node's workers for one round: starts local_world_size processes with the
// torchrun environment, forwards their output, reaps them, and stops them.
//
// Ownership: a WorkerGroup owns its Subprocess objects, their pipes, the log
// files and one reader thread per started round (a poll() loop over every
// worker's stdout/stderr pipe).
//
// Threading: Start/Poll/Stop/Workers must all be called from ONE long-lived
// thread (the agent's main loop). Workers are spawned with PR_SET_PDEATHSIG,
// which fires when the *forking thread* exits, so forking from a short-lived
// thread would kill the workers with it. The reader thread only touches the
// output state, which is guarded by a mutex. Destroying the group stops it
// with no grace (SIGKILL).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "agent/warm_pool.h"
#include "common/subprocess.h"

namespace ballast::agent {

// What every worker of the node runs, independent of the round.
struct WorkerSpec {
  // The command: identical for every local rank (torchrun passes no per-rank args).
  std::vector<std::string> argv;
  // The environment the workers inherit (the user's, and what the agent adds
  // for its whole life, e.g. PYTHONPATH): a warm interpreter starts with it.
  std::map<std::string, std::string> base_env;
  // Extra variables for local rank i (index i; may be shorter than the local
  // world size), e.g. BALLAST_CKPT_SHM, BALLAST_CKPT_REPLICAS: like the
  // torchrun variables they come with each start (a warm interpreter gets
  // them with its job), so they may change from round to round.
  std::vector<std::map<std::string, std::string>> local_rank_env;
  std::string role = "default";
  std::string node_id;
  // Output: when log_dir is set, each worker's stdout/stderr is written to
  // <log_dir>/<run_id>/attempt_<restart>/<local_rank>/{stdout,stderr}.log.
  std::string log_dir;
  // torchrun's -r/--redirects and -t/--tee: "0".."3" or "LOCAL_RANK:N,...";
  // bit 1 = stdout, bit 2 = stderr. Redirected streams go to the log files only,
  // teed ones to both (console lines prefixed "[<role><rank>]:").
  std::string redirects = "0";
  std::string tee = "0";
  // Where forwarded worker output goes (not owned; the agent's own stdout/stderr).
  int console_stdout_fd = 1;
  int console_stderr_fd = 2;
  int stderr_tail_lines = 20;
  // Warm starts (warm_pool.h): each worker is first offered to this pool (not
  // owned; null: always cold), which runs script_argv (the script, or with
  // module the module, and its arguments).
  WarmPool* warm = nullptr;
  std::vector<std::string> script_argv;
  bool module = false;
};

// The round the workers are started into (from the master's StartRound).
struct RoundSpec {
  int64_t round = 0;
  int group_rank = 0;
  int group_world_size = 1;
  int rank_offset = 0;
  int world_size = 1;
  int local_world_size = 1;
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;
  std::string master_addr;
  int master_port = 0;
  // Other variables of the round (e.g. BALLAST_ON_NAN, BALLAST_SKIP_DATA): they
  // come with each start, like RANK, so a warm interpreter gets them too.
  std::map<std::string, std::string> env;
};

struct WorkerEvent {
  enum class Kind { kFailed, kAllSucceeded };
  Kind kind = Kind::kFailed;
  int64_t round = 0;
  int local_rank = -1;   // kFailed only
  int global_rank = -1;  // kFailed only
  pid_t pid = -1;
  ExitStatus status;
  std::string stderr_tail;  // last stderr_tail_lines lines, '\n'-joined
};

// Where a worker is in its life (HeartbeatRequest.workers carries its name).
enum class WorkerState { kRunning, kSucceeded, kFailed, kStopped };
// "running", "succeeded", "failed", "stopped".
const char* WorkerStateName(WorkerState state);

struct WorkerInfo {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;
  WorkerState state = WorkerState::kRunning;
  bool warm = false;  // started in a warm interpreter
  // From a warm worker's bootstrap (CLOCK_MONOTONIC seconds, -1 unknown):
  // init_process_group called and returned.
  double pg_call_s = -1;
  double pg_up_s = -1;
};

// What a worker's interpreter starts with, for any round: base_env and the
// agent's constants (BALLAST_NODE_ID, PYTHONUNBUFFERED, OMP_NUM_THREADS=1
// unless set).
std::map<std::string, std::string> InterpreterEnvironment(const WorkerSpec& spec);
// The environment of one worker: the interpreter environment, the local
// rank's extra variables and the torchrun variables of the round.
std::map<std::string, std::string> WorkerEnvironment(const WorkerSpec& spec, const RoundSpec& round,
                                                     int local_rank);

class WorkerGroup {
 public:
  explicit WorkerGroup(WorkerSpec spec);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts round.local_world_size workers. Workers of an earlier Start must have
  // been stopped (it stops them with no grace otherwise). On a spawn error the
  // already started ones are killed and the error returned (e.g. kNotFound for
  // a missing interpreter).
  absl::Status Start(const RoundSpec& round);

  // Reaps exited workers. Returns one kFailed event per worker that exited
  // non-zero or was killed (each reported once, with its stderr tail complete:
  // waits up to 1 s for the worker's pipes to close), and one kAllSucceeded
  // once every worker exited 0.
  std::vector<WorkerEvent> Poll();

  // SIGTERM to every worker's process group, SIGKILL after grace_s (or at once
  // when *kill_now becomes true), reap, drain and join the reader: nothing is
  // left running. Idempotent.
  void Stop(double grace_s, const std::atomic<bool>* kill_now = nullptr);

  // Replaces spec.local_rank_env; takes effect at the next Start.
  void set_local_rank_env(std::vector<std::map<std::string, std::string>> env) {
    spec_.local_rank_env = std::move(env);
  }

  // How the current round's workers started: "warm (2 of 2)", or
  // "cold (local rank 0: why; ...)" / "1 warm, 1 cold (...)".
  const std::string& start_summary() const { return start_summary_; }
  // Reads what warm workers' bootstraps report (init_process_group times,
  // the modules they imported).
  void ReadControl();
  // Asks every warm worker which library modules it has imported; the
  // answers arrive through ReadControl.
  void RequestModules();
  // The modules the warm workers named since the last call (new names only,
  // in import order).
  std::vector<std::string> TakeLearnedModules();
  // What a warm interpreter starts with (InterpreterEnvironment); the round's
  // and the local rank's variables come with its job.
  std::map<std::string, std::string> InterpreterEnvironment() const;

  // True while any worker of the current round has not been reaped.
  bool AnyRunning() const;
  bool started() const { return !workers_.empty(); }
  int64_t round() const { return round_.round; }
  std::vector<WorkerInfo> Workers() const;
  // Captures the stderr lines a worker of the current round writes from now
  // on (at most kMaxCaptureLines), e.g. a stack dump it prints on a signal;
  // TakeStderrCapture returns them ('\n'-joined) and ends the capture. Only
  // for workers whose stderr is read (not redirected to a file only).
  static constexpr size_t kMaxCaptureLines = 400;
  void StartStderrCapture(int local_rank);
  std::string TakeStderrCapture(int local_rank);
  // Lines captured so far (0 when not capturing).
  size_t CapturedLines(int local_rank) const;
  // Directory of the current attempt's log files ("" when none are written).
  const std::string& attempt_log_dir() const { return attempt_log_dir_; }

 private:
  struct Stream;  // one pipe: buffering, forwarding, log file
  struct Worker {
    int local_rank = 0;
    int global_rank = 0;
    pid_t pid = -1;
    Subprocess process;
    WorkerState state = WorkerState::kRunning;
    bool reported = false;
    Stream* out = nullptr;  // owned by streams_
    Stream* err = nullptr;
    bool warm = false;
    std::string control_buffer;
    double pg_call_s = -1, pg_up_s = -1;
  };

  void ReaderLoop();
  void StopReader(double drain_s);
  // Waits up to timeout_s for both pipes of w to reach EOF.
  void WaitForEof(const Worker& w, double timeout_s);
  std::string StderrTail(const Worker& w);

  WorkerSpec spec_;
  RoundSpec round_;
  std::string attempt_log_dir_;
  std::vector<Worker> workers_;
  std::vector<Worker> final_states_;  // after Stop: the last states, for Workers()
  bool all_succeeded_reported_ = false;
  std::string start_summary_;
  std::vector<std::string> learned_new_;  // TakeLearnedModules
  std::set<std::string> learned_seen_;

  mutable std::mutex mu_;  // guards the Stream state shared with the reader thread
  std::condition_variable eof_cv_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::thread reader_;
  int wake_pipe_[2] = {-1, -1};  // wakes the reader's poll() to exit
  std::atomic<bool> reader_stop_{false};
};

}  // namespace ballast::agent
