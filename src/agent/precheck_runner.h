// PrecheckRunner: the agent's side of the pre-flight check. For a RunCheck
// decision it resolves the group's MASTER_ADDR:PORT through the master's KV
// store (group rank 0 publishes it), starts local_world_size check workers
// (`python -u -m ballast.precheck`: matmul benchmark + allreduce over gloo,
// or nccl on GPU), watches them against the check's timeout and reports one
// CheckResult per node: ok when every worker exited 0, time = the slowest
// worker's measured seconds.
//
// Chaos (common/chaos.h), applied to the node rank the agent was given:
//   check-fail  the check workers exit non-zero after the check
//               (BALLAST_PRECHECK_FAIL=1), so the group fails as a whole;
//   check-slow  the measured time is multiplied by `factor`.
//
// Ownership: owned by the Agent; borrows its MasterClient, which must outlive
// it. Threading: driven from the agent's main loop only (it forks the
// workers, whose PR_SET_PDEATHSIG is tied to that thread).
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

  // Starts the check of `rc` (stopping an older one first). An older or
  // repeated check_id is ignored. `superseded` is polled while waiting for
  // the group's endpoint; when it turns true the start is abandoned. Setup
  // failures are reported to the master as a failed result.
  void Start(const v1::RunCheck& rc, const std::function<bool()>& superseded);
  // Call from the monitor loop: reaps the workers, enforces the timeout and
  // reports the result once the check ended.
  void Poll();
  // Kills a running check without reporting.
  void Stop();
  bool running() const { return !procs_.empty(); }

 private:
  void Finish(bool ok, double time_s, const std::string& error);
  std::string LogPath(int local_rank) const;
  std::string ResultPath(int local_rank) const;

  PrecheckRunnerOptions options_;
  MasterClient* client_;
  std::string dir_;  // per-agent temp dir for the workers' logs and results
  int64_t last_check_id_ = 0;
  v1::RunCheck current_;
  std::vector<Subprocess> procs_;
  std::chrono::steady_clock::time_point started_;
};

}  // namespace ballast::agent
