// Starting, signalling and reaping child processes (workers, agents, test
// subjects). Plain fork/exec with the options process supervision needs:
//  - its own process group, so a stop reaches the child's own children too;
//  - PR_SET_PDEATHSIG, so the child is killed when its parent dies, even by
//    SIGKILL (the "no orphan" guarantee). Note: the death signal fires when the
//    *thread* that forked exits, so fork from a thread that lives as long as the
//    supervisor (Spawn documents this).
//  - optional pipes for stdout/stderr, read by the caller.
// Thread safety: the free functions are thread-safe; a Subprocess object is not.
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ballast {

struct SpawnOptions {
  std::vector<std::string> argv;                 // argv[0] is looked up on PATH
  std::map<std::string, std::string> env;        // the complete environment
  std::string cwd;                               // empty: inherit
  bool new_process_group = true;                 // setpgid(0, 0) in the child
  bool die_with_parent = true;                   // PR_SET_PDEATHSIG(SIGKILL)
  bool pipe_stdout = false;                      // else inherit
  bool pipe_stderr = false;                      // else inherit
  bool stderr_to_stdout = false;                 // dup2(stdout, stderr) after setup
  std::string stdout_file;                       // if set (and no pipe): append to this file
  std::string stderr_file;
  // A socketpair to talk to the child: the child gets its end as fd 3
  // (kControlFd), the parent keeps the other (control_fd()).
  bool control_socket = false;
};

// The child's end of SpawnOptions::control_socket.
inline constexpr int kControlFd = 3;

struct ExitStatus {
  int exit_code = 0;  // valid when signal == 0
  int signal = 0;     // terminating signal, 0 if it exited normally
  bool ok() const { return signal == 0 && exit_code == 0; }
  // "exit code 3", "SIGKILL (signal 9)"
  std::string Describe() const;
  // Shell-style code: exit_code, or 128 + signal.
  int ShellCode() const { return signal != 0 ? 128 + signal : exit_code; }
};

// A started child. Destroying a still-running Subprocess kills its process
// group with SIGKILL and reaps it (RAII: nothing is left behind).
class Subprocess {
 public:
  static absl::StatusOr<Subprocess> Spawn(const SpawnOptions& options);

  Subprocess() = default;
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  int stdout_fd() const { return stdout_fd_; }  // -1 unless piped; owned by this object
  int stderr_fd() const { return stderr_fd_; }
  int control_fd() const { return control_fd_; }  // -1 unless control_socket; owned
  bool running() const { return pid_ > 0 && !status_.has_value(); }
  const std::optional<ExitStatus>& status() const { return status_; }

  // Non-blocking reap. Returns the exit status once the child has exited.
  std::optional<ExitStatus> Poll();
  // Blocking reap, up to timeout_s (< 0: forever).
  std::optional<ExitStatus> Wait(double timeout_s = -1);
  // Sends sig to the child's process group (or the child when it has none).
  void Signal(int sig);
  // SIGTERM to the group, wait up to grace_s, then SIGKILL and reap.
  ExitStatus Terminate(double grace_s);
  // Closes the pipe fds (e.g. after a reader thread drained them).
  void ClosePipes();
  // Gives up ownership without killing (the pid stays a child of this process).
  pid_t Release();
  // Takes over a child this process did not fork: one a warm interpreter
  // forked that the kernel reparented here (BecomeChildSubreaper), with the
  // parent's ends of its pipes and control socket (each -1 if none). It
  // must already be this process's child (waitpid reaps it). own_group: it
  // leads its own process group.
  static Subprocess Adopt(pid_t pid, bool own_group, int stdout_fd, int stderr_fd, int control_fd);

 private:
  pid_t pid_ = -1;
  bool own_group_ = false;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  int control_fd_ = -1;
  std::optional<ExitStatus> status_;
};

// What a short command printed and how it ended (RunCapture).
struct CommandResult {
  ExitStatus status;
  std::string out;  // stdout
  std::string err;  // stderr
  bool ok() const { return status.ok(); }
  // The last line it printed on stderr (stdout when stderr is empty).
  std::string LastLine() const;
  // "`argv0` failed (exit code 1): <stderr's last line>"
  std::string Describe(const std::string& what) const;
};

// Runs argv (looked up on PATH) with the current environment plus `extra_env`
// to its end, capturing stdout and stderr. The command is killed (SIGKILL to
// its group) after timeout_s; kDeadlineExceeded then, kNotFound-like errors
// when it cannot be started. Blocks the calling thread.
absl::StatusOr<CommandResult> RunCapture(const std::vector<std::string>& argv, double timeout_s,
                                         const std::map<std::string, std::string>& extra_env = {});

// Makes this process the reaper of its descendants' orphans
// (PR_SET_CHILD_SUBREAPER): a process one of its children forks twice comes
// back to it as its own child (how a warm interpreter's fork becomes the
// agent's worker). Orphans that no Subprocess owns are then reaped by
// ReapStrayChildren.
absl::Status BecomeChildSubreaper();
// Reaps the children of this process that exited and that no Subprocess
// owns (orphans reparented here); returns how many. Thread-safe with Spawn
// and Adopt (a child they create is owned before this can see it).
int ReapStrayChildren();

// Decodes a waitpid status.
ExitStatus DecodeWaitStatus(int wstatus);
// "SIGKILL" for 9; "signal 77" for unknown ones.
std::string SignalName(int sig);
// True while pid exists and is not a zombie (reads /proc/<pid>/stat).
bool ProcessAlive(pid_t pid);
// The current process environment as a map.
std::map<std::string, std::string> CurrentEnvironment();
// Absolute path of the running executable (/proc/self/exe).
std::string SelfExePath();

// Reads the whole lines a peer wrote on a socket (non-blocking: what has
// arrived), e.g. a control socket's "ready <t>"; keeps a partial line in
// *buffer for the next call. *closed: the peer closed its end.
std::vector<std::string> ReadControlLines(int fd, std::string* buffer, bool* closed);

}  // namespace ballast
