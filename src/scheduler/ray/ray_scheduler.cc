#include "scheduler/ray/ray_scheduler.h"

#include <poll.h>
#include <sys/socket.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace ballast::scheduler::ray {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

absl::StatusOr<std::unique_ptr<RayScheduler>> RayScheduler::Start(RaySchedulerOptions options) {
  std::unique_ptr<RayScheduler> s(new RayScheduler(std::move(options)));
  SpawnOptions so;
  so.argv = s->options_.bridge_argv;
  so.env = s->options_.bridge_env;
  so.control_socket = true;
  auto bridge = Subprocess::Spawn(so);
  if (!bridge.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot start the Ray bridge (", so.argv.empty() ? "" : so.argv[0], "): ", bridge.status().message()));
  }
  s->bridge_ = std::move(*bridge);
  const auto start = Clock::now();
  while (!s->ready_ && s->fatal_.empty() && !s->closed_ && Since(start) < s->options_.connect_timeout_s) {
    s->Read(0.2);
  }
  if (!s->fatal_.empty()) return absl::FailedPreconditionError(s->fatal_);
  if (!s->ready_) {
    const std::optional<ExitStatus> st = s->bridge_.Wait(2);
    return absl::FailedPreconditionError(
        s->closed_ ? absl::StrCat("the Ray bridge ended before it connected to the cluster (",
                                  st.has_value() ? st->Describe() : std::string("still running"),
                                  "); see its message above")
                   : absl::StrCat("the Ray bridge did not connect to the cluster within ", s->options_.connect_timeout_s,
                                  " s; is RAY_ADDRESS (or --address) a running cluster?"));
  }
  return s;
}

RayScheduler::~RayScheduler() {
  if (bridge_.running()) {
    if (!stopped_ && !running_.empty()) StopAll(0);
    // EOF tells the bridge to stop what is left and disconnect from Ray; a
    // signal would leave Ray's own crash report in the log.
    if (bridge_.control_fd() >= 0) shutdown(bridge_.control_fd(), SHUT_WR);
    if (!bridge_.Wait(10).has_value()) bridge_.Terminate(5);
  }
}

absl::Status RayScheduler::Send(const std::string& json_line) {
  const int fd = bridge_.control_fd();
  if (fd < 0 || closed_) return absl::UnavailableError("the Ray bridge has ended; see its message above");
  std::string line = json_line + "\n";
  size_t off = 0;
  while (off < line.size()) {
    ssize_t n = send(fd, line.data() + off, line.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd p{fd, POLLOUT, 0};
        (void)poll(&p, 1, 100);
        continue;
      }
      closed_ = true;
      return absl::UnavailableError(absl::StrCat("the Ray bridge has ended (", strerror(errno), ")"));
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

void RayScheduler::Read(double timeout_s) {
  const int fd = bridge_.control_fd();
  if (fd < 0 || closed_) return;
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout_s * 1000)) <= 0) return;
  bool closed = false;
  for (const std::string& line : ReadControlLines(fd, &buffer_, &closed)) {
    if (std::optional<NodeEvent> e = Apply(line); e.has_value()) events_.push_back(std::move(*e));
  }
  if (closed) closed_ = true;
}

std::optional<NodeEvent> RayScheduler::Apply(const std::string& line) {
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("ev")) {
    spdlog::warn("ray: the bridge wrote a line that is not an event: {}", line);
    return std::nullopt;
  }
  const std::string ev = j.value("ev", "");
  const std::string name = j.value("name", "");
  if (ev == "ready") {
    ready_ = true;
    driver_ip_ = j.value("ip", "127.0.0.1");
    cluster_ = absl::StrCat("Ray cluster at ", j.value("address", "?"), ": ", j.value("nodes", 0), " alive node(s)");
    return std::nullopt;
  }
  if (ev == "stopped") {
    stopped_ = true;
    return std::nullopt;
  }
  if (ev == "error") {
    fatal_ = j.value("message", "the Ray bridge failed");
    return std::nullopt;
  }
  if (ev.rfind("master_", 0) == 0) {
    MasterActorEvent m;
    if (ev == "master_started") {
      m.kind = MasterActorEvent::Kind::kStarted;
      m.host = j.value("host", "");
      m.ip = j.value("ip", "");
      m.port = j.value("port", 0);
      m.pid = j.value("pid", 0);
      m.incarnation = j.value("incarnation", 0);
    } else if (ev == "master_died" || ev == "master_lost") {
      m.kind = ev == "master_died" ? MasterActorEvent::Kind::kDied : MasterActorEvent::Kind::kLost;
      m.reason = j.value("reason", "Ray reported the master's actor dead");
    } else if (ev == "master_exited" || ev == "master_stopped") {
      m.kind = ev == "master_exited" ? MasterActorEvent::Kind::kExited : MasterActorEvent::Kind::kStopped;
      m.status.exit_code = j.value("code", 0);
      m.status.signal = j.value("signal", 0);
    } else {
      spdlog::warn("ray: the bridge wrote an unknown event: {}", line);
      return std::nullopt;
    }
    master_events_.push_back(std::move(m));
    return std::nullopt;
  }
  // Nodes this side released are not reported again (NodeManager handled them).
  if (released_.count(name) > 0) return std::nullopt;
  NodeEvent e;
  e.name = name;
  e.host = j.value("host", "");
  if (ev == "started") {
    e.kind = NodeEvent::Kind::kStarted;
  } else if (ev == "exited") {
    e.kind = NodeEvent::Kind::kExited;
    e.status.exit_code = j.value("code", 0);
    e.status.signal = j.value("signal", 0);
    running_.erase(name);
  } else if (ev == "lost") {
    e.kind = NodeEvent::Kind::kLost;
    e.reason = j.value("reason", "Ray reported it dead");
    running_.erase(name);
  } else if (ev == "pending") {
    e.kind = NodeEvent::Kind::kPendingTooLong;
    e.reason = j.value("reason", "no Ray node is free");
  } else {
    spdlog::warn("ray: the bridge wrote an unknown event: {}", line);
    return std::nullopt;
  }
  return e;
}

