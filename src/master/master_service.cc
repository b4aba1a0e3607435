#include "master/master_service.h"

#include <utility>

#include "common/grpc_util.h"
#include "common/net.h"
#include "spdlog/spdlog.h"

namespace ballast::master {
MasterService::MasterService(JobMaster* job, std::string token)
    : job_(job), token_(std::move(token)) {}

grpc::Status MasterService::Authenticate(const grpc::ServerContext& ctx, const char* rpc) const {
  std::string given = TokenFromContext(ctx);
  if (!given.empty() && TokenEquals(given, token_)) return grpc::Status::OK;
  spdlog::warn("job={} {} refused (UNAUTHENTICATED) from {}: {} job token", job_->job_id(), rpc, ctx.peer(),
               given.empty() ? "missing" : "wrong");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or wrong job token: pass the token the master printed with "
                      "--token or BALLAST_TOKEN");
}

grpc::Status MasterService::Join(grpc::ServerContext* ctx, const v1::JoinRequest* request,
                                 v1::JoinResponse* response) {
  if (grpc::Status s = Authenticate(*ctx, "Join"); !s.ok()) return s;
  absl::StatusOr<v1::JoinResponse> r = job_->Join(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status MasterService::Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* request,
                                  v1::Ack* response) {
  if (grpc::Status s = Authenticate(*ctx, "Leave"); !s.ok()) return s;
  return ToGrpcStatus(job_->Leave(*request));
}

grpc::Status MasterService::Heartbeat(grpc::ServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) {
  if (grpc::Status s = Authenticate(*ctx, "Heartbeat"); !s.ok()) return s;
  return ToGrpcStatus(job_->Heartbeat(*request));
}

grpc::Status MasterService::ReportFailure(grpc::ServerContext* ctx,
                                          const v1::FailureReport* request, v1::Ack* response) {
  if (grpc::Status s = Authenticate(*ctx, "ReportFailure"); !s.ok()) return s;
  return ToGrpcStatus(job_->ReportFailure(*request));
}

grpc::Status MasterService::ReportWorkersDone(grpc::ServerContext* ctx,
                                              const v1::WorkersDoneRequest* request,
                                              v1::Ack* response) {
  if (grpc::Status s = Authenticate(*ctx, "ReportWorkersDone"); !s.ok()) return s;
  return ToGrpcStatus(job_->ReportWorkersDone(*request));
}

grpc::Status MasterService::ReportProgress(grpc::ServerContext* ctx,
                                           const v1::ProgressReport* request, v1::Ack* response) {
  if (grpc::Status s = Authenticate(*ctx, "ReportProgress"); !s.ok()) return s;
  return ToGrpcStatus(job_->ReportProgress(*request));
}

grpc::Status MasterService::ReportCheckResult(grpc::ServerContext* ctx,
                                              const v1::CheckResult* request, v1::Ack* response) {
  if (grpc::Status s = Authenticate(*ctx, "ReportCheckResult"); !s.ok()) return s;
  return ToGrpcStatus(job_->ReportCheckResult(*request));
}

grpc::Status MasterService::KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* request,
                                  v1::Ack* response) {
  if (grpc::Status s = Authenticate(*ctx, "KvSet"); !s.ok()) return s;
  return ToGrpcStatus(job_->KvSet(request->key(), request->value()));
}

grpc::Status MasterService::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* request,
                                  v1::KvGetResponse* response) {
  if (grpc::Status s = Authenticate(*ctx, "KvGet"); !s.ok()) return s;
  absl::StatusOr<std::string> value = job_->KvGet(request->key(), request->wait_ms() / 1000.0,
                                                  [ctx] { return ctx->IsCancelled(); });
  if (!value.ok()) return ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

grpc::Status MasterService::Watch(grpc::ServerContext* ctx, const v1::WatchRequest* request,
                                  grpc::ServerWriter<v1::Decision>* writer) {
  if (grpc::Status s = Authenticate(*ctx, "Watch"); !s.ok()) return s;
  absl::StatusOr<JobMaster::WatchHandle> handle = job_->OpenWatch(request->node_id());
  if (!handle.ok()) return ToGrpcStatus(handle.status());
  while (true) {
    if (ctx->IsCancelled()) {
      spdlog::info("job={} node={} watch stream cancelled by the client", job_->job_id(),
                   request->node_id());
      job_->CloseWatch(*handle);
      return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled");
    }
    absl::StatusOr<std::optional<v1::Decision>> next = job_->NextDecision(*handle, kWatchPollS);
    if (!next.ok()) {
      job_->CloseWatch(*handle);
      return ToGrpcStatus(next.status());
    }
    if (!next->has_value()) continue;
    const v1::Decision& d = **next;
    if (!writer->Write(d)) {
      spdlog::info("job={} node={} watch stream broke while writing", job_->job_id(),
                   request->node_id());
      job_->CloseWatch(*handle);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream broke");
    }
    // JobFinished is the last decision a node gets, but the stream stays open
    // until the agent hangs up or the master shuts down: an agent reads a
    // stream that ends by itself as a lost master and would try to re-join.
    if (d.has_job_finished()) job_->MarkFinalSent(*handle);
  }
}

grpc::Status MasterService::ReportShardDurable(grpc::ServerContext* ctx,
                                               const v1::ShardDurableReport* request,
                                               v1::ShardDurableResponse* response) {
  if (grpc::Status s = Authenticate(*ctx, "ReportShardDurable"); !s.ok()) return s;
  absl::StatusOr<v1::ShardDurableResponse> r = job_->ReportShardDurable(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status MasterService::GetStatus(grpc::ServerContext* ctx, const v1::StatusRequest* request,
                                      v1::JobStatus* response) {
  if (grpc::Status s = Authenticate(*ctx, "GetStatus"); !s.ok()) return s;
  *response = job_->Status();
  return grpc::Status::OK;
}

}  // namespace ballast::master
