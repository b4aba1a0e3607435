#include "scheduler/local/local_scheduler.h"

#include <signal.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler {

LocalScheduler::~LocalScheduler() { StopAll(0); }

absl::Status LocalScheduler::LaunchNode(const NodeSpec& spec) {
  if (nodes_.count(spec.name) != 0)
    return absl::AlreadyExistsError(absl::StrCat("node ", spec.name, " is already running"));
  SpawnOptions opts;
  opts.argv = spec.argv;
  opts.env = CurrentEnvironment();
  for (const auto& [k, v] : spec.env) opts.env[k] = v;
  // Each agent leads its own process group: the launcher's terminal signals go
  // to the launcher, which stops agents in order (workers first).
  opts.new_process_group = true;
  opts.die_with_parent = true;
  auto proc = Subprocess::Spawn(opts);
  if (!proc.ok()) return proc.status();
  spdlog::info("local scheduler: started {} (pid {})", spec.name, proc->pid());
  nodes_.emplace(spec.name, std::move(*proc));
  return absl::OkStatus();
}

std::vector<NodeExit> LocalScheduler::PollExited() {
  std::vector<NodeExit> exited;
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (auto st = it->second.Poll(); st.has_value()) {
      exited.push_back({it->first, *st});
      // Reap leftovers of the agent's group (its workers die with it anyway).
      it->second.Terminate(0);
      it = nodes_.erase(it);
    } else {
      ++it;
    }
  }
  return exited;
}

std::vector<std::string> LocalScheduler::RunningNodes() const {
  std::vector<std::string> names;
  for (const auto& [name, proc] : nodes_) names.push_back(name);
  return names;
}

absl::Status LocalScheduler::StopNode(const std::string& name, double grace_s) {
  auto it = nodes_.find(name);
  if (it == nodes_.end()) return absl::NotFoundError(absl::StrCat("no running node ", name));
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
