// The agent's gRPC client to the job master (proto/ballast/v1/master.proto).
//
// Every call carries the job token (kTokenMetadataKey) and a deadline; gRPC
// errors come back as absl::Status with the same code (FromGrpcStatus).
// Besides plain calls it runs two background threads once started:
//  - the watch thread keeps Watch(node_id) open and hands every Decision to a
//    callback; when the stream breaks it re-Joins and re-Watches with backoff
//    (the master re-sends the current decision on connect, so nothing is
//    missed), and after reconnect_timeout_s without success calls on_lost;
//  - the heartbeat thread sends Heartbeat every interval with a request the
//    owner provides; NOT_FOUND (the master forgot this node) triggers a re-Join.
//
// Ownership: MasterClient owns the channel, the stub and both threads.
// Threading: all methods are thread-safe. The callbacks run on the client's
// threads and must not block for long (the agent pushes into its event queue).
// Shutdown() (also run by the destructor) cancels the stream and joins both
// threads; no callback runs after it returns.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ballast/v1/master.grpc.pb.h"
#include "common/clock.h"

namespace ballast::agent {

// Whether a call's error says the master accepted the connection and closed
// it before answering ("Socket closed", "Connection reset"): what a client
// sees of a master that serves TLS when it has none, or of a mutual-TLS
// master that refused its client certificate (or its lack of one).
bool MasterClosedConnection(absl::string_view error);

struct MasterClientOptions {
  std::string endpoint;               // host:port
  std::string token;
  double rpc_timeout_s = 10.0;        // deadline of one ordinary call (Tunables rpc_timeout_s)
  double reconnect_timeout_s = 60.0;  // Tunables reconnect_timeout_s
  double backoff_initial_s = 0.1;     // retry backoff: 100 ms doubling ...
  double backoff_max_s = 2.0;         // ... to 2 s
  // TLS (common/tls.h MasterChannelCredentials); nullptr: insecure.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Where the master is now (host:port; "" unknown), asked at most every
  // locate_interval_s while the master is lost: a master that moved (a new
  // master pod on Kubernetes) is followed there. Unset: the endpoint is fixed.
  std::function<std::string()> locate;
  double locate_interval_s = 1.0;      // the first look; doubling (with jitter) ...
  double locate_interval_max_s = 4.0;  // ... to this while the answer does not change
};

class MasterClient {
 public:
  using DecisionCallback = std::function<void(const v1::Decision&)>;
  using LostCallback = std::function<void(const absl::Status&)>;
  using HeartbeatSource = std::function<v1::HeartbeatRequest()>;

  explicit MasterClient(MasterClientOptions options);
  ~MasterClient();
  MasterClient(const MasterClient&) = delete;
  MasterClient& operator=(const MasterClient&) = delete;

  // The master's address now (it changes when the master moved: locate).
  std::string endpoint() const;

  // Join, retried with backoff while the master is UNAVAILABLE or the call hits
  // its deadline, for up to timeout_s in total. Other errors (UNAUTHENTICATED,
  // FAILED_PRECONDITION, INVALID_ARGUMENT) return at once. timeout_s bounds
  // reaching the master: once the channel is connected (TCP and TLS done, the
  // master is there), its answer gets an ordinary call's deadline
  // (rpc_timeout_s) even where that runs past timeout_s, so a slow handshake
  // on a loaded machine does not turn the master's answer (a refused token)
  // into "cannot reach". After that the last error is returned with code
  // kUnavailable. The request is remembered for re-joins by the background
  // threads.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request, double timeout_s);

  // One call each, with the default deadline (Leave: timeout_s).
  absl::Status Leave(const std::string& node_id, const std::string& reason, double timeout_s);
  absl::Status Heartbeat(const v1::HeartbeatRequest& request);
  absl::Status ReportFailure(const v1::FailureReport& report);
  absl::Status ReportWorkersDone(const std::string& node_id, int64_t round);
  absl::StatusOr<v1::ProgressResponse> ReportProgress(const v1::ProgressReport& report, double timeout_s);
  absl::Status ReportCheckResult(const v1::CheckResult& result);
  absl::Status KvSet(const std::string& key, const std::string& value);
  // Flash checkpoint: a shard is durable; the answer says whether to commit.
  absl::StatusOr<v1::ShardDurableResponse> ReportShardDurable(const v1::ShardDurableReport& report,
                                                              double timeout_s);
  // Blocks up to wait_s on the master for the key to appear.
  absl::StatusOr<std::string> KvGet(const std::string& key, double wait_s);

  // Starts the watch thread (requires a successful Join first).
  void StartWatch(const std::string& node_id, DecisionCallback on_decision, LostCallback on_lost);
  // Starts the heartbeat thread. Heartbeats failing other than NOT_FOUND for
  // reconnect_timeout_s also count as a lost master (a partition without a
  // broken stream).
  void StartHeartbeat(double interval_s, HeartbeatSource source);

  // Cancels every call in flight (a Join in its retry loop returns
  // kCancelled) and makes later calls fail at once, without joining the
  // threads: safe to call from any thread, e.g. a signal handler thread.
  void Cancel();
  // Cancel(), then joins both threads. Idempotent.
  void Shutdown();

 private:
  // Registers a call's context so Shutdown can cancel it (RAII).
  class CallScope {
   public:
    CallScope(MasterClient* client, grpc::ClientContext* ctx, double timeout_s);
    ~CallScope();

   private:
    MasterClient* client_;
    grpc::ClientContext* ctx_;
  };
  void ConfigureContext(grpc::ClientContext* ctx, double timeout_s) const;
  absl::StatusOr<v1::JoinResponse> JoinOnce(const v1::JoinRequest& request, double timeout_s,
                                            bool wait_for_ready = false);
  absl::Status Rejoin();
  void WatchLoop(std::string node_id);
  void HeartbeatLoop(double interval_s);
  void ReportLost(const absl::Status& status);
  // Asks options_.locate (rate-limited) and switches to a new address;
  // true when it switched.
  bool Relocate();
  std::shared_ptr<v1::Master::Stub> Stub() const;
  // The channel is connected (READY): the master is reachable.
  bool Connected() const;
  // Sleeps up to seconds; returns false when Shutdown was called.
  bool SleepUnlessShutdown(double seconds);
  // As SleepUnlessShutdown, watching the channel meanwhile, and returns
  // early once it is connected. A synchronous client's connections make
  // progress only while a call or a watch polls them, and a fail-fast call
  // on a channel in TRANSIENT_FAILURE returns at once: without the watch
  // the reconnect attempt gRPC starts between our attempts (its TCP connect,
  // its TLS handshake) waited unserved.
  bool WatchChannelUnlessShutdown(double seconds);

  const MasterClientOptions options_;

  mutable std::mutex mu_;
  std::string endpoint_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<grpc::Channel> channel_ ABSL_GUARDED_BY(mu_);  // stub_'s
  std::shared_ptr<v1::Master::Stub> stub_ ABSL_GUARDED_BY(mu_);
  bool located_once_ ABSL_GUARDED_BY(mu_) = false;
  double locate_wait_s_ ABSL_GUARDED_BY(mu_) = options_.locate_interval_s;
  std::chrono::steady_clock::time_point located_at_ ABSL_GUARDED_BY(mu_);
  std::condition_variable cv_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool lost_reported_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);  // in flight
  std::optional<v1::JoinRequest> join_request_ ABSL_GUARDED_BY(mu_);
  DecisionCallback on_decision_;
  LostCallback on_lost_;
  HeartbeatSource heartbeat_source_;
  std::thread watch_thread_;
  std::thread heartbeat_thread_;
};

}  // namespace ballast::agent
