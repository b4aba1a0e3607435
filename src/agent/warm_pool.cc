#include "agent/warm_pool.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

double MonotonicSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// The variables WorkerEnvironment sets per round (see worker_group.cc).
const std::set<std::string>& RoundVariables() {
  static const auto* vars = new std::set<std::string>{
      "RANK",           "LOCAL_RANK",      "WORLD_SIZE",  "LOCAL_WORLD_SIZE",           "GROUP_RANK",
      "GROUP_WORLD_SIZE", "ROLE_RANK",     "ROLE_NAME",   "ROLE_WORLD_SIZE",            "MASTER_ADDR",
      "MASTER_PORT",    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
      "TORCHELASTIC_USE_AGENT_STORE", "BALLAST_ROUND"};
  return *vars;
}

// Python: `python -u -c` this. Kept to the standard library and what the
// agent asked to preload; its own names stay out of the script's namespace
// (runpy gives the script a fresh __main__).
constexpr char kBootstrap[] = R"PY(import os, sys
def _ballast_warm():
    import fcntl, json, socket, time
    # Out of the way: a cold start's first open() gets fd 3, so must the script's.
    low = int(os.environ.pop("BALLAST_WARM_FD", "3"))
    fd = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 512)
    os.close(low)
    sock = socket.socket(fileno=fd)
    def say(msg):
        try:
            sock.sendall((msg + "\n").encode())
        except OSError:
            pass
    for name in [m for m in os.environ.pop("BALLAST_WARM_MODULES", "").split(",") if m]:
        try:
            __import__(name)
        except BaseException as e:
            say(("failed %s: %s: %s" % (name, type(e).__name__, e)).replace("\n", " "))
            sys.exit(3)
    say("ready %.6f" % time.monotonic())
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            sys.exit(0)
        buf += chunk
    job = json.loads(buf)
    dist = sys.modules.get("torch.distributed")
    orig = getattr(dist, "init_process_group", None)
    if orig is not None:
        import functools
        def wait_for_store(args, kwargs):
            # torch's TCPStore client that dials before rank 0's store listens
            # retries only after a second or more; a warm start gets there
            # first, so knock until the store answers (what the client would
            # do, at a finer grain).
            if os.environ.get("RANK", "0") == "0" or len(args) > 1 or kwargs.get("store") is not None:
                return
            if kwargs.get("init_method") not in (None, "env://"):
                return
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not addr or not port:
                return
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    socket.create_connection((addr, int(port)), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.005)
        @functools.wraps(orig)
        def init_process_group(*args, **kwargs):
            t0 = time.monotonic()
            wait_for_store(args, kwargs)
            result = orig(*args, **kwargs)
            say("pg %.6f %.6f" % (t0, time.monotonic()))
            return result
        dist.init_process_group = init_process_group
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is not None and getattr(c10d, "init_process_group", None) is orig:
            c10d.init_process_group = init_process_group
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.argv = list(job["argv"])
    say("started %.6f" % time.monotonic())
    return job["module"], sock
_ballast_module, _ballast_sock = _ballast_warm()
import runpy
if _ballast_module:
    sys.path[0] = os.getcwd()
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
)PY";

}  // namespace

bool IsRoundVariable(const std::string& name) { return RoundVariables().count(name) > 0; }

std::map<std::string, std::string> WithoutRoundVariables(const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : env) {
    if (!IsRoundVariable(k)) out.emplace(k, v);
  }
  return out;
}

std::string FirstDifference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end()) return absl::StrCat(k, " is unset now");
    if (it->second != v) return absl::StrCat(k, " changed");
  }
  for (const auto& [k, v] : b) {
    if (a.count(k) == 0) return absl::StrCat(k, " is set now");
  }
  return "";
}

const char* WarmBootstrap() { return kBootstrap; }

WarmPool::WarmPool(WarmOptions options) : options_(std::move(options)) {}

WarmPool::~WarmPool() {
  for (auto& [lr, slot] : slots_) {
    if (slot.warm.has_value()) slot.warm->process.Terminate(0);
  }
}

