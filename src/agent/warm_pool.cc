#include "agent/warm_pool.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

double MonotonicSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// Python: `python -u -c` this. Kept to the standard library and what the
// agent asked to preload; its own names stay out of the script's namespace
// (runpy gives the script a fresh __main__).
//
// The control socket carries one JSON object a line from the agent:
// {"preload": [modules]} (import them, each a hint: one that fails is
// skipped; a job that comes first cuts the rest short), then the job {"env",
// "cwd", "argv", "module"}; once the script
// runs, {"modules": true} asks which library modules it has imported, and the
// answer is "modules <JSON list>". A module of WarmOptions::modules that
// fails to import is reported ("failed ...": the pool turns itself off) and
// the interpreter goes on: it may have been taken for a worker while still
// importing. Lines to the agent: "ready <t>",
// "preloaded <imported> <t> <failed>", "failed <module>: <error>", "started <t>",
// "pg <t_call> <t_return>", "modules [...]" (t: time.monotonic()).
//
// Forks (WarmOptions::fork): {"fork": true} with three descriptors passed
// along (SCM_RIGHTS: the new worker's stdout and stderr pipes and its
// control socket) makes the interpreter fork a copy of itself with
// everything it imported, between two imports of its preload. The copy
// forks once more and its middle process exits, so it becomes the agent's
// child (the agent is a child subreaper); it then ties its life to the
// agent's (PR_SET_PDEATHSIG), leads its own process group, takes the three
// descriptors as stdout, stderr and control socket, says "forked <pid> <t>"
// there and waits for its job like the interpreter it came from. What a
// cold start would not share with its siblings is new in the copy: Python's
// random (os.fork reseeds it) and NumPy's global generator (reseeded here).
// The interpreter itself stays, and keeps its preload.
constexpr char kBootstrap[] = R"PY(import os, sys
def _ballast_warm():
    import array, fcntl, json, socket, sysconfig, threading, time
    # Out of the way: a cold start's first open() gets fd 3, so must the script's.
    def high(low):
        fd = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 512)
        os.close(low)
        return socket.socket(fileno=fd)
    sock = [high(int(os.environ.pop("BALLAST_WARM_FD", "3")))]
    # Before any job, not in the thread that answers "modules": get_paths()
    # imports _sysconfigdata, and the .pyc that thread would have open as
    # the script starts is a descriptor a cold start does not have.
    std = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")})
    lock = threading.Lock()
    def say(msg):
        try:
            with lock:
                sock[0].sendall((msg + "\n").encode())
        except OSError:
            pass
    for name in [m for m in os.environ.pop("BALLAST_WARM_MODULES", "").split(",") if m]:
        try:
            __import__(name)
        except BaseException as e:
            # The agent turns warm starts off; this interpreter may have been
            # handed a job already, which it still runs as a cold start would.
            say(("failed %s: %s: %s" % (name, type(e).__name__, e)).replace("\n", " "))
    say("ready %.6f" % time.monotonic())
    buf = [b""]
    passed = []  # descriptors that came with fork requests, in order
    def read_message(block=True):
        # The next JSON line; None at EOF; False (block=False) while no
        # whole line has come.
        while b"\n" not in buf[0]:
            try:
                chunk, anc, _, _ = sock[0].recvmsg(1 << 20, socket.CMSG_SPACE(64),
                                                   0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                chunk, anc = b"", []
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    passed.extend(array.array("i", data[:len(data) - len(data) % 4]))
            if not chunk:
                return None
            buf[0] += chunk
        line, buf[0] = buf[0].split(b"\n", 1)
        return json.loads(line)
    # Preload lists (what DDP/FSDP import, what the last workers imported:
    # DDP's first construction imports torch._dynamo on torch 2.x, ~900
    # modules), each answered "preloaded <imported> <t> <failed>" once its
    # names were tried. One name at a time, looking for the job in between:
    # a job that comes while they are half done runs at once with what is
    # loaded (an import under way finishes first), and the script imports
    # the rest as it needs it.
    def fork(fds):
        # True in the copy (the new worker's interpreter), False here.
        import warnings
        agent = os.getppid()
        def refuse(why):
            # The agent hands this interpreter out itself, logging why.
            try:
                os.write(fds[2], ("nofork %s\n" % why).encode())
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
            return False
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if others:
            return refuse("the interpreter runs Python threads its imports started (%s), which a fork would "
                          "lack" % ", ".join(others))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # 3.12+: "multi-threaded, use of fork()"
                pid = os.fork()
        except OSError as e:
            return refuse("fork: %s" % e)
        if pid:
            for fd in fds:
                os.close(fd)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            return False
        try:
            if os.fork():
                os._exit(0)  # its child goes to the agent, the subreaper
            os.setpgid(0, 0)
            deadline = time.monotonic() + 10
            while os.getppid() != agent:
                if time.monotonic() > deadline:
                    os._exit(1)
                time.sleep(0.0005)
            import ctypes, signal
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
            if os.getppid() != agent:
                os._exit(1)
            try:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass  # the agent moves it back (WarmOptions::low_priority)
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.close(fds[0])
            os.close(fds[1])
            sock[0].close()
            sock[0] = high(fds[2])
            for fd in passed:
                os.close(fd)
            del passed[:]
            buf[0] = b""
            if "numpy.random" in sys.modules:
                sys.modules["numpy.random"].seed()
            say("forked %d %.6f" % (os.getpid(), time.monotonic()))
            return True
        except BaseException:
            os._exit(1)
    queue = []  # [names, next index, imported, failed]
    job = None
    while job is None:
        msg = read_message(block=not queue)
        if msg is None:
            sys.exit(0)
        if msg is not False:
            if "preload" in msg:
                queue.append([msg["preload"], 0, 0, 0])
            elif "fork" in msg:
                fds, passed[:3] = passed[:3], []
                if len(fds) == 3 and fork(fds):
                    queue = []  # the copy: its job comes next
                elif len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
            else:
                job = msg
            continue
        entry = queue[0]
        if entry[1] < len(entry[0]):
            name = entry[0][entry[1]]
            entry[1] += 1
            if name not in sys.modules:
                try:
                    __import__(name)
                    entry[2] += 1
                except BaseException:
                    entry[3] += 1
        if entry[1] >= len(entry[0]):
            queue.pop(0)
            say("preloaded %d %.6f %d" % (entry[2], time.monotonic(), entry[3]))
    def library_modules():
        # Modules of installed packages and the standard library only: the
        # user's own code may do anything at import. And Ballast's own
        # package wherever it lives (a build's python/ on PYTHONPATH): its
        # import reads nothing of the job (its C++ extension: 0.1-0.2 s).
        out = []
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if not f or name.startswith("_ballast") or name in ("__main__", "__mp_main__"):
                continue
            if ("/site-packages/" in f or "/dist-packages/" in f or f.startswith(std) or
                    name == "ballast" or name.startswith("ballast.")):
                out.append(name)
        return out
    # The script may fork (a DataLoader's workers): never while the thread
    # below is answering, so a child does not inherit a lock it holds.
    busy = threading.Lock()
    os.register_at_fork(before=busy.acquire, after_in_parent=busy.release, after_in_child=busy.release)
    def serve():
        while True:
            try:
                req = read_message()
            except ValueError:
                continue
            if req is None:
                return
            if req.get("modules"):
                with busy:
                    say("modules " + json.dumps(library_modules()))
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
    threading.Thread(target=serve, name="ballast-warm", daemon=True).start()
    return job["module"], sock[0]
_ballast_module, _ballast_sock = _ballast_warm()
def _ballast_settle():
    # Registered first, so it runs after the script's own atexit handlers:
    # torch 2.x's gloo threads drop the last collective's tensors a moment
    # after wait() returned and need the GIL to; once finalization starts
    # that ends them in a noexcept destructor (std::terminate). Let them.
    if "torch.distributed" in sys.modules:
        import gc, time
        gc.collect()
        time.sleep(0.05)
import atexit, runpy
atexit.register(_ballast_settle)
if _ballast_module:
    sys.path[0] = os.getcwd()
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
)PY";

