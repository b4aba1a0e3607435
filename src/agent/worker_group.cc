#include "agent/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

using Clock = std::chrono::steady_clock;

// A line longer than this is forwarded in pieces (a worker printing without
// newlines must not grow the agent's memory without bound).
constexpr size_t kMaxLine = 64 * 1024;

// The torchrun redirect/tee value ("3" or "0:1,1:2") for one local rank.
int StdBits(const std::string& value, int local_rank) {
  int bits = 0;
  if (value.find(':') == std::string::npos) {
    (void)absl::SimpleAtoi(value, &bits);
    return bits;
  }
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    std::vector<std::string> kv = absl::StrSplit(item, ':');
    int rank = -1, v = 0;
    if (kv.size() == 2 && absl::SimpleAtoi(kv[0], &rank) && rank == local_rank && absl::SimpleAtoi(kv[1], &v))
      bits = v;
  }
  return bits;
}

void WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // console gone (EPIPE) or file error: output is best effort
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

struct WorkerGroup::Stream {
  int fd = -1;             // read end of the worker's pipe (owned by the Subprocess)
  int console_fd = -1;     // -1: not forwarded to the console
  int log_fd = -1;         // owned; -1: no log file
  std::string prefix;      // console line prefix ("" = raw)
  bool keep_tail = false;  // stderr: keep the last lines for the failure report
  size_t tail_lines = 0;
  std::string partial;     // reader thread only
  // Guarded by WorkerGroup::mu_.
  std::deque<std::string> tail;
  std::optional<std::vector<std::string>> capture;  // StartStderrCapture .. TakeStderrCapture
  bool eof = false;

  ~Stream() {
    if (log_fd >= 0) close(log_fd);
  }
};

std::map<std::string, std::string> InterpreterEnvironment(const WorkerSpec& spec) {
  std::map<std::string, std::string> env = spec.base_env;
  env["BALLAST_NODE_ID"] = spec.node_id;
  env["PYTHONUNBUFFERED"] = "1";
  // torchrun's default: one OpenMP thread per worker unless the user chose
  // (an empty value is no choice: OpenMP would ignore it).
  if (auto it = env.find("OMP_NUM_THREADS"); it == env.end() || it->second.empty()) {
    env["OMP_NUM_THREADS"] = "1";
  }
  return env;
}

