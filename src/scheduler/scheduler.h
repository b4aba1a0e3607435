// The scheduler seam: how the job gets (and replaces) nodes. A node is one
// `ballast run` agent. Backends: local processes (local/, the embedded default
// behind `ballast launch`); Slurm and Kubernetes come later behind the same
// interface.
//
// Thread safety: implementations are driven from one thread (the launcher's
// loop) unless they say otherwise.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/subprocess.h"

namespace ballast::scheduler {

// What to run for one node.
struct NodeSpec {
  std::string name;                         // unique, e.g. "node-3"
  std::vector<std::string> argv;            // the agent command line
  std::map<std::string, std::string> env;   // extra environment (token, tunables)
};

// A node whose agent ended.
struct NodeExit {
  std::string name;
  ExitStatus status;
};

class SchedulerInterface {
 public:
  virtual ~SchedulerInterface() = default;
  // Starts a node; returns once it was handed to the backend (not once it joined).
  virtual absl::Status LaunchNode(const NodeSpec& spec) = 0;
  // Nodes whose agents ended since the last call.
  virtual std::vector<NodeExit> PollExited() = 0;
  // Names of nodes still running.
  virtual std::vector<std::string> RunningNodes() const = 0;
  // Stops one node (SIGTERM, SIGKILL after grace_s). NotFound if unknown.
  virtual absl::Status StopNode(const std::string& name, double grace_s) = 0;
  // Stops every node.
  virtual void StopAll(double grace_s) = 0;
};

}  // namespace ballast::scheduler
