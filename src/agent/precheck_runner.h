// PrecheckRunner: the agent's side of the pre-flight check. For a RunCheck
// decision it resolves the group's MASTER_ADDR:PORT through the master's KV
// store (group rank 0 publishes it), hands the check to one warm check server
// per local rank (`python -u -m ballast.precheck --serve DIR`: matmul
// benchmark + allreduce over gloo, or nccl on GPU), watches them against the
// check's timeout and reports one CheckResult per node: ok when every local
// rank passed, time = the slowest local rank's measured seconds.
//
// The servers import torch (and initialize CUDA) once and then run one check
// per request file, so the second and third round of a check, and the check
// of a node that waited, pay no interpreter start-up. Warm() starts them
// early (an agent with --network-check does so right after joining). They are
// stopped before training starts (Stop(), from the agent's StopWorkers), so
// they hold no GPU memory while workers run. A server that failed a check
// exits; the next check starts fresh servers (a new generation directory, so
// no old request is replayed).
//
// Chaos (common/chaos.h), applied to the node rank the agent was given:
//   check-fail  the check servers report a failure after the check, so the
//               group fails as a whole;
//   check-slow  the measured time is multiplied by `factor`.
//
// Ownership: owned by the Agent; borrows its MasterClient, which must outlive
// it. Threading: driven from the agent's main loop only (it forks the
// servers, whose PR_SET_PDEATHSIG is tied to that thread).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "agent/master_client.h"
#include "ballast/v1/master.pb.h"
#include "common/chaos.h"
#include "common/subprocess.h"

namespace ballast::agent {

struct PrecheckRunnerOptions {
  std::string node_id;
  std::string host;                             // published as the group's MASTER_ADDR
  int node_rank = -1;                           // --node-rank (chaos faults aim at it)
  int nproc_per_node = 1;
  std::string python = "python3";
  std::map<std::string, std::string> base_env;  // the workers' environment (PYTHONPATH set)
  ChaosSpec chaos;
  double kv_wait_s = 120.0;
};

class PrecheckRunner {
 public:
  PrecheckRunner(PrecheckRunnerOptions options, MasterClient* client);
  ~PrecheckRunner();
  PrecheckRunner(const PrecheckRunner&) = delete;
  PrecheckRunner& operator=(const PrecheckRunner&) = delete;

  // Starts the check servers unless they run (best effort: a failure to
  // start is reported by the next Start).
  void Warm();
  // Starts the check of `rc` (ending an unfinished older one first). An older
  // or repeated check_id is ignored. `superseded` is polled while waiting for
  // the group's endpoint; when it turns true the start is abandoned. Setup
  // failures are reported to the master as a failed result.
  void Start(const v1::RunCheck& rc, const std::function<bool()>& superseded);
  // Call from the monitor loop: collects the servers' results, enforces the
  // timeout and reports the result once the check ended.
  void Poll();
  // Stops the servers and a running check without reporting.
  void Stop();
  bool running() const { return check_running_; }

 private:
  // Starts a new generation of servers unless every server of the current
  // one runs.
  absl::Status EnsureServers();
  void Finish(bool ok, double time_s, const std::string& error);
  std::string GenerationDir() const;
  std::string ServerLog(int local_rank) const;
  std::string RequestPath(int local_rank) const;
  std::string ResultPath(int local_rank) const;

  PrecheckRunnerOptions options_;
  MasterClient* client_;
  std::string dir_;  // per-agent temp dir; one subdirectory per server generation
  int generation_ = 0;
  int64_t seq_ = 0;  // requests sent to this generation's servers
  int64_t last_check_id_ = 0;
  v1::RunCheck current_;
  std::vector<Subprocess> servers_;  // one per local rank
  bool check_running_ = false;
  std::chrono::steady_clock::time_point started_;
};

}  // namespace ballast::agent
