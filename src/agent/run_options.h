// `ballast run` options: a drop-in for torchrun's command line. Both spellings
// of every flag are accepted (--nproc-per-node / --nproc_per_node), as is
// --flag=value. The first non-flag argument is the training script (or module
// with -m, or program with --no-python); everything after it belongs to it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_priority.h"
#include "common/tls.h"

namespace ballast::agent {

struct RunOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  bool nnodes_given = false;
  int nproc_per_node = 1;
  std::optional<int> max_restarts;     // unset: the master's (default 3)
  std::string rdzv_endpoint;           // HOST:PORT of the master, "" = none
  std::string rdzv_id;                 // run id, "" = the master's
  std::string rdzv_backend;            // accepted and ignored (with a note)
  std::string rdzv_conf;               // k=v,k=v: last_call_timeout, join_timeout, timeout
  bool standalone = false;
  int node_rank = -1;                  // --node-rank hint; -1 = none
  std::string master_addr;             // torchrun static rendezvous: master host
  int master_port = -1;                // and port (hosts the ballast master on node rank 0)
  std::string local_addr;              // this node's address for others; "" = derived
  bool module = false;                 // -m / --module
  bool no_python = false;              // --no-python
  bool run_path = false;               // --run-path
  std::string log_dir;                 // --log-dir; "" = none
  std::string redirects = "0";         // -r/--redirects: 0..3 or per-rank map "0:1,1:2"
  std::string tee = "0";               // -t/--tee: same format
  double monitor_interval_s = 0.05;    // --monitor-interval (how often workers are polled)
  double hang_timeout_s = 0;           // --hang-timeout; 0 = no hang detection
  std::string save_every;              // --save-every N|auto|auto:MAX for the workers' Checkpointer; "" = theirs
  double mtbf_s = 0;                   // --mtbf DURATION: the prior of save_every auto; 0 = not given
  double ckpt_copy_share = 0;          // --ckpt-copy-share F in (0, 1]; 0 = the workers' default (0.25)
  std::string role = "default";        // --role
  bool precheck = false;               // --network-check / --precheck 1: pre-flight check
  bool exclude_stragglers = false;     // --exclude-stragglers
  // Training health (health/health_policy.h); unset: the master's.
  std::string on_nan;                  // --on-nan rollback|fail|ignore
  std::optional<int> max_rollbacks;    // --max-rollbacks K
  double loss_spike_z = 0;             // --loss-spike Z (0: not given)
  bool no_skip_data = false;           // --no-skip-data
  std::optional<int> replica_check_every;  // --replica-check-every N
  int node_unit = 0;                   // --node-unit; 0 = the master's
  std::string token;                   // --token or BALLAST_TOKEN
  TlsFiles tls;                        // --tls-cert/--tls-key/--tls-ca, else BALLAST_TLS_* (common/tls.h)
  std::string python = "python3";      // --python INTERPRETER
  bool warm_restart = true;            // --no-warm-restart turns it off (see warm_pool.h)
  bool warm_fork = true;               // --no-warm-fork: hand out the interpreters, not forks of them
  // The embedded master's HTTP interface (--standalone, or node rank 0 with
  // --master-addr): unset = beside its gRPC port (port + 1; any free port
  // when that is 0), -1 = off.
  std::optional<int> http_port;
  bool metrics_public = false;         // --metrics-public: /metrics without the token
  int ckpt_replicas = 1;               // --ckpt-replicas K: peer nodes holding each rank's newest step (replica.h)
  int ckpt_copy_nice = kDefaultCopyNice;  // --ckpt-copy-nice N: the copy threads' nice (thread_priority.h)
  std::vector<std::string> warm_modules;  // --warm-modules a,b: imported by warm interpreters besides torch
  std::string training_script;         // script, module, or program
  std::vector<std::string> training_args;
  // Tunable overrides from --rdzv-conf (negative: not given).
  double last_call_s = -1;
  double join_timeout_s = -1;
};

// Parses the arguments after `ballast run`. Errors are kInvalidArgument with a
// message that names the flag and says what to do; the CLI exits 2 on them.
absl::StatusOr<RunOptions> ParseRunArgs(const std::vector<std::string>& args);

// Help text for `ballast run --help`.
std::string RunUsage();

// Runs the agent (and, for --standalone or node rank 0 with --master-addr, an
// embedded master) until the job ends. Returns the process exit code:
// 0 job succeeded, 1 job failed or could not start, 128+N stopped by signal N.
int RunAgent(const RunOptions& options);

}  // namespace ballast::agent