absl::Status WarmPool::Prepare(int lr, const std::map<std::string, std::string>& env) {
  if (disabled()) return absl::OkStatus();
  Slot& slot = slots_[lr];
  std::map<std::string, std::string> base = WithoutRoundVariables(env);
  if (slot.warm.has_value()) {
    if (slot.env == base && slot.warm->process.running()) return absl::OkStatus();
    slot.warm->process.Terminate(0);  // stale: started for another environment
    slot.warm.reset();
  }
  SpawnOptions so;
  so.argv = {options_.python, "-u", "-c", kBootstrap};
  so.env = base;
  so.env["BALLAST_WARM_FD"] = std::to_string(kControlFd);
  so.env["BALLAST_WARM_MODULES"] = absl::StrJoin(options_.modules, ",");
  so.new_process_group = true;
  so.die_with_parent = true;
  so.pipe_stdout = true;
  so.pipe_stderr = true;
  so.control_socket = true;
  auto proc = Subprocess::Spawn(so);
  if (!proc.ok()) {
    disabled_reason_ = absl::StrCat("cannot start a warm interpreter: ", proc.status().message());
    return proc.status();
  }
  fcntl(proc->control_fd(), F_SETFL, fcntl(proc->control_fd(), F_GETFL) | O_NONBLOCK);
  slot.env = std::move(base);
  slot.buffer.clear();
  slot.warm = WarmProcess{*std::move(proc), -1, MonotonicSeconds()};
  return absl::OkStatus();
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

void WarmPool::Poll() {
  for (auto& [lr, slot] : slots_) {
    if (!slot.warm.has_value()) continue;
    WarmProcess& w = *slot.warm;
    bool closed = false;
    for (const std::string& line : ReadControlLines(w.process.control_fd(), &slot.buffer, &closed)) {
      if (absl::StartsWith(line, "ready ")) {
        (void)absl::SimpleAtod(line.substr(6), &w.ready_at_s);
      } else if (absl::StartsWith(line, "failed ")) {
        disabled_reason_ = absl::StrCat("the warm interpreter of local rank ", lr, " could not import ",
                                        line.substr(7));
      }
    }
    if (auto st = w.process.Poll(); st.has_value() || closed) {
      if (disabled_reason_.empty()) {
        disabled_reason_ = absl::StrCat("the warm interpreter of local rank ", lr, " ended before its job (",
                                        st.has_value() ? st->Describe() : "closed its control socket", ")");
      }
      w.process.Terminate(0);
      slot.warm.reset();
    }
  }
  if (disabled()) {
    for (auto& [lr, slot] : slots_) {
      if (slot.warm.has_value()) slot.warm->process.Terminate(0);
      slot.warm.reset();
    }
  }
}

bool WarmPool::ready(int lr) const {
  auto it = slots_.find(lr);
  return it != slots_.end() && it->second.warm.has_value() && it->second.warm->ready_at_s > 0;
}

std::optional<WarmProcess> WarmPool::Take(int lr, const std::map<std::string, std::string>& env,
                                          std::string* why_not) {
  Poll();
  auto it = slots_.find(lr);
  if (disabled()) {
    *why_not = disabled_reason_;
    return std::nullopt;
  }
  if (it == slots_.end() || !it->second.warm.has_value()) {
    *why_not = "no warm interpreter was ready";
    return std::nullopt;
  }
  Slot& slot = it->second;
  std::string diff = FirstDifference(slot.env, WithoutRoundVariables(env));
  if (!diff.empty()) {
    *why_not = absl::StrCat("the environment the interpreter started with differs (", diff, ")");
    slot.warm->process.Terminate(0);
    slot.warm.reset();
    return std::nullopt;
  }
  std::optional<WarmProcess> out = std::move(slot.warm);
  slot.warm.reset();
  return out;
}

absl::Status WarmPool::Hand(WarmProcess* w, const std::map<std::string, std::string>& env, const std::string& cwd,
                            const std::vector<std::string>& argv, bool module) {
  nlohmann::json job = {{"env", env}, {"cwd", cwd}, {"argv", argv}, {"module", module}};
  std::string line = job.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  const int fd = w->process.control_fd();
  // The interpreter reads as soon as it is ready; until then the socket
  // buffer holds the job (a few KB), so this does not wait for the import.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  size_t off = 0;
  while (off < line.size()) {
    ssize_t n = send(fd, line.data() + off, line.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("cannot hand the job to the warm interpreter: ", std::strerror(errno)));
    }
    off += static_cast<size_t>(n);
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return absl::OkStatus();
}

}  // namespace ballast::agent