// SCHED_IDLE (or back to SCHED_OTHER) for every thread of pid.
bool SetPolicy(pid_t pid, int policy) {
  sched_param param{};
  bool ok = true;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), ec)) {
    int tid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &tid)) continue;
    ok = sched_setscheduler(tid, policy, &param) == 0 && ok;
  }
  if (ec) ok = sched_setscheduler(pid, policy, &param) == 0;
  return ok;
}

}  // namespace

bool CanRestoreNormalPriority() {
  // CAP_SYS_NICE is bit 23 of the effective capabilities.
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "CapEff:")) continue;
    uint64_t caps = 0;
    std::string hex(absl::StripAsciiWhitespace(line.substr(7)));
    if (absl::SimpleHexAtoi(hex, &caps) && (caps & (1ull << 23)) != 0) return true;
  }
  rlimit rl{};
  return getrlimit(RLIMIT_NICE, &rl) == 0 && rl.rlim_cur >= 20;
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

const std::vector<std::string>& DistributedHints() {
  static const std::vector<std::string> kHints = {
      // DDP: part of `import torch` on 1.13, not on every 2.x.
      "torch.distributed", "torch.distributed.distributed_c10d", "torch.nn.parallel",
      "torch.nn.parallel.distributed",
      // What DDP's first construction (and torch.compile) imports on 2.x.
      "torch._dynamo",
      // FSDP (1 and 2) and DTensor.
      "torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel",
      "torch.distributed._composable.fsdp", "torch.distributed.tensor",
  };
  return kHints;
}

