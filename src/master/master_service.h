// MasterService: the gRPC face (ballast.v1.Master) of a JobMaster, on gRPC's
// callback API, so a few threads serve every agent: no thread waits for a
// Watch stream's next decision or a KvGet's key.
//
// Every handler first checks the job token (metadata "x-ballast-token"): a
// missing or wrong token is refused with UNAUTHENTICATED, logged at warn with
// the peer address, and changes nothing. Otherwise the handler forwards to the
// JobMaster and passes its status code through unchanged. Unary handlers run
// on gRPC's callback threads and return at once (the JobMaster's calls are
// short; a KvGet that waits registers a waiter, KvGetAsync).
//
// Watch is a write reactor fed by the node's outbox (JobMaster::DecisionSink):
// the master queues a decision, the reactor writes one at a time. After
// JobFinished (the last decision) the stream stays open until the agent hangs
// up or the server shuts down (UNAVAILABLE), so agents never mistake a
// finished job for a lost master.
//
// Ownership: borrows the JobMaster, which must outlive the service (and the
// grpc::Server it is registered with). Reactors delete themselves when gRPC
// is done with them (OnDone). Thread safety: handlers and reactions run
// concurrently on gRPC's threads; JobMaster is thread-safe.
#pragma once

#include <string>

#include "ballast/v1/master.grpc.pb.h"
#include "master/job_master.h"

namespace ballast::master {

class MasterService final : public v1::Master::CallbackService {
 public:
  MasterService(JobMaster* job, std::string token);

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest* request,
                                  v1::Ack* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* ReportFailure(grpc::CallbackServerContext* ctx, const v1::FailureReport* request,
                                          v1::Ack* response) override;
  grpc::ServerUnaryReactor* ReportWorkersDone(grpc::CallbackServerContext* ctx,
                                              const v1::WorkersDoneRequest* request, v1::Ack* response) override;
  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* ctx, const v1::ProgressReport* request,
                                           v1::ProgressResponse* response) override;
  grpc::ServerUnaryReactor* ReportCheckResult(grpc::CallbackServerContext* ctx, const v1::CheckResult* request,
                                              v1::Ack* response) override;
  grpc::ServerUnaryReactor* KvSet(grpc::CallbackServerContext* ctx, const v1::KvSetRequest* request,
                                  v1::Ack* response) override;
  grpc::ServerUnaryReactor* KvGet(grpc::CallbackServerContext* ctx, const v1::KvGetRequest* request,
                                  v1::KvGetResponse* response) override;
  grpc::ServerWriteReactor<v1::Decision>* Watch(grpc::CallbackServerContext* ctx,
                                                const v1::WatchRequest* request) override;
  grpc::ServerUnaryReactor* ReportShardDurable(grpc::CallbackServerContext* ctx,
                                               const v1::ShardDurableReport* request,
                                               v1::ShardDurableResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx, const v1::StatusRequest* request,
                                      v1::JobStatus* response) override;

 private:
  // OK when the call carries the job token; else UNAUTHENTICATED (logged).
  grpc::Status Authenticate(const grpc::CallbackServerContext& ctx, const char* rpc) const;
  // Authenticates, runs `fn` (a grpc::Status()) and finishes the call with its status.
  template <typename Fn>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const char* rpc, Fn&& fn);

  JobMaster* job_;
  const std::string token_;
};

}  // namespace ballast::master
