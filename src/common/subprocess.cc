#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace ballast {
namespace {

// The children a Subprocess owns (spawned or adopted, not yet reaped):
// ReapStrayChildren leaves them to their owners. Spawn holds the lock from
// before its fork until the pid is in, so no child is ever seen unowned.
std::mutex& OwnedMutex() {
  static std::mutex m;
  return m;
}
std::set<pid_t>& Owned() {
  static std::set<pid_t> owned;
  return owned;
}
void Disown(pid_t pid) {
  std::lock_guard<std::mutex> lock(OwnedMutex());
  Owned().erase(pid);
}

}  // namespace

std::string SignalName(int sig) {
  switch (sig) {
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGHUP: return "SIGHUP";
    case SIGPIPE: return "SIGPIPE";
    case SIGQUIT: return "SIGQUIT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    default: return absl::StrCat("signal ", sig);
  }
}

std::string ExitStatus::Describe() const {
  if (signal != 0) return absl::StrCat("killed by ", SignalName(signal), " (signal ", signal, ")");
  return absl::StrCat("exit code ", exit_code);
}

ExitStatus DecodeWaitStatus(int wstatus) {
  ExitStatus s;
  if (WIFEXITED(wstatus)) {
    s.exit_code = WEXITSTATUS(wstatus);
  } else if (WIFSIGNALED(wstatus)) {
    s.signal = WTERMSIG(wstatus);
  }
  return s;
}

bool ProcessAlive(pid_t pid) {
  if (pid <= 0) return false;
  std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return false;
  char buf[512] = {};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  // Format: pid (comm) state ...; comm may hold spaces or ')', so find the last ')'.
  std::string stat(buf, n);
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  char state = stat[close + 2];
  return state != 'Z' && state != 'X';
}

std::map<std::string, std::string> CurrentEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq == nullptr) continue;
    env.emplace(std::string(*e, eq - *e), std::string(eq + 1));
  }
  return env;
}

std::string SelfExePath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "ballast";
  buf[n] = '\0';
  return buf;
}

