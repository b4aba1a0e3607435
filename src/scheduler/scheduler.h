// The scheduler seam: how the job gets, replaces and gives back nodes. A node
// is one `ballast run` agent; its name is the agent's node id
// (BALLAST_NODE_ID), so the master's messages and the scheduler's objects
// (a process, a pod, a Slurm step) name it the same way.
//
// The master decides (replace this node, avoid that host, stop waiting for a
// pending one): that policy lives in one place, NodeManager
// (node_manager.h), for every backend. A backend only carries decisions out
// and reports what its scheduler saw. Backends: local processes (local/,
// behind `ballast launch`), Kubernetes pods (kubernetes/, behind
// `ballast master --kubernetes-job`) and Slurm job steps (slurm/, behind
// `ballast slurm`).
//
// What a backend gives the policy: request a node (LaunchNode, with the
// hosts to avoid: where nodes were excluded), release it with a reason
// (ReleaseNode), and report what happened (Poll: started on a host, exited,
// lost with the scheduler's reason, pending too long).
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

// A node to start: the `incarnation`-th agent of node rank `node_rank`.
struct NodeRequest {
  std::string name;          // unique in the job; also the agent's node id
  int node_rank = 0;         // the agent's --node-rank (the rank hint nodes are ordered by)
  int incarnation = 1;       // 1 = the rank's first agent, 2 = its first replacement, ...
  // Hosts not to place it on (where nodes failed the pre-flight check).
  std::vector<std::string> avoid_hosts;
};

// Something the scheduler saw happen to a node.
struct NodeEvent {
  enum class Kind {
    kStarted,         // the agent runs (host known)
    kExited,          // the agent ended (status: its exit status)
    kLost,            // the scheduler lost it: deleted, evicted, its host down (reason)
    kPendingTooLong,  // not started after the backend's pending timeout (reason: what the scheduler says)
  };
  Kind kind = Kind::kStarted;
  std::string name;
  std::string host;    // where it runs or ran, as the scheduler names it ("" unknown)
  ExitStatus status;   // kExited
  std::string reason;  // kLost, kPendingTooLong
};

const char* NodeEventKindName(NodeEvent::Kind kind);

// A node an earlier master process of this job started and the scheduler
// still holds (a master that resumed from its journal takes it over instead
// of starting its rank again).
struct AdoptedNode {
  std::string name;
  int node_rank = 0;
  int incarnation = 1;
  std::string host;  // "" while not placed
};

class SchedulerInterface {
 public:
  virtual ~SchedulerInterface() = default;
  // "local", "kubernetes": for messages.
  virtual std::string Kind() const = 0;
  // Starts a node; returns once it was handed to the backend (not once it
  // runs, nor once it joined). kAlreadyExists for a name in use.
  virtual absl::Status LaunchNode(const NodeRequest& request) = 0;
  // Gives a node back: stops its agent (SIGTERM, SIGKILL after grace_s) and
  // frees what it held (the pod). NotFound if unknown. `reason` is recorded.
  virtual absl::Status ReleaseNode(const std::string& name, const std::string& reason, double grace_s) = 0;
  // What happened since the last call.
  virtual std::vector<NodeEvent> Poll() = 0;
  // Names of nodes launched and not yet ended or released.
  virtual std::vector<std::string> RunningNodes() const = 0;
  // Stops every node (the job is over, or the launcher stops).
  virtual void StopAll(double grace_s) = 0;
  // The nodes an earlier master process of this job left running, which this
  // backend took over when it started (its journal resumed the job): every
  // incarnation it found, ended ones included, so a replacement never reuses
  // a name. What happened to them since comes from Poll as for any node.
  // Default: none (the backend starts from nothing).
  virtual std::vector<AdoptedNode> AdoptedNodes() const { return {}; }
};

}  // namespace ballast::scheduler
