// Ray backend: each node is one agent (`ballast run`) inside an agent actor
// pinned to its own Ray node (`ballast ray run`). Ray is reached through the
// Ray bridge (python/ballast/_ray_bridge.py): a child process of this one,
// the only part of Ballast that speaks Ray's Python API. It places agent
// actors (hard node affinity, the per-node CPUs, GPUs and custom resources
// requested so no second agent lands on a node), watches them, and reports
// what Ray saw. This class carries NodeManager's decisions to it and turns
// its reports into NodeEvents.
//
// The protocol: one JSON object per line over a socketpair (the bridge's fd 3).
//   to the bridge:   {"op":"launch","name","node_rank","incarnation","argv":[...],"env":{...},"avoid":[...]}
//                    {"op":"release","name","reason","grace"}
//                    {"op":"stop_all","grace"}
//                    {"op":"master_start","argv":[...],"env":{...},"journal","node","advertise_host","cleanup"}
//                    {"op":"master_kill"}             chaos: the master's actor killed, Ray restarts it
//                    {"op":"master_stop","grace"}
//   from the bridge: {"ev":"ready","nodes":N,"address":A,"ip":I}   once, after connecting (I: this node's address)
//                    {"ev":"started","name","host"}   the agent runs on Ray node `host`
//                    {"ev":"exited","name","code","signal"}
//                    {"ev":"lost","name","reason"}    Ray reported the actor or its node dead
//                    {"ev":"pending","name","reason"} no free Ray node fits it yet (reported once)
//                    {"ev":"stopped"}                 every agent of stop_all ended
//                    {"ev":"error","message"}         fatal: the bridge exits
//                    {"ev":"master_started","host","ip","port","pid","incarnation"}  (again after each Ray restart)
//                    {"ev":"master_died","reason"}    its actor died; Ray restarted it (master_started follows)
//                    {"ev":"master_exited","code","signal"}  the master process ended by itself
//                    {"ev":"master_lost","reason"}    its actor is dead for good (or could not be placed)
//                    {"ev":"master_stopped","code","signal"}  after master_stop
// The master's ops and events are the master actor's (`ballast ray run`'s
// default): `ballast master --journal DIR` in an actor pinned to one Ray node
// (the head unless told otherwise), which Ray restarts there when it dies;
// every incarnation serves the same port, so the agents reconnect.
// A node's host is its Ray node as users see it: "ray:<node id, 12 hex>@<ip>".
// A launch with no free Ray node stays queued in the bridge and starts when
// one joins (an autoscaled or KubeRay-recreated node, or one added by hand).
//
// Threading: driven from one thread (the launcher's loop), like every
// SchedulerInterface; that thread must live as long as the bridge (it is
// killed with it: PR_SET_PDEATHSIG).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/subprocess.h"
#include "scheduler/local/local_scheduler.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler::ray {

struct RaySchedulerOptions {
  // The bridge's command line (python -m ballast._ray_bridge ...) and its
  // complete environment.
  std::vector<std::string> bridge_argv;
  std::map<std::string, std::string> bridge_env;
  // Seconds to wait for the bridge's "ready" (connecting to the cluster).
  double connect_timeout_s = 120;
  LocalScheduler::CommandFor command_for;
};

// What the bridge said about the master actor.
struct MasterActorEvent {
  enum class Kind { kStarted, kDied, kExited, kLost, kStopped };
  Kind kind = Kind::kStarted;
  std::string host;  // kStarted: its Ray node, "ray:<id>@<ip>"
  std::string ip;
  int port = 0;
  int pid = 0;
  int incarnation = 0;
  ExitStatus status;   // kExited, kStopped
  std::string reason;  // kDied, kLost
};

struct MasterActorSpec {
  std::vector<std::string> argv;  // `ballast master ...` without --host/--port/--advertise-host
  std::map<std::string, std::string> env;
  std::string journal;         // on the master's node
  std::string node = "head";   // "head", a Ray node's IP, or its id (a prefix of it)
  std::string advertise_host;  // "" = the node's Ray address
  bool cleanup = false;        // the journal directory is removed when the master is stopped
};

class RayScheduler : public SchedulerInterface {
 public:
  // Starts the bridge and waits until it connected to the cluster. Errors
  // carry the bridge's own message (Ray not installed, no cluster at the
  // address, ...).
  static absl::StatusOr<std::unique_ptr<RayScheduler>> Start(RaySchedulerOptions options);
  ~RayScheduler() override;  // StopAll(0), then the bridge ends

  std::string Kind() const override { return "ray"; }
  absl::Status LaunchNode(const NodeRequest& request) override;
  absl::Status ReleaseNode(const std::string& name, const std::string& reason, double grace_s) override;
  std::vector<NodeEvent> Poll() override;
  std::vector<std::string> RunningNodes() const override;
  void StopAll(double grace_s) override;

  // What the bridge said when it connected: "Ray cluster at A: N alive nodes".
  const std::string& cluster() const { return cluster_; }
  // This node's address in the cluster (where the agents reach the master).
  const std::string& driver_ip() const { return driver_ip_; }

  // The master actor (see the protocol above). Its events are kept apart
  // from the nodes'; MasterEvents returns those read so far, reading the
  // bridge up to timeout_s when there are none.
  absl::Status StartMaster(const MasterActorSpec& spec);
  absl::Status KillMaster();
  absl::Status StopMaster(double grace_s);
  std::vector<MasterActorEvent> MasterEvents(double timeout_s);
  // The bridge ended (its message, if any, was logged): nothing more comes.
  bool closed() const { return closed_; }

  // One line from the bridge, as Poll applies it (exposed for unit tests).
  // Returns the event it makes, if any; "ready"/"stopped" set flags.
  std::optional<NodeEvent> Apply(const std::string& line);

 private:
  explicit RayScheduler(RaySchedulerOptions options) : options_(std::move(options)) {}
  absl::Status Send(const std::string& json_line);
  // Reads what the bridge wrote, up to timeout_s for the first byte.
  void Read(double timeout_s);

  RaySchedulerOptions options_;
  Subprocess bridge_;
  std::string buffer_;
  std::string cluster_;
  std::string driver_ip_;
  bool ready_ = false;
  bool stopped_ = false;
  bool closed_ = false;            // the bridge's end is gone
  std::string fatal_;              // its "error" message, if any
  std::set<std::string> running_;  // launched, not ended nor released
  std::set<std::string> released_;
  std::vector<NodeEvent> events_;
  std::vector<MasterActorEvent> master_events_;
};

}  // namespace ballast::scheduler::ray