absl::StatusOr<Subprocess> Subprocess::Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("Spawn: empty argv");
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  int exec_err[2] = {-1, -1};  // reports exec failure back to the parent (CLOEXEC)
  int control[2] = {-1, -1};   // [0] parent, [1] child (becomes kControlFd)
  auto close_all = [&] {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1], exec_err[0], exec_err[1], control[0],
                   control[1]})
      if (fd >= 0) close(fd);
  };
  if ((options.pipe_stdout && pipe2(out_pipe, O_CLOEXEC) != 0) ||
      (options.pipe_stderr && pipe2(err_pipe, O_CLOEXEC) != 0) || pipe2(exec_err, O_CLOEXEC) != 0 ||
      (options.control_socket && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0)) {
    close_all();
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  // Build argv/envp before fork: no allocation in the child.
  std::vector<char*> argv;
  for (const auto& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : options.env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t parent = getpid();

  std::unique_lock<std::mutex> owned_lock(OwnedMutex());
  pid_t pid = fork();
  if (pid < 0) {
    owned_lock.unlock();
    close_all();
    return absl::ResourceExhaustedError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls from here on.
    if (options.new_process_group) setpgid(0, 0);
    if (options.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // parent already gone
    }
    // Restore default signal dispositions and an empty mask for the new program.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGCHLD, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2})
      signal(sig, SIG_DFL);
    if (options.pipe_stdout) dup2(out_pipe[1], STDOUT_FILENO);
    else if (!options.stdout_file.empty()) {
      int fd = open(options.stdout_file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) { dup2(fd, STDOUT_FILENO); close(fd); }
    }
    if (options.stderr_to_stdout) dup2(STDOUT_FILENO, STDERR_FILENO);
    else if (options.pipe_stderr) dup2(err_pipe[1], STDERR_FILENO);
    else if (!options.stderr_file.empty()) {
      int fd = open(options.stderr_file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) { dup2(fd, STDERR_FILENO); close(fd); }
    }
    if (options.control_socket) {
      // dup2 clears close-on-exec on the copy; when the fd already is 3, clear it by hand.
      if (control[1] == kControlFd) {
        fcntl(kControlFd, F_SETFD, 0);
      } else {
        dup2(control[1], kControlFd);
      }
    }
    if (!options.cwd.empty() && chdir(options.cwd.c_str()) != 0) {
      int e = errno;
      (void)!write(exec_err[1], &e, sizeof(e));
      _exit(127);
    }
    execvpe(argv[0], argv.data(), envp.data());
    int e = errno;
    (void)!write(exec_err[1], &e, sizeof(e));
    _exit(127);
  }
  // Parent. Also set the group from this side to close the race where we signal
  // the group before the child ran setpgid.
  Owned().insert(pid);
  owned_lock.unlock();
  if (options.new_process_group) setpgid(pid, pid);
  close(exec_err[1]);
  exec_err[1] = -1;
  if (out_pipe[1] >= 0) { close(out_pipe[1]); out_pipe[1] = -1; }
  if (err_pipe[1] >= 0) { close(err_pipe[1]); err_pipe[1] = -1; }
  if (control[1] >= 0) { close(control[1]); control[1] = -1; }
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(exec_err[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(exec_err[0]);
  exec_err[0] = -1;
  if (n == sizeof(child_errno)) {
    int ws;
    waitpid(pid, &ws, 0);
    Disown(pid);
    if (out_pipe[0] >= 0) close(out_pipe[0]);
    if (err_pipe[0] >= 0) close(err_pipe[0]);
    if (control[0] >= 0) close(control[0]);
    return absl::NotFoundError(absl::StrCat("cannot start '", options.argv[0], "': ",
                                            std::strerror(child_errno),
                                            " (check the program name and PATH)"));
  }
  return Adopt(pid, options.new_process_group, out_pipe[0], err_pipe[0], control[0]);
}

Subprocess::Subprocess(Subprocess&& o) noexcept { *this = std::move(o); }

Subprocess& Subprocess::operator=(Subprocess&& o) noexcept {
  if (this != &o) {
    if (running()) Terminate(0);
    ClosePipes();
    pid_ = o.pid_;
    own_group_ = o.own_group_;
    stdout_fd_ = o.stdout_fd_;
    stderr_fd_ = o.stderr_fd_;
    control_fd_ = o.control_fd_;
    status_ = o.status_;
    o.pid_ = -1;
    o.stdout_fd_ = o.stderr_fd_ = o.control_fd_ = -1;
    o.status_.reset();
  }
  return *this;
}

Subprocess::~Subprocess() {
  if (running()) Terminate(0);
  ClosePipes();
}

void Subprocess::ClosePipes() {
  if (stdout_fd_ >= 0) close(stdout_fd_);
  if (stderr_fd_ >= 0) close(stderr_fd_);
  if (control_fd_ >= 0) close(control_fd_);
  stdout_fd_ = stderr_fd_ = control_fd_ = -1;
}

Subprocess Subprocess::Adopt(pid_t pid, bool own_group, int stdout_fd, int stderr_fd, int control_fd) {
  {
    std::lock_guard<std::mutex> lock(OwnedMutex());
    Owned().insert(pid);
  }
  Subprocess p;
  p.pid_ = pid;
  p.own_group_ = own_group;
  p.stdout_fd_ = stdout_fd;
  p.stderr_fd_ = stderr_fd;
  p.control_fd_ = control_fd;
  return p;
}

absl::Status BecomeChildSubreaper() {
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
    return absl::InternalError(absl::StrCat("prctl(PR_SET_CHILD_SUBREAPER): ", std::strerror(errno)));
  return absl::OkStatus();
}

int ReapStrayChildren() {
  // This process's children, from every thread's list (a child belongs to
  // the thread that forked it, or to the process when reparented here).
  std::vector<pid_t> children;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream in(task.path() / "children");
    pid_t pid = 0;
    while (in >> pid) children.push_back(pid);
  }
  int reaped = 0;
  std::lock_guard<std::mutex> lock(OwnedMutex());
  for (pid_t pid : children) {
    if (Owned().count(pid) != 0) continue;
    int ws = 0;
    if (waitpid(pid, &ws, WNOHANG) == pid) ++reaped;
  }
  return reaped;
}

pid_t Subprocess::Release() {
  pid_t p = pid_;
  pid_ = -1;
  return p;
}

std::optional<ExitStatus> Subprocess::Poll() {
  if (status_.has_value() || pid_ <= 0) return status_;
  int ws = 0;
  pid_t r = waitpid(pid_, &ws, WNOHANG);
  if (r == pid_) {
    status_ = DecodeWaitStatus(ws);
    Disown(pid_);
  } else if (r < 0 && errno == ECHILD) {
    // Not (or no longer) this process's child: its status is lost. Ended
    // all the same; say so rather than wait forever.
    status_ = ExitStatus{255, 0};
    Disown(pid_);
  }
  return status_;
}

std::optional<ExitStatus> Subprocess::Wait(double timeout_s) {
  if (status_.has_value() || pid_ <= 0) return status_;
  if (timeout_s < 0) {
    int ws = 0;
    pid_t r;
    do {
      r = waitpid(pid_, &ws, 0);
    } while (r < 0 && errno == EINTR);
    if (r == pid_) status_ = DecodeWaitStatus(ws);
    else if (r < 0 && errno == ECHILD) status_ = ExitStatus{255, 0};
    if (status_.has_value()) Disown(pid_);
    return status_;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    if (Poll().has_value()) return status_;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void Subprocess::Signal(int sig) {
  if (pid_ <= 0) return;
  // Signal the group even after the leader exited: its children may remain.
  if (own_group_) kill(-pid_, sig);
  if (!status_.has_value()) kill(pid_, sig);
}

ExitStatus Subprocess::Terminate(double grace_s) {
  if (pid_ <= 0) return ExitStatus{};
  if (status_.has_value()) {
    if (own_group_) kill(-pid_, SIGKILL);  // leftovers of the group
    return *status_;
  }
  if (grace_s > 0) {
    Signal(SIGTERM);
    if (Wait(grace_s).has_value()) {
      if (own_group_) kill(-pid_, SIGKILL);
      return *status_;
    }
  }
  Signal(SIGKILL);
  Wait(-1);
  return status_.value_or(ExitStatus{});
}

std::string CommandResult::LastLine() const {
  std::string tail = err.empty() ? out : err;
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) tail.pop_back();
  if (const size_t nl = tail.rfind('\n'); nl != std::string::npos) tail = tail.substr(nl + 1);
  return tail;
}

std::string CommandResult::Describe(const std::string& what) const {
  const std::string tail = LastLine();
  return absl::StrCat(what, " failed (", status.Describe(), ")", tail.empty() ? "" : ": ", tail);
}

absl::StatusOr<CommandResult> RunCapture(const std::vector<std::string>& argv, double timeout_s,
                                         const std::map<std::string, std::string>& extra_env) {
  SpawnOptions so;
  so.argv = argv;
  so.env = CurrentEnvironment();
  for (const auto& [k, v] : extra_env) so.env[k] = v;
  so.pipe_stdout = true;
  so.pipe_stderr = true;
  auto proc = Subprocess::Spawn(so);
  if (!proc.ok()) return proc.status();
  CommandResult r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  pollfd fds[2] = {{proc->stdout_fd(), POLLIN, 0}, {proc->stderr_fd(), POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  char buf[4096];
  while (open_fds > 0) {
    const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      proc->Terminate(0);
      return absl::DeadlineExceededError(
          absl::StrCat("`", argv.empty() ? "" : argv[0], "` did not finish within ", timeout_s, " s"));
    }
    const int n = ::poll(fds, 2, static_cast<int>(left * 1000) + 1);
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        sinks[i]->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        fds[i].fd = -1;  // closed; the Subprocess owns and closes it
        --open_fds;
      }
    }
  }
  const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
  std::optional<ExitStatus> st = proc->Wait(std::max(left, 0.0));
  if (!st.has_value()) {
    proc->Terminate(0);
    return absl::DeadlineExceededError(
        absl::StrCat("`", argv.empty() ? "" : argv[0], "` did not finish within ", timeout_s, " s"));
  }
  r.status = *st;
  return r;
}

std::vector<std::string> ReadControlLines(int fd, std::string* buffer, bool* closed) {
  std::vector<std::string> lines;
  *closed = false;
  if (fd < 0) return lines;
  char buf[4096];
  while (true) {
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      buffer->append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) *closed = true;
    break;  // EAGAIN, EOF or an error
  }
  size_t start = 0;
  while (true) {
    size_t nl = buffer->find('\n', start);
    if (nl == std::string::npos) break;
    lines.push_back(buffer->substr(start, nl - start));
    start = nl + 1;
  }
  buffer->erase(0, start);
  return lines;
}

}  // namespace ballast