std::string WarmPool::TakenState::Describe() const {
  std::string out = imported ? absl::StrCat(modules, " imported") : absl::StrCat("still importing ", modules);
  if (forked) out = absl::StrCat("forked, ", out);
  if (hints > 0) absl::StrAppend(&out, hints_done ? ", DDP/FSDP modules preloaded" : ", DDP/FSDP modules not yet");
  absl::StrAppend(&out, ", ", learned_done, " of ", learned_sent, " learned modules preloaded, spawned ",
                  absl::StrFormat("%.1f", age_s), " s before");
  return out;
}

std::vector<WarmPool::TakenState> WarmPool::TakeTakenStates() {
  std::vector<TakenState> out;
  out.swap(taken_);
  return out;
}

WarmPool::WarmPool(WarmOptions options) : options_(std::move(options)) {
  if (options_.fork) {
    absl::Status st = BecomeChildSubreaper();
    fork_ = st.ok();
    if (!st.ok()) spdlog::info("warm interpreters are handed out, not forked: {}", std::string(st.message()));
  }
}

WarmPool::~WarmPool() {
  for (auto& [lr, slot] : slots_) Drop(&slot);
}

void WarmPool::CloseFork(int lr) {
  auto it = forks_.find(lr);
  if (it == forks_.end()) return;
  for (int fd : {it->second.out, it->second.err, it->second.control})
    if (fd >= 0) close(fd);
  forks_.erase(it);
}

void WarmPool::CloseForks() {
  while (!forks_.empty()) CloseFork(forks_.begin()->first);
}

void WarmPool::Drop(Slot* slot) {
  if (fork_) CloseForks();  // asked of this slot's interpreter, the only one
  if (slot->warm.has_value()) slot->warm->process.Terminate(0);
  slot->warm.reset();
}

void WarmPool::RequestForks(int n, const std::map<std::string, std::string>& env) {
  if (!fork_ || disabled()) return;
  Poll();
  for (int lr = 0; lr < n; ++lr) {
    auto it = slots_.find(SlotOf(lr));
    if (it == slots_.end() || it->second.env != env) continue;
    RequestFork(lr);
  }
}

void WarmPool::RequestFork(int lr) {
  auto it = slots_.find(SlotOf(lr));
  if (!fork_ || forks_.count(lr) != 0 || it == slots_.end() || !it->second.warm.has_value() ||
      !it->second.warm->process.running())
    return;
  Slot* slot = &it->second;
  int out[2] = {-1, -1}, err[2] = {-1, -1}, control[2] = {-1, -1};
  auto close_all = [&] {
    for (int fd : {out[0], out[1], err[0], err[1], control[0], control[1]})
      if (fd >= 0) close(fd);
  };
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 ||
      socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0) {
    spdlog::warn("the fork of the warm interpreter for local rank {}: cannot make its pipes: {}", lr, std::strerror(errno));
    close_all();
    return;
  }
  // The fork runs on the interpreter's thread: at the normal policy, so a
  // busy machine does not hold the restart behind the training that runs.
  if (options_.low_priority) SetPolicy(slot->warm->process.pid(), SCHED_OTHER);
  static const char kLine[] = "{\"fork\": true}\n";
  int passed[3] = {out[1], err[1], control[1]};
  iovec iov{const_cast<char*>(kLine), sizeof(kLine) - 1};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(passed))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = cbuf;
  msg.msg_controllen = sizeof(cbuf);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(passed));
  std::memcpy(CMSG_DATA(c), passed, sizeof(passed));
  const int fd = slot->warm->process.control_fd();
  ssize_t n;
  do {
    n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  for (int* end : {&out[1], &err[1], &control[1]}) {
    close(*end);
    *end = -1;
  }
  if (n != static_cast<ssize_t>(sizeof(kLine) - 1)) {
    // Nothing or a part went (a full socket: a preload list it has not read
    // yet): the line may be cut, so this interpreter is not asked again.
    spdlog::warn("cannot ask the warm interpreter for the fork for local rank {} ({}); handing it out instead", lr,
                 n < 0 ? std::strerror(errno) : "the control socket is full");
    close_all();
    return;
  }
  forks_[lr] = Fork{out[0], err[0], control[0], MonotonicSeconds()};
}

