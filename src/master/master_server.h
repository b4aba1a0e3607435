// The job master: the gRPC service of proto/ballast/v1/master.proto around the
// job state machine (rendezvous, node table, fault policy, KV store, decision
// streams). `ballast master`, `ballast launch` and `ballast run --standalone`
// all run one of these.
//
// Ownership: MasterServer owns the gRPC server, the JobMaster state and a ticker
// thread that evaluates timeouts (heartbeats, last call, waiting for nodes).
// Thread safety: all public methods are thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "ballast/v1/journal.pb.h"
#include "ballast/v1/master.pb.h"
#include "common/clock.h"
#include "common/tls.h"
#include "health/health_policy.h"
#include "master/goodput.h"

namespace ballast::master {

struct MasterOptions {
  std::string bind_host = "0.0.0.0";  // address the gRPC server listens on
  int port = 0;                       // 0: pick a free port (read it back with port())
  std::string advertise_host;         // host agents use to reach us; "" = HostName()
  std::string token;                  // required, non-empty: every RPC must carry it
  // The HTTP interface (master/http_server.h: dashboard, /api/v1/job,
  // /api/v1/events, /metrics) on bind_host: -1 off, 0 any free port.
  int http_port = -1;
  // The port was a default (beside the gRPC port), not asked for: when it is
  // taken, take any free one and say so rather than fail the job.
  bool http_port_is_default = false;
  bool metrics_public = false;        // /metrics without the token
  // The journal directory (master/journal.h): "" none. When it holds a job the
  // master resumes it (the job id, settings and port must match or be left
  // out: a port of 0 takes the journal's) and agents that reconnect go on
  // training; else a new job starts there.
  std::string journal_dir;
  // TLS (common/tls.h): cert + key serve TLS; a CA as well requires client
  // certificates signed by it. Off when empty.
  TlsFiles tls;
  std::string job_id;                 // TORCHELASTIC_RUN_ID; "" = random
  int min_nodes = 1;
  int max_nodes = 1;
  int expected_nodes = 0;  // JobMasterOptions::expected_nodes
  int node_unit = 1;
  int max_restarts = 3;
  // Defaults (negative) come from Tunables (common/tunables.h).
  double last_call_s = -1;
  double heartbeat_interval_s = -1;
  double heartbeat_timeout_s = -1;
  double wait_for_nodes_s = -1;
  // Pre-flight check of every node before it trains (an agent joining with
  // --network-check turns it on too); stragglers in it are replaced, not
  // just reported, with exclude_stragglers.
  bool precheck = false;
  bool exclude_stragglers = false;
  // What a bad loss reported with ballast.step(step, loss=) does (health/health_policy.h).
  health::HealthPolicy health;
  ClockInterface* clock = nullptr;  // nullptr: SteadyClock
  // Called (outside the master's lock) when a node dies or leaves, with its id
  // and the reason. The scheduler seam hooks in here.
  std::function<void(const std::string& node_id, const std::string& reason)> on_node_lost;
  // Called with the master's lock held when a node is excluded (failed the
  // pre-flight check): it must only queue.
  std::function<void(const std::string& node_id, const std::string& reason)> on_node_excluded;
  // Called with the master's lock held when a node's agent hangs up its
  // decision stream while the job runs (JobMasterOptions): it must only queue.
  std::function<void(const std::string& node_id)> on_node_disconnected;
  // JobMasterOptions::goodput_before.
  GoodputBefore goodput_before;
};

// The HTTP port a master gets by default: the one after its gRPC port, or
// any free port when the gRPC port is picked too (0).
inline int HttpPortBeside(int grpc_port) { return grpc_port == 0 ? 0 : grpc_port + 1; }

struct JobResult {
  bool succeeded = false;
  std::string message;
  int restart_count = 0;
};

class MasterServer {
 public:
  // Validates the options (kInvalidArgument with a message that says what to
  // fix), binds, and starts serving.
  static absl::StatusOr<std::unique_ptr<MasterServer>> Start(const MasterOptions& options);
  ~MasterServer();  // Shutdown(0)

  int port() const;
  std::string address() const;  // advertise_host:port
  const std::string& token() const;
  const std::string& job_id() const;
  int http_port() const;              // 0 when the HTTP interface is off
  // http://advertise_host:http_port/?token=TOKEN ("" when off): what a person opens.
  std::string dashboard_url() const;
  // Whether this master resumed a job its journal held (an earlier master
  // process served it): the job's nodes are already running.
  bool resumed() const;
  // The journal's state once it moved past seq (JobMaster::JournalStateAfter).
  std::optional<v1::MasterSnapshot> JournalStateAfter(uint64_t seq) const;

  // Blocks until the job finished or timeout_s passed (< 0: forever).
  std::optional<JobResult> WaitForFinish(double timeout_s = -1);
  v1::JobStatus Status() const;
  // Fails the job (JobMaster::Abort).
  void Abort(const std::string& message);
  // JobMaster::Suspended.
  void Suspended();
  // The job's scheduler reports the node gone (a Ray node or actor death, a
  // Slurm node down): it is lost now, before its heartbeats run out
  // (JobMaster::Leave with `lost`). A node the master no longer has is ignored.
  void NodeLost(const std::string& node_id, const std::string& reason);

  // Stops serving. Waits up to linger_s for every connected agent to have been
  // sent the final decision, then shuts the gRPC server down. Idempotent.
  void Shutdown(double linger_s = 0);

 private:
  MasterServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ballast::master
