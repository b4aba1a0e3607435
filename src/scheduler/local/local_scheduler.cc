#include "scheduler/local/local_scheduler.h"

#include <signal.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler {

LocalScheduler::~LocalScheduler() { StopAll(0); }

const char* NodeEventKindName(NodeEvent::Kind kind) {
  switch (kind) {
    case NodeEvent::Kind::kStarted: return "started";
    case NodeEvent::Kind::kExited: return "exited";
    case NodeEvent::Kind::kLost: return "lost";
    case NodeEvent::Kind::kPendingTooLong: return "pending too long";
  }
  return "unknown";
}

absl::Status LocalScheduler::LaunchNode(const NodeRequest& request) {
  if (nodes_.count(request.name) != 0)
    return absl::AlreadyExistsError(absl::StrCat("node ", request.name, " is already running"));
  LocalCommand cmd = command_for_(request);
  SpawnOptions opts;
  opts.argv = cmd.argv;
  opts.env = CurrentEnvironment();
  for (const auto& [k, v] : cmd.env) opts.env[k] = v;
  opts.env["BALLAST_NODE_ID"] = request.name;
  // Each agent leads its own process group: the launcher's terminal signals go
  // to the launcher, which stops agents in order (workers first).
  opts.new_process_group = true;
  opts.die_with_parent = true;
  auto proc = Subprocess::Spawn(opts);
  if (!proc.ok()) return proc.status();
  spdlog::info("local scheduler: started {} (node rank {}, agent {}, pid {})", request.name, request.node_rank,
               request.incarnation, proc->pid());
  nodes_.emplace(request.name, std::move(*proc));
  NodeEvent e;
  e.kind = NodeEvent::Kind::kStarted;
  e.name = request.name;
  e.host = "localhost";
  started_.push_back(e);
  return absl::OkStatus();
}

std::vector<NodeEvent> LocalScheduler::Poll() {
  std::vector<NodeEvent> events = std::move(started_);
  started_.clear();
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (auto st = it->second.Poll(); st.has_value()) {
      NodeEvent e;
      e.kind = NodeEvent::Kind::kExited;
      e.name = it->first;
      e.host = "localhost";
      e.status = *st;
      events.push_back(e);
      // Reap leftovers of the agent's group (its workers die with it anyway).
      it->second.Terminate(0);
      it = nodes_.erase(it);
    } else {
      ++it;
    }
  }
  return events;
}

std::vector<std::string> LocalScheduler::RunningNodes() const {
  std::vector<std::string> names;
  for (const auto& [name, proc] : nodes_) names.push_back(name);
  return names;
}

absl::Status LocalScheduler::ReleaseNode(const std::string& name, const std::string& reason, double grace_s) {
  auto it = nodes_.find(name);
  if (it == nodes_.end()) return absl::NotFoundError(absl::StrCat("no running node ", name));
  spdlog::info("local scheduler: stopping {} (pid {}): {}", name, it->second.pid(), reason);
  it->second.Terminate(grace_s);
  nodes_.erase(it);
  return absl::OkStatus();
}

void LocalScheduler::StopAll(double grace_s) {
  // Signal all first, then wait: stopping N agents takes one grace period, not
  // N. Each agent gets exactly one SIGTERM (a second one means "hurry" to it).
  for (auto& [name, proc] : nodes_) {
    if (proc.running()) proc.Signal(grace_s > 0 ? SIGTERM : SIGKILL);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  for (auto& [name, proc] : nodes_) {
    double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left > 0) proc.Wait(left);
    proc.Terminate(0);  // SIGKILL what is left of the group, reap
  }
  nodes_.clear();
}

pid_t LocalScheduler::PidOf(const std::string& name) const {
  auto it = nodes_.find(name);
  return it == nodes_.end() ? -1 : it->second.pid();
}

}  // namespace ballast::scheduler