std::optional<Subprocess> WarmPool::CollectFork(int lr, std::string* why_not) {
  // Between two imports of its preload the interpreter reads the request;
  // one import under way finishes first (torch._dynamo's: seconds on a
  // busy machine). One still importing WarmOptions::modules (a job's first
  // start) reads it when that is done: the import a cold start would do,
  // begun earlier, so that wait has only a bound against a stuck import.
  constexpr double kForkTimeoutS = 10;
  constexpr double kImportTimeoutS = 300;
  std::string buffer;
  pid_t pid = -1;
  std::optional<Subprocess> copy;
  const int control = forks_.at(lr).control;
  const double asked_at = forks_.at(lr).asked_at_s;
  const int slot_key = SlotOf(lr);
  // When the interpreter said "ready" (-1: still importing); nullopt once it is gone.
  auto template_ready_at = [&]() -> std::optional<double> {
    auto it = slots_.find(slot_key);
    if (it == slots_.end() || !it->second.warm.has_value()) return std::nullopt;
    return it->second.warm->ready_at_s;
  };
  while (pid < 0) {
    const std::optional<double> ready = template_ready_at();
    if (!ready.has_value() || disabled()) {
      *why_not = disabled() ? disabled_reason_ : "it ended before it forked";
      break;
    }
    const double ready_at = *ready;
    const double now = MonotonicSeconds();
    const double deadline =
        ready_at > 0 ? std::max(asked_at, ready_at) + kForkTimeoutS : asked_at + kImportTimeoutS;
    if (now >= deadline) {
      *why_not = ready_at > 0 ? absl::StrFormat("it did not fork within %.0f s", kForkTimeoutS)
                              : absl::StrFormat("its imports did not end within %.0f s", kImportTimeoutS);
      break;
    }
    // Still importing: its "ready" line is read (Poll) at least every 0.1 s.
    const double wait = ready_at > 0 ? deadline - now : std::min(deadline - now, 0.1);
    pollfd p{control, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(wait * 1000) + 1) < 0 && errno != EINTR) {
      *why_not = absl::StrCat("poll: ", std::strerror(errno));
      break;
    }
    if (ready_at <= 0) {
      Poll();
      if (forks_.count(lr) == 0) continue;  // its interpreter died: the check above says so
    }
    bool closed = false;
    for (const std::string& line : ReadControlLines(control, &buffer, &closed)) {
      int got = 0;
      if (absl::StartsWith(line, "forked ") &&
          absl::SimpleAtoi(std::string(absl::StripAsciiWhitespace(line.substr(7, line.find(' ', 7) - 7))), &got))
        pid = got;
      if (absl::StartsWith(line, "nofork ")) *why_not = line.substr(7);
    }
    if (pid < 0 && closed) {
      if (why_not->empty()) *why_not = "its fork ended before it started";
      break;
    }
  }
  if (pid < 0) {
    CloseFork(lr);
  } else {
    const Fork f = forks_.at(lr);
    forks_.erase(lr);  // the copy owns the descriptors now
    copy = Subprocess::Adopt(pid, /*own_group=*/true, f.out, f.err, control);
  }
  // Back to the background once no fork is asked of it.
  auto it = slots_.find(slot_key);
  if (options_.low_priority && forks_.empty() && it != slots_.end() && it->second.warm.has_value())
    SetPolicy(it->second.warm->process.pid(), SCHED_IDLE);
  if (!copy.has_value()) return std::nullopt;
  fcntl(control, F_SETFL, fcntl(control, F_GETFL) | O_NONBLOCK);
  return copy;
}

