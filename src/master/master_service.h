// MasterService: the gRPC face (ballast.v1.Master, sync API) of a JobMaster.
// Every handler first checks the job token (metadata "x-ballast-token"): a
// missing or wrong token is refused with UNAUTHENTICATED, logged at warn with
// the peer address, and changes nothing. Otherwise the handler forwards to the
// JobMaster and passes its status code through unchanged.
//
// Watch holds its RPC thread for the stream's life, waiting on the node's
// outbox in short slices so it notices a cancelled call and server shutdown.
// After JobFinished (the last decision) the stream stays open until the agent
// hangs up or the server shuts down (UNAVAILABLE), so agents never mistake a
// finished job for a lost master.
//
// Ownership: borrows the JobMaster, which must outlive the service (and the
// grpc::Server it is registered with). Thread safety: handlers run
// concurrently on gRPC's threads; JobMaster is thread-safe.
#pragma once

#include <string>

#include "ballast/v1/master.grpc.pb.h"
#include "master/job_master.h"

namespace ballast::master {

class MasterService final : public v1::Master::Service {
 public:
  // How often a Watch stream wakes to check for cancellation and shutdown.
  static constexpr double kWatchPollS = 0.05;

  MasterService(JobMaster* job, std::string token);

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  grpc::Status Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* request,
                     v1::Ack* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status ReportFailure(grpc::ServerContext* ctx, const v1::FailureReport* request,
                             v1::Ack* response) override;
  grpc::Status ReportWorkersDone(grpc::ServerContext* ctx, const v1::WorkersDoneRequest* request,
                                 v1::Ack* response) override;
  grpc::Status ReportProgress(grpc::ServerContext* ctx, const v1::ProgressReport* request,
                              v1::Ack* response) override;
  grpc::Status ReportCheckResult(grpc::ServerContext* ctx, const v1::CheckResult* request,
                                 v1::Ack* response) override;
  grpc::Status KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* request,
                     v1::Ack* response) override;
  grpc::Status KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* request,
                     v1::KvGetResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* ctx, const v1::WatchRequest* request,
                     grpc::ServerWriter<v1::Decision>* writer) override;
  grpc::Status ReportShardDurable(grpc::ServerContext* ctx, const v1::ShardDurableReport* request,
                                  v1::ShardDurableResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::StatusRequest* request,
                         v1::JobStatus* response) override;

 private:
  // OK when the call carries the job token; else UNAUTHENTICATED (logged).
  grpc::Status Authenticate(const grpc::ServerContext& ctx, const char* rpc) const;

  JobMaster* job_;
  const std::string token_;
};

}  // namespace ballast::master