absl::Status RayScheduler::LaunchNode(const NodeRequest& request) {
  if (running_.count(request.name) > 0) return absl::AlreadyExistsError(request.name);
  LocalCommand cmd = options_.command_for(request);
  cmd.env["BALLAST_NODE_ID"] = request.name;
  json j = {{"op", "launch"},         {"name", request.name}, {"node_rank", request.node_rank},
            {"incarnation", request.incarnation}, {"argv", cmd.argv}, {"env", cmd.env},
            {"avoid", request.avoid_hosts}};
  if (absl::Status s = Send(j.dump()); !s.ok()) return s;
  running_.insert(request.name);
  return absl::OkStatus();
}

absl::Status RayScheduler::ReleaseNode(const std::string& name, const std::string& reason, double grace_s) {
  if (running_.erase(name) == 0) return absl::NotFoundError(name);
  released_.insert(name);
  return Send(json{{"op", "release"}, {"name", name}, {"reason", reason}, {"grace", grace_s}}.dump());
}

std::vector<NodeEvent> RayScheduler::Poll() {
  Read(0);
  if (closed_ && !running_.empty()) {
    // Without the bridge nothing is watched: every node counts as lost.
    for (const std::string& name : running_) {
      NodeEvent e;
      e.kind = NodeEvent::Kind::kLost;
      e.name = name;
      e.reason = fatal_.empty() ? "the Ray bridge ended (see its message above)" : absl::StrCat("the Ray bridge failed: ", fatal_);
      events_.push_back(e);
    }
    running_.clear();
  }
  std::vector<NodeEvent> out;
  out.swap(events_);
  return out;
}

absl::Status RayScheduler::StartMaster(const MasterActorSpec& spec) {
  return Send(json{{"op", "master_start"},
                   {"argv", spec.argv},
                   {"env", spec.env},
                   {"journal", spec.journal},
                   {"node", spec.node},
                   {"advertise_host", spec.advertise_host},
                   {"cleanup", spec.cleanup}}
                  .dump());
}

absl::Status RayScheduler::KillMaster() { return Send(json{{"op", "master_kill"}}.dump()); }

absl::Status RayScheduler::StopMaster(double grace_s) {
  return Send(json{{"op", "master_stop"}, {"grace", grace_s}}.dump());
}

std::vector<MasterActorEvent> RayScheduler::MasterEvents(double timeout_s) {
  Read(master_events_.empty() ? timeout_s : 0);
  std::vector<MasterActorEvent> out;
  out.swap(master_events_);
  return out;
}

std::vector<std::string> RayScheduler::RunningNodes() const { return {running_.begin(), running_.end()}; }

void RayScheduler::StopAll(double grace_s) {
  stopped_ = false;
  if (Send(json{{"op", "stop_all"}, {"grace", grace_s}}.dump()).ok()) {
    const auto start = Clock::now();
    // The bridge stops every agent (SIGTERM, SIGKILL after grace_s) and kills its actor.
    while (!stopped_ && !closed_ && Since(start) < grace_s + 15) Read(0.2);
    if (!stopped_ && !closed_) spdlog::warn("ray: the bridge did not confirm that every agent stopped");
  }
  for (const std::string& name : running_) released_.insert(name);
  running_.clear();
}

}  // namespace ballast::scheduler::ray