absl::Status WarmPool::Prepare(int lr, const std::map<std::string, std::string>& env) {
  if (disabled()) return absl::OkStatus();
  Slot& slot = slots_[SlotOf(lr)];
  if (slot.warm.has_value()) {
    if (slot.env == env && slot.warm->process.running()) return absl::OkStatus();
    Drop(&slot);  // stale: started for another environment
  }
  slot.handed_to.clear();
  SpawnOptions so;
  so.argv = {options_.python, "-u", "-c", kBootstrap};
  so.env = env;
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
  // Just exec'd: one thread; the threads its imports start inherit the policy.
  if (options_.low_priority && !SetPolicy(proc->pid(), SCHED_IDLE)) {
    spdlog::debug("warm interpreter {}: cannot set SCHED_IDLE: {}", proc->pid(), std::strerror(errno));
  }
  slot.env = env;
  slot.buffer.clear();
  slot.preload_sent = 0;
  slot.unanswered.clear();
  slot.hints_done = options_.hints.empty();
  slot.learned_done = 0;
  slot.warm = WarmProcess{*std::move(proc), -1, MonotonicSeconds()};
  // What the workers imported is exact and in the order they needed it:
  // first when it is known (from these workers, an earlier run, another
  // node); the hints (what DDP/FSDP import) after it, or first while
  // nothing is known. (A list from an earlier run may be stale or cut
  // short; torch._dynamo, most of the hints' cost, is in the list of
  // nearly every torch 2.x distributed job anyway.)
  SendPreload(&slot);
  if (!options_.hints.empty()) Send(&slot, options_.hints, /*hints=*/true);
  return absl::OkStatus();
}

void WarmPool::SendPreload(Slot* slot) {
  if (!slot->warm.has_value()) return;
  // In chunks: each is answered when done, so what a taken interpreter had
  // is known within a chunk (one list of ~2000 names would say 0 until its end).
  while (slot->preload_sent < learned_.size()) {
    const size_t end = std::min(learned_.size(), slot->preload_sent + kPreloadChunk);
    Send(slot,
         std::vector<std::string>(learned_.begin() + static_cast<long>(slot->preload_sent),
                                  learned_.begin() + static_cast<long>(end)),
         /*hints=*/false);
    slot->preload_sent = end;
  }
}

