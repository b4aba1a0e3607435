// Slurm backend: the job runs inside one Slurm allocation (sbatch/salloc).
// Each node is one agent (`ballast run`) started as its own job step on one
// allocation node: `srun --overlap -N1 -n1 -w HOST ...`, so a lost node ends
// only its step. A node's name (its agent's node id) is its Slurm node name:
// messages, `ballast status` and squeue agree.
//
// What it carries out for NodeManager: a launch takes the next free node of
// the allocation (in allocation order); a released or lost node is never used
// again in this job (its step is cancelled, so none is left RUNNING to block
// later srun calls). Node loss comes from three places: the master (agent
// silent or disconnected, heartbeat speed: NodeManager hears it from the
// master), the step's srun ending (kExited), and Slurm's node state (DOWN,
// DRAIN, FAIL or not responding: kLost, from sinfo every few seconds). srun's
// exit code is only reported, never trusted: `srun -k` exits 0 after losing a
// task; the master's node table is the truth.
//
// The Slurm commands (srun, scancel, sinfo, squeue, scontrol) are found on
// PATH; SlurmTools names them (tests point them at stand-ins).
//
// Threading: driven from one thread (the launcher's loop), like every
// SchedulerInterface; that thread must live as long as the steps (srun is
// killed with it: PR_SET_PDEATHSIG).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/subprocess.h"
#include "scheduler/local/local_scheduler.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler::slurm {

struct SlurmTools {
  std::string srun = "srun";
  std::string scancel = "scancel";
  std::string sinfo = "sinfo";
  std::string squeue = "squeue";
  std::string scontrol = "scontrol";
  double timeout_s = 10;  // for one query or control command (Tunables slurm_command_timeout_s)
};

// The allocation this process runs in, from the SLURM_* environment.
struct SlurmAllocation {
  std::string job_id;               // SLURM_JOB_ID
  std::vector<std::string> nodes;   // SLURM_JOB_NODELIST, expanded, in allocation order
  std::string batch_host;           // SLURMD_NODENAME: where this process runs ("" outside a step)
  std::string Describe() const;     // "Slurm job 12 (n[1-5]: 5 nodes)"
  std::string nodelist;             // SLURM_JOB_NODELIST as Slurm wrote it
};

// Reads and checks the allocation: inside one (SLURM_JOB_ID set), a node list
// that expands (`scontrol show hostnames`) to as many nodes as
// SLURM_JOB_NUM_NODES says. Errors say what to do.
absl::StatusOr<SlurmAllocation> ReadAllocation(const std::map<std::string, std::string>& env, const SlurmTools& tools);

// Whether a node in this sinfo %T state is gone for the job: down, drained or
// draining, failed, or not responding (a trailing '*').
bool NodeStateIsLost(const std::string& state);

struct SlurmSchedulerOptions {
  SlurmAllocation allocation;
  SlurmTools tools;
  // The agent's command line and extra environment for a node (the host is
  // request.name).
  LocalScheduler::CommandFor command_for;
  double node_state_poll_s = 2;  // how often Slurm's node states are read (Tunables slurm_node_state_poll_s)
  int spares = 0;  // --spares: the allocation was sized for them (messages only)
};

class SlurmScheduler : public SchedulerInterface {
 public:
  explicit SlurmScheduler(SlurmSchedulerOptions options);
  ~SlurmScheduler() override;  // StopAll(0)

  std::string Kind() const override { return "slurm"; }

  // The name of the next node to launch: the first allocation node that is
  // neither in use nor used before (released, lost, excluded). When none is
  // left, a placeholder that LaunchNode refuses with kResourceExhausted
  // saying so. Use as NodeManagerOptions::name.
  std::string NextNodeName(int node_rank, int incarnation);

  // Starts the agent step on node request.name (from NextNodeName). The
  // request's avoid_hosts are never free anyway (a used node is not reused).
  absl::Status LaunchNode(const NodeRequest& request) override;
  // Cancels the node's step (scancel, then SIGTERM/SIGKILL of its srun after
  // grace_s); the node is not used again.
  absl::Status ReleaseNode(const std::string& name, const std::string& reason, double grace_s) override;
  std::vector<NodeEvent> Poll() override;
  std::vector<std::string> RunningNodes() const override;
  void StopAll(double grace_s) override;

  // Drains a node in Slurm (`scontrol update nodename=N state=drain
  // reason=...`); kPermissionDenied when Slurm does not permit it.
  absl::Status Drain(const std::string& node, const std::string& reason);

  // Allocation nodes not in use and not used before: the free spares.
  std::vector<std::string> FreeNodes() const;
  // Allocation nodes this job will not use again, with why.
  const std::map<std::string, std::string>& retired() const { return retired_; }

 private:
  struct Step {
    Subprocess srun;
    std::string step_name;  // srun --job-name: how squeue names its step
  };
  // The step ids (JOB.N) of our steps, by step name (squeue -s).
  std::map<std::string, std::string> StepIds();
  void CancelSteps(const std::vector<std::string>& step_names);
  void Retire(const std::string& node, const std::string& why);

  const SlurmSchedulerOptions options_;
  struct Stopping {
    Subprocess srun;
    std::chrono::steady_clock::time_point deadline;  // SIGKILL after this
  };
  std::map<std::string, Step> steps_;              // running, by node name
  std::vector<Stopping> stopping_;                 // released, srun not ended yet
  std::set<std::string> reserved_;                 // named by NextNodeName, not launched yet
  std::map<std::string, std::string> retired_;     // node -> why it is not used again
  std::vector<NodeEvent> pending_events_;          // kStarted / kLost not yet polled
  std::chrono::steady_clock::time_point next_state_poll_{};
};

}  // namespace ballast::scheduler::slurm