std::map<std::string, std::string> WorkerEnvironment(const WorkerSpec& spec, const RoundSpec& round,
                                                     int local_rank) {
  std::map<std::string, std::string> env = InterpreterEnvironment(spec);
  if (local_rank >= 0 && static_cast<size_t>(local_rank) < spec.local_rank_env.size()) {
    for (const auto& [k, v] : spec.local_rank_env[local_rank]) env[k] = v;
  }
  for (const auto& [k, v] : round.env) env[k] = v;
  int rank = round.rank_offset + local_rank;
  env["RANK"] = absl::StrCat(rank);
  env["LOCAL_RANK"] = absl::StrCat(local_rank);
  env["WORLD_SIZE"] = absl::StrCat(round.world_size);
  env["LOCAL_WORLD_SIZE"] = absl::StrCat(round.local_world_size);
  env["GROUP_RANK"] = absl::StrCat(round.group_rank);
  env["GROUP_WORLD_SIZE"] = absl::StrCat(round.group_world_size);
  env["ROLE_RANK"] = absl::StrCat(rank);
  env["ROLE_NAME"] = spec.role;
  env["ROLE_WORLD_SIZE"] = absl::StrCat(round.world_size);
  env["MASTER_ADDR"] = round.master_addr;
  env["MASTER_PORT"] = absl::StrCat(round.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = absl::StrCat(round.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = absl::StrCat(round.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = round.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  env["BALLAST_ROUND"] = absl::StrCat(round.round);
  return env;
}

WorkerGroup::WorkerGroup(WorkerSpec spec) : spec_(std::move(spec)) {}

std::map<std::string, std::string> WorkerGroup::InterpreterEnvironment() const {
  return agent::InterpreterEnvironment(spec_);
}

void WorkerGroup::ReadControl() {
  for (Worker& w : workers_) {
    if (!w.warm || w.process.control_fd() < 0) continue;
    bool closed = false;
    for (const std::string& line : ReadControlLines(w.process.control_fd(), &w.control_buffer, &closed)) {
      if (absl::StartsWith(line, "modules ")) {
        nlohmann::json names = nlohmann::json::parse(line.substr(8), nullptr, /*allow_exceptions=*/false);
        if (!names.is_array()) continue;
        for (const nlohmann::json& n : names) {
          if (n.is_string() && learned_seen_.insert(n.get<std::string>()).second) learned_new_.push_back(n);
        }
        continue;
      }
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      if (f.size() == 3 && f[0] == "pg") {
        (void)absl::SimpleAtod(f[1], &w.pg_call_s);
        (void)absl::SimpleAtod(f[2], &w.pg_up_s);
      }
    }
  }
}

void WorkerGroup::RequestModules() {
  static constexpr char kAsk[] = "{\"modules\": true}\n";
  for (Worker& w : workers_) {
    if (!w.warm || w.state != WorkerState::kRunning || w.process.control_fd() < 0) continue;
    // Non-blocking: a worker that reads nothing any more loses the question.
    (void)send(w.process.control_fd(), kAsk, sizeof(kAsk) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
}

std::vector<std::string> WorkerGroup::TakeLearnedModules() {
  std::vector<std::string> out;
  out.swap(learned_new_);
  return out;
}

WorkerGroup::~WorkerGroup() { Stop(0); }

absl::Status WorkerGroup::Start(const RoundSpec& round) {
  if (started()) Stop(0);
  round_ = round;
  all_succeeded_reported_ = false;
  attempt_log_dir_.clear();
  final_states_.clear();

  bool any_redirect = false;
  for (int lr = 0; lr < round.local_world_size; ++lr)
    any_redirect |= StdBits(spec_.redirects, lr) != 0 || StdBits(spec_.tee, lr) != 0;
  std::string log_root = spec_.log_dir;
  if (log_root.empty() && any_redirect) {
    // torchrun also writes redirected output to a temporary directory when no --log-dir is given.
    log_root = (std::filesystem::temp_directory_path() / "ballast-logs").string();
  }
  if (!log_root.empty()) {
    attempt_log_dir_ = (std::filesystem::path(log_root) / (round.run_id.empty() ? "none" : round.run_id) /
                        absl::StrCat("attempt_", round.restart_count))
                           .string();
  }

  if (pipe2(wake_pipe_, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));

  workers_.reserve(round.local_world_size);
  // A cold worker inherits the agent's cwd; a warm one is told it.
  std::string cwd = std::filesystem::current_path().string();
  std::vector<std::string> cold_why;
  int warm_count = 0;
  // The warm interpreters fork side by side; each worker below collects its copy.
  if (spec_.warm != nullptr) spec_.warm->RequestForks(round.local_world_size, agent::InterpreterEnvironment(spec_));
  for (int lr = 0; lr < round.local_world_size; ++lr) {
    int redirect = StdBits(spec_.redirects, lr);
    int tee = StdBits(spec_.tee, lr);
    auto make_stream = [&](bool is_stderr) -> absl::StatusOr<Stream*> {
      auto s = std::make_unique<Stream>();
      int bit = is_stderr ? 2 : 1;
      // Redirected: log file only. Teed: console (prefixed) and log file.
      if ((redirect & bit) == 0 || (tee & bit) != 0)
        s->console_fd = is_stderr ? spec_.console_stderr_fd : spec_.console_stdout_fd;
      if ((tee & bit) != 0) s->prefix = absl::StrCat("[", spec_.role, round.rank_offset + lr, "]:");
      s->keep_tail = is_stderr;
      s->tail_lines = static_cast<size_t>(std::max(0, spec_.stderr_tail_lines));
      if (!attempt_log_dir_.empty()) {
        auto dir = std::filesystem::path(attempt_log_dir_) / absl::StrCat(lr);
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        std::string file = (dir / (is_stderr ? "stderr.log" : "stdout.log")).string();
        s->log_fd = open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (s->log_fd < 0)
          return absl::PermissionDeniedError(
              absl::StrCat("cannot write worker log ", file, ": ", std::strerror(errno), " (check --log-dir)"));
      }
      Stream* raw = s.get();
      streams_.push_back(std::move(s));
      return raw;
    };
    auto out = make_stream(false);
    auto err = out.ok() ? make_stream(true) : out;
    absl::Status st = err.ok() ? absl::OkStatus() : err.status();
    std::optional<Subprocess> proc;
    bool warm = false;
    if (st.ok()) {
      std::map<std::string, std::string> env = WorkerEnvironment(spec_, round, lr);
      if (spec_.warm != nullptr) {
        std::string why;
        std::optional<WarmProcess> taken = spec_.warm->Take(lr, agent::InterpreterEnvironment(spec_), &why);
        if (taken.has_value()) {
          absl::Status handed = WarmPool::Hand(&*taken, env, cwd, spec_.script_argv, spec_.module);
          if (handed.ok()) {
            proc = std::move(taken->process);
            warm = true;
          } else {
            why = std::string(handed.message());
          }
        }
        if (!warm) cold_why.push_back(absl::StrCat("local rank ", lr, ": ", why));
      }
      if (!proc.has_value()) {
        SpawnOptions so;
        so.argv = spec_.argv;
        so.env = std::move(env);
        so.new_process_group = true;
        so.die_with_parent = true;
        so.pipe_stdout = true;
        so.pipe_stderr = true;
        auto spawned = Subprocess::Spawn(so);
        if (spawned.ok()) {
          proc = std::move(*spawned);
        } else {
          st = spawned.status();
        }
      }
    }
    if (!st.ok()) {
      // No reader runs yet: kill what was started, then clean up like Stop.
      reader_stop_ = true;
      Stop(0);
      return st;
    }
    Worker w;
    w.local_rank = lr;
    w.global_rank = round.rank_offset + lr;
    w.out = *out;
    w.err = *err;
    w.out->fd = proc->stdout_fd();
    w.err->fd = proc->stderr_fd();
    w.pid = proc->pid();
    w.warm = warm;
    w.process = std::move(*proc);
    workers_.push_back(std::move(w));
    warm_count += warm ? 1 : 0;
  }
  const int n = round.local_world_size;
  if (spec_.warm == nullptr) {
    start_summary_ = "cold";
  } else if (warm_count == n) {
    start_summary_ = absl::StrCat("warm (", n, " of ", n, ")");
  } else {
    start_summary_ = absl::StrCat(warm_count == 0 ? "cold" : absl::StrCat(warm_count, " warm, ", n - warm_count,
                                                                            " cold"),
                                  " (", absl::StrJoin(cold_why, "; "), ")");
  }
  reader_stop_ = false;
  reader_ = std::thread([this] { ReaderLoop(); });
  return absl::OkStatus();
}

void WorkerGroup::ReaderLoop() {
  std::vector<Stream*> open;
  for (auto& s : streams_)
    if (s->fd >= 0) open.push_back(s.get());
  char buf[16384];
  auto emit = [](Stream* s, const std::string& line, std::vector<std::string>* tail_add) {
    if (s->log_fd >= 0) WriteAll(s->log_fd, line.data(), line.size());
    if (s->console_fd >= 0) {
      std::string out = s->prefix.empty() ? line : s->prefix + line;
      WriteAll(s->console_fd, out.data(), out.size());
    }
    if (s->keep_tail) {
      std::string t = line;
      if (!t.empty() && t.back() == '\n') t.pop_back();
      tail_add->push_back(std::move(t));
    }
  };
  while (!open.empty() && !reader_stop_.load()) {
    std::vector<pollfd> fds;
    fds.push_back({wake_pipe_[0], POLLIN, 0});
    for (Stream* s : open) fds.push_back({s->fd, POLLIN, 0});
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::warn("worker output reader: poll: {}", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;  // Stop asked us to exit
    std::vector<Stream*> still_open;
    for (size_t i = 1; i < fds.size(); ++i) {
      Stream* s = open[i - 1];
      if (fds[i].revents == 0) {
        still_open.push_back(s);
        continue;
      }
      ssize_t r = read(s->fd, buf, sizeof(buf));
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) {
        still_open.push_back(s);
        continue;
      }
      std::vector<std::string> tail_add;
      if (r > 0) {
        s->partial.append(buf, static_cast<size_t>(r));
        size_t start = 0;
        while (true) {
          size_t nl = s->partial.find('\n', start);
          if (nl == std::string::npos) break;
          emit(s, s->partial.substr(start, nl + 1 - start), &tail_add);
          start = nl + 1;
        }
        s->partial.erase(0, start);
        if (s->partial.size() > kMaxLine) {
          emit(s, s->partial + "\n", &tail_add);
          s->partial.clear();
        }
        still_open.push_back(s);
      } else if (!s->partial.empty()) {
        emit(s, s->partial + "\n", &tail_add);  // last line without a newline
        s->partial.clear();
      }
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& line : tail_add) {
        if (s->capture.has_value() && s->capture->size() < kMaxCaptureLines) s->capture->push_back(line);
        s->tail.push_back(std::move(line));
        while (s->tail.size() > s->tail_lines) s->tail.pop_front();
      }
      if (r <= 0) {
        s->eof = true;
        eof_cv_.notify_all();
      }
    }
    open.swap(still_open);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : streams_) s->eof = true;  // nothing more will be read
  eof_cv_.notify_all();
}

void WorkerGroup::WaitForEof(const Worker& w, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  eof_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return w.out->eof && w.err->eof; });
}

std::string WorkerGroup::StderrTail(const Worker& w) {
  std::lock_guard<std::mutex> lock(mu_);
  return absl::StrJoin(w.err->tail, "\n");
}

const char* WorkerStateName(WorkerState state) {
  switch (state) {
    case WorkerState::kRunning:
      return "running";
    case WorkerState::kSucceeded:
      return "succeeded";
    case WorkerState::kFailed:
      return "failed";
    case WorkerState::kStopped:
      return "stopped";
  }
  return "unknown";
}

std::vector<WorkerEvent> WorkerGroup::Poll() {
  std::vector<WorkerEvent> events;
  bool all_ok = !workers_.empty();
  for (auto& w : workers_) {
    if (w.state == WorkerState::kRunning) {
      auto st = w.process.Poll();
      if (st.has_value()) {
        w.state = st->ok() ? WorkerState::kSucceeded : WorkerState::kFailed;
        // The worker's own children may still hold its pipes: make sure none survive it.
        w.process.Signal(SIGKILL);
      }
    }
    if (w.state == WorkerState::kFailed && !w.reported) {
      w.reported = true;
      // The last lines may still sit in the pipe: read them before reporting so
      // the failure report carries the actual error.
      WaitForEof(w, 1.0);
      WorkerEvent e;
      e.kind = WorkerEvent::Kind::kFailed;
      e.round = round_.round;
      e.local_rank = w.local_rank;
      e.global_rank = w.global_rank;
      e.pid = w.pid;
      e.status = *w.process.status();
      e.stderr_tail = StderrTail(w);
      events.push_back(std::move(e));
    }
    all_ok &= w.state == WorkerState::kSucceeded;
  }
  if (all_ok && !all_succeeded_reported_) {
    all_succeeded_reported_ = true;
    WorkerEvent e;
    e.kind = WorkerEvent::Kind::kAllSucceeded;
    e.round = round_.round;
    events.push_back(e);
  }
  return events;
}

void WorkerGroup::Stop(double grace_s, const std::atomic<bool>* kill_now) {
  bool any = false;
  for (auto& w : workers_) {
    if (w.state != WorkerState::kRunning) continue;
    if (w.process.Poll().has_value()) {
      w.state = w.process.status()->ok() ? WorkerState::kSucceeded : WorkerState::kFailed;
      continue;
    }
    any = true;
    if (grace_s > 0) {
      w.process.Signal(SIGTERM);
      // A stopped worker (SIGSTOP, a terminal's SIGTSTP, the hang drill)
      // handles the SIGTERM only once it runs again.
      w.process.Signal(SIGCONT);
    }
  }
  // Wait for all workers in parallel (not one grace per worker).
  auto deadline = Clock::now() + std::chrono::duration<double>(std::max(0.0, grace_s));
  while (any && Clock::now() < deadline && !(kill_now != nullptr && kill_now->load())) {
    any = false;
    for (auto& w : workers_)
      if (w.state == WorkerState::kRunning && !w.process.Poll().has_value()) any = true;
    if (any) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto& w : workers_) {
    // Terminate(0) SIGKILLs and reaps a live worker, and SIGKILLs what is left
    // of an exited worker's process group.
    w.process.Terminate(0);
    if (w.state == WorkerState::kRunning) w.state = WorkerState::kStopped;
  }
  StopReader(1.0);
  if (wake_pipe_[0] >= 0) close(wake_pipe_[0]);
  if (wake_pipe_[1] >= 0) close(wake_pipe_[1]);
  wake_pipe_[0] = wake_pipe_[1] = -1;
}

void WorkerGroup::StopReader(double drain_s) {
  if (reader_.joinable()) {
    {
      // Every worker is dead, so the pipes close unless a grandchild that left
      // the process group holds them: drain briefly, then stop reading.
      std::unique_lock<std::mutex> lock(mu_);
      eof_cv_.wait_for(lock, std::chrono::duration<double>(drain_s), [&] {
        for (auto& s : streams_)
          if (!s->eof) return false;
        return true;
      });
    }
    reader_stop_ = true;
    if (wake_pipe_[1] >= 0) (void)!write(wake_pipe_[1], "x", 1);
    reader_.join();
  }
  for (auto& w : workers_) w.process.ClosePipes();
  streams_.clear();
  // Keep the final worker states for Workers() but drop the processes.
  std::vector<Worker> done;
  for (auto& w : workers_) {
    Worker d;
    d.local_rank = w.local_rank;
    d.global_rank = w.global_rank;
    d.pid = w.pid;
    d.state = w.state;
    d.reported = true;
    done.push_back(std::move(d));
  }
  final_states_ = std::move(done);
  workers_.clear();
}

bool WorkerGroup::AnyRunning() const {
  for (const auto& w : workers_)
    if (w.state == WorkerState::kRunning) return true;
  return false;
}

void WorkerGroup::StartStderrCapture(int local_rank) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& w : workers_) {
    if (w.local_rank == local_rank && w.err != nullptr && w.err->keep_tail) w.err->capture.emplace();
  }
}

std::string WorkerGroup::TakeStderrCapture(int local_rank) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& w : workers_) {
    if (w.local_rank != local_rank || w.err == nullptr || !w.err->capture.has_value()) continue;
    std::string text = absl::StrJoin(*w.err->capture, "\n");
    w.err->capture.reset();
    return text;
  }
  return "";
}

size_t WorkerGroup::CapturedLines(int local_rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& w : workers_) {
    if (w.local_rank == local_rank && w.err != nullptr && w.err->capture.has_value()) return w.err->capture->size();
  }
  return 0;
}

std::vector<WorkerInfo> WorkerGroup::Workers() const {
  std::vector<WorkerInfo> out;
  const auto& list = workers_.empty() ? final_states_ : workers_;
  for (const auto& w : list)
    out.push_back({w.local_rank, w.global_rank, w.pid, w.state, w.warm, w.pg_call_s, w.pg_up_s});
  return out;
}

}  // namespace ballast::agent