void WarmPool::Send(Slot* slot, const std::vector<std::string>& names, bool hints) {
  nlohmann::json msg = {{"preload", names}};
  const std::string line = msg.dump() + "\n";
  // The interpreter reads its socket only between imports: a list longer
  // than the socket buffer must not block the agent, so this is one
  // blocking send of a few ten KB at most (the buffer holds it).
  const int fd = slot->warm->process.control_fd();
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  size_t off = 0;
  while (off < line.size()) {
    ssize_t n = send(fd, line.data() + off, line.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // it died: Poll notices
    off += static_cast<size_t>(n);
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  slot->unanswered.push_back({names.size(), hints});
}

void WarmPool::Preload(const std::vector<std::string>& modules) {
  for (const std::string& m : modules) {
    if (learned_set_.insert(m).second) learned_.push_back(m);
  }
  if (disabled()) return;
  for (auto& [key, slot] : slots_) SendPreload(&slot);
}

void WarmPool::Poll() {
  if (fork_ && MonotonicSeconds() - strays_reaped_at_ > 0.5) {
    // As a subreaper this process also inherits what its workers leave
    // behind (a process of theirs that outlived them): reap those.
    strays_reaped_at_ = MonotonicSeconds();
    ReapStrayChildren();
  }
  for (auto& [key, slot] : slots_) {
    if (!slot.warm.has_value()) continue;
    WarmProcess& w = *slot.warm;
    auto whose = [&, key = key] {
      return fork_ ? std::string("the node's warm interpreter") : absl::StrCat("the warm interpreter of local rank ", key);
    };
    bool closed = false;
    for (const std::string& line : ReadControlLines(w.process.control_fd(), &slot.buffer, &closed)) {
      if (absl::StartsWith(line, "ready ")) {
        (void)absl::SimpleAtod(line.substr(6), &w.ready_at_s);
      } else if (absl::StartsWith(line, "preloaded ") && !slot.unanswered.empty()) {
        // Answers come in the order of the messages.
        const Slot::Sent sent = slot.unanswered.front();
        slot.unanswered.pop_front();
        if (sent.hints) {
          slot.hints_done = true;
        } else {
          slot.learned_done += sent.names;
        }
      } else if (absl::StartsWith(line, "failed ")) {
        disabled_reason_ = absl::StrCat(whose(), " could not import ", line.substr(7));
      }
    }
    if (auto st = w.process.Poll(); st.has_value() || closed) {
      if (disabled_reason_.empty()) {
        disabled_reason_ = absl::StrCat(whose(), " ended before its job (",
                                        st.has_value() ? st->Describe() : "closed its control socket", ")");
      }
      Drop(&slot);
    }
  }
  if (disabled()) {
    for (auto& [key, slot] : slots_) Drop(&slot);
  }
}

bool WarmPool::ready(int lr) const {
  auto it = slots_.find(SlotOf(lr));
  return it != slots_.end() && it->second.warm.has_value() && it->second.warm->ready_at_s > 0 &&
         it->second.unanswered.empty();
}

bool WarmPool::hints_ready(int lr) const {
  auto it = slots_.find(SlotOf(lr));
  return it != slots_.end() && it->second.warm.has_value() && it->second.warm->ready_at_s > 0 &&
         it->second.hints_done;
}

std::optional<WarmProcess> WarmPool::Take(int lr, const std::map<std::string, std::string>& env,
                                          std::string* why_not) {
  Poll();
  auto it = slots_.find(SlotOf(lr));
  if (disabled()) {
    *why_not = disabled_reason_;
    return std::nullopt;
  }
  if (it == slots_.end() || !it->second.warm.has_value()) {
    *why_not = it != slots_.end() && !it->second.handed_to.empty()
                   ? absl::StrCat("the node's warm interpreter was handed to ", it->second.handed_to,
                                  " itself (it could not fork)")
                   : "no warm interpreter was ready";
    return std::nullopt;
  }
  Slot& slot = it->second;
  std::string diff = FirstDifference(slot.env, env);
  if (!diff.empty()) {
    *why_not = absl::StrCat("the environment the interpreter started with differs (", diff, ")");
    Drop(&slot);
    return std::nullopt;
  }
  TakenState state;
  state.local_rank = lr;
  state.modules = absl::StrJoin(options_.modules, ", ");
  state.hints = options_.hints.size();
  std::optional<WarmProcess> out;
  RequestFork(lr);
  if (forks_.count(lr) != 0) {
    std::string why;
    std::optional<Subprocess> copy = CollectFork(lr, &why);
    if (copy.has_value()) {
      state.forked = true;
      out = WarmProcess{*std::move(copy), slot.warm->ready_at_s, MonotonicSeconds()};
    } else if (slot.warm.has_value()) {
      // Handed out itself below; the next start gets a new one (Prepare).
      spdlog::warn("the warm interpreter (pid {}) could not fork for the worker of local rank {}: {}; handing "
                   "it out itself",
                   slot.warm->process.pid(), lr, why);
    } else {
      *why_not = why;
      return std::nullopt;
    }
  }
  // The interpreter's (it stays after a fork; a fork that worked came from it).
  state.age_s = MonotonicSeconds() - slot.warm->spawned_at_s;
  state.imported = slot.warm->ready_at_s > 0;
  state.hints_done = slot.hints_done;
  state.learned_done = slot.learned_done;
  state.learned_sent = slot.preload_sent;
  if (!out.has_value()) {
    if (fork_) {
      CloseForks();  // asked of it for the other local ranks: they start cold
      slot.handed_to = absl::StrCat("local rank ", lr);
    }
    out = std::move(slot.warm);
    slot.warm.reset();
  }
  state.pid = out->process.pid();
  // It trains now (or finishes its imports for that first): the normal policy.
  if (options_.low_priority && !SetPolicy(out->process.pid(), SCHED_OTHER)) {
    spdlog::warn("warm interpreter {}: cannot restore SCHED_OTHER ({}); starting its worker cold instead",
                 out->process.pid(), std::strerror(errno));
    out->process.Terminate(0);
    *why_not = "its scheduling policy could not be restored";
    return std::nullopt;
  }
  taken_.push_back(state);
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
