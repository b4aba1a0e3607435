// Local backend: every node is an agent process on this machine, started with
// fork/exec in its own process group and killed with its launcher
// (PR_SET_PDEATHSIG). Call LaunchNode from one long-lived thread: the death
// signal is tied to the forking thread.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/subprocess.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler {

class LocalScheduler : public SchedulerInterface {
 public:
  LocalScheduler() = default;
  ~LocalScheduler() override;  // StopAll(0): no agent outlives its launcher

  absl::Status LaunchNode(const NodeSpec& spec) override;
  std::vector<NodeExit> PollExited() override;
  std::vector<std::string> RunningNodes() const override;
  absl::Status StopNode(const std::string& name, double grace_s) override;
  void StopAll(double grace_s) override;

  // pid of a running node's agent, -1 if unknown (for operators and tests).
  pid_t PidOf(const std::string& name) const;

 private:
  std::map<std::string, Subprocess> nodes_;
};

}  // namespace ballast::scheduler
