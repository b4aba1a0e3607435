// The goodput simulator behind `ballast simulate`: a discrete-event
// simulation of a training job on thousands of GPUs for days, driving the real
// master code (JobMaster with its rendezvous, node table, fault policy and
// goodput accountant; NodeManager through the scheduler seam) on a virtual
// clock, with simulated agents in place of processes and no sockets.
//
// The same random fault schedule (per-GPU failures at a rate, a share that a
// process restart fixes, the rest needing a new node) is run under three
// policies:
//   manual   no automation: a failure stops the job; a person restarts it (or
//            replaces the node) after a delay, from the last disk checkpoint;
//   dlrover  DLRover-like: automatic process restart in place, a new pod for
//            a lost node, a disk checkpoint every N steps;
//   ballast  what Ballast does: warm restart in place, hot spares take a lost
//            node's place at once (a replacement spare is requested), a flash
//            checkpoint every step (no rollback, memory or peer replicas).
// A policy is a set of costs (how long a restart takes, what a checkpoint
// blocks, how far a restart rolls back); the decisions (when a node is lost,
// which world forms, what counts as a restart, where the time went) are the
// master's own.
//
// What it leaves out: a lost node's peers' collective errors (the master
// holds and drops them as it does for real), stragglers, pre-flight checks,
// and failures of spares outside the world.
//
// Thread safety: none; each run owns its master and clock.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast::sim {

enum class Policy { kManual, kDlrover, kBallast };
const char* PolicyName(Policy p);

// One fault: at `at_s` a node of the world (`pick` in [0, 1) chooses which)
// has a process failure (a restart fixes it) or is lost (it needs a new node).
struct Fault {
  double at_s = 0;
  double pick = 0;
  bool node_loss = false;
};

struct SimOptions {
  int gpus = 1000;
  int gpus_per_node = 8;
  double days = 7;
  double failure_rate_per_gpu_day = 0.0027;  // 8% a month (Ant Group)
  double restart_fixable = 0.75;             // share a process restart fixes (DLRover's figure)
  double node_replacement_s = 600;           // a new node until its agent joins
  int spares = 0;                            // hot spare nodes (ballast policy)
  double step_time_s = 2.0;
  uint64_t seed = 1;
  int64_t steps = 0;                         // > 0: the job ends at this step (else after `days`)
  // Policy costs.
  double job_start_s = 180;        // a job's first start: processes, process group, first step
  double manual_delay_s = 3600;    // manual: until a person restarts the job or replaces the node
  double dlrover_restart_s = 90;   // dlrover: a process restart in place until training
  double disk_ckpt_interval_s = 1800;  // manual, dlrover: training time between disk checkpoints
  double disk_ckpt_s = 60;         // manual, dlrover: training blocked per disk checkpoint
  double ballast_restart_s = 30;   // ballast: a warm restart until training (memory load)
  double flash_ckpt_s = 0.02;      // ballast: training blocked per step's flash checkpoint
  double detect_s = 0.1;           // an agent seeing its worker fail
  double heartbeat_timeout_s = 30; // a silent node is lost
  std::vector<Fault> faults;       // when set: this schedule, not a random one
  bool random_faults = true;
  std::vector<Policy> policies = {Policy::kManual, Policy::kDlrover, Policy::kBallast};
};

absl::Status ValidateSimOptions(const SimOptions& o);
// "T:node|process,T:node|process,...": faults at T seconds (pick 0).
absl::StatusOr<std::vector<Fault>> ParseFaultSchedule(const std::string& text);
// The fault schedule for o (seeded; the same for every policy).
std::vector<Fault> RandomFaults(const SimOptions& o);
// P(at least one failure a day) = 1 - exp(-gpus x rate).
double FailureProbabilityPerDay(const SimOptions& o);

struct PolicyResult {
  Policy policy = Policy::kBallast;
  double wall_s = 0;
  double goodput = 0;
  std::vector<std::pair<std::string, double>> parts;  // the accountant's parts, seconds
  double Part(const std::string& name) const;         // one of them (0 when absent)
  int process_failures = 0;
  int node_failures = 0;
  int restarts = 0;           // in-place restarts the master counted
  int rounds = 0;
  int replacements = 0;       // nodes the node manager launched after the first ones
  double mean_resume_s = 0;   // failure decision -> next round's first step
  int64_t steps = 0;          // the highest step reached
  std::vector<std::pair<double, double>> goodput_series;  // (hours, goodput so far)
  double sim_cpu_s = 0;       // CPU seconds of its run (the master's and the simulated agents')
};

struct SimResult {
  int nodes = 0;
  double p_failure_per_day = 0;
  std::vector<Fault> faults;
  std::vector<PolicyResult> policies;
};

PolicyResult RunPolicy(const SimOptions& o, Policy p, const std::vector<Fault>& faults);
SimResult Simulate(const SimOptions& o);

// One JSON document: inputs, p_failure_per_day and `policies` keyed by name,
// each with goodput and the time lost by cause.
std::string SimResultJson(const SimOptions& o, const SimResult& r);
// hours,manual,dlrover,ballast: each policy's goodput so far over the run.
std::string SimSeriesCsv(const SimResult& r);
// A readable summary, one paragraph per policy.
std::string SimResultText(const SimOptions& o, const SimResult& r);

}  // namespace ballast::sim
