// Local backend: every node is an agent process on this machine, started with
// fork/exec in its own process group and killed with its launcher
// (PR_SET_PDEATHSIG). Call LaunchNode from one long-lived thread: the death
// signal is tied to the forking thread.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/subprocess.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler {

// The command line and extra environment of one node's agent.
struct LocalCommand {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;  // on top of the launcher's environment
};

class LocalScheduler : public SchedulerInterface {
 public:
  using CommandFor = std::function<LocalCommand(const NodeRequest&)>;
  explicit LocalScheduler(CommandFor command_for) : command_for_(std::move(command_for)) {}
  ~LocalScheduler() override;  // StopAll(0): no agent outlives its launcher

  std::string Kind() const override { return "local"; }
  // The agent gets BALLAST_NODE_ID=request.name. avoid_hosts cannot be
  // honoured (one host) and is ignored.
  absl::Status LaunchNode(const NodeRequest& request) override;
  absl::Status ReleaseNode(const std::string& name, const std::string& reason, double grace_s) override;
  std::vector<NodeEvent> Poll() override;
  std::vector<std::string> RunningNodes() const override;
  void StopAll(double grace_s) override;

  // pid of a running node's agent, -1 if unknown (for operators and tests).
  pid_t PidOf(const std::string& name) const;

 private:
  const CommandFor command_for_;
  std::map<std::string, Subprocess> nodes_;
  std::vector<NodeEvent> started_;  // kStarted events not yet polled
};

}  // namespace ballast::scheduler
