#include "master/master_service.h"

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "common/grpc_util.h"
#include "common/net.h"
#include "spdlog/spdlog.h"

namespace ballast::master {
namespace {

// One Watch stream. The sink half (shared with the node's outbox) queues the
// master's decisions and starts one write at a time; the reactor half is
// gRPC's. Finish is called exactly once, when the stream must end and no
// write is in flight, and only after Start() registered the stream (so
// OnDone cannot delete the reactor under Start).
class WatchReactor final : public grpc::ServerWriteReactor<v1::Decision> {
 public:
  WatchReactor(JobMaster* job, std::string node_id)
      : job_(job), node_id_(std::move(node_id)), sink_(std::make_shared<Sink>(this)) {}

  void Start() {
    absl::StatusOr<JobMaster::WatchHandle> h = job_->OpenWatch(node_id_, sink_);
    std::lock_guard<std::mutex> lock(sink_->mu);
    if (h.ok()) {
      handle_ = *h;
    } else if (!sink_->finish.has_value()) {
      sink_->finish = ToGrpcStatus(h.status());
    }
    sink_->started = true;
    sink_->MaybeFinishLocked();
  }

  void OnWriteDone(bool ok) override {
    bool final_sent = false;
    {
      std::lock_guard<std::mutex> lock(sink_->mu);
      sink_->writing = false;
      if (!ok && !sink_->finish.has_value()) {
        spdlog::info("job={} node={} watch stream broke while writing", job_->job_id(), node_id_);
        sink_->finish = grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream broke");
      }
      // JobFinished is the last decision a node gets, but the stream stays
      // open until the agent hangs up or the master shuts down: an agent
      // reads a stream that ends by itself as a lost master.
      final_sent = ok && sink_->in_flight.has_job_finished();
      if (!sink_->finish.has_value() && !sink_->queue.empty()) sink_->StartNextLocked();
      sink_->MaybeFinishLocked();
    }
    if (final_sent && handle_.has_value()) job_->MarkFinalSent(*handle_);
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(sink_->mu);
    if (!sink_->finish.has_value()) {
      spdlog::info("job={} node={} watch stream cancelled by the client", job_->job_id(), node_id_);
      sink_->finish = grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled");
    }
    sink_->MaybeFinishLocked();
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(sink_->mu);
      sink_->reactor = nullptr;  // the master may still hold the sink: it drops what comes
    }
    if (handle_.has_value()) job_->CloseWatch(*handle_);
    delete this;
  }

 private:
  struct Sink final : JobMaster::DecisionSink {
    explicit Sink(WatchReactor* r) : reactor(r) {}
    void Deliver(const v1::Decision& d) override {
      std::lock_guard<std::mutex> lock(mu);
      if (reactor == nullptr || finish.has_value()) return;
      queue.push_back(d);
      if (!writing) StartNextLocked();
    }
    void End(const absl::Status& status) override {
      std::lock_guard<std::mutex> lock(mu);
      if (reactor == nullptr || finish.has_value()) return;
      finish = ToGrpcStatus(status);
      queue.clear();
      MaybeFinishLocked();
    }
    void StartNextLocked() {
      writing = true;
      in_flight = std::move(queue.front());
      queue.pop_front();
      reactor->StartWrite(&in_flight);
    }
    void MaybeFinishLocked() {
      if (reactor == nullptr || !finish.has_value() || writing || !started || finished) return;
      finished = true;
      reactor->Finish(*finish);
    }

    std::mutex mu;
    WatchReactor* reactor;  // null once gRPC is done with it
    std::deque<v1::Decision> queue;
    v1::Decision in_flight;
    bool writing = false;
    bool started = false;   // Start() has the handle
    bool finished = false;  // Finish was called
    std::optional<grpc::Status> finish;  // the stream must end with this
  };

  JobMaster* job_;
  const std::string node_id_;
  std::shared_ptr<Sink> sink_;
  std::optional<JobMaster::WatchHandle> handle_;  // set in Start, read in OnDone/OnWriteDone
};

// A KvGet that may wait: the master answers through KvGetAsync's callback;
// a cancelled call withdraws its waiter (which then answers CANCELLED). The
// waiter id lives in a shared state, not the reactor, which the answer may
// finish (and gRPC delete) on another thread at any time after Start's call.
class KvGetReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit KvGetReactor(JobMaster* job) : job_(job), state_(std::make_shared<State>()) {}
  void Start(const std::string& key, double wait_s, v1::KvGetResponse* response) {
    std::shared_ptr<State> state = state_;
    JobMaster* job = job_;
    const uint64_t id = job->KvGetAsync(key, wait_s, [this, response](absl::StatusOr<std::string> value) {
      if (value.ok()) {
        response->set_value(*std::move(value));
        Finish(grpc::Status::OK);
      } else {
        Finish(ToGrpcStatus(value.status()));
      }
    });
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->id = id;
      cancel = state->cancelled && id != 0;
    }
    if (cancel) job->CancelKvWait(id);
  }
  void OnCancel() override {
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->cancelled = true;
      id = state_->id;
    }
    if (id != 0) job_->CancelKvWait(id);  // a no-op once answered
  }
  void OnDone() override { delete this; }

 private:
  struct State {
    std::mutex mu;
    uint64_t id = 0;
    bool cancelled = false;
  };
  JobMaster* job_;
  std::shared_ptr<State> state_;
};

}  // namespace

MasterService::MasterService(JobMaster* job, std::string token) : job_(job), token_(std::move(token)) {}

grpc::Status MasterService::Authenticate(const grpc::CallbackServerContext& ctx, const char* rpc) const {
  std::string given = TokenFromContext(ctx);
  if (!given.empty() && TokenEquals(given, token_)) return grpc::Status::OK;
  spdlog::warn("job={} {} refused (UNAUTHENTICATED) from {}: {} job token", job_->job_id(), rpc, ctx.peer(),
               given.empty() ? "missing" : "wrong");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or wrong job token: pass the token the master printed with "
                      "--token or BALLAST_TOKEN");
}

template <typename Fn>
grpc::ServerUnaryReactor* MasterService::Unary(grpc::CallbackServerContext* ctx, const char* rpc, Fn&& fn) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  grpc::Status s = Authenticate(*ctx, rpc);
  if (s.ok()) s = fn();
  r->Finish(s);
  return r;
}

// Copies an OK StatusOr's value into *out; the call's status either way.
template <typename T>
grpc::Status Answer(absl::StatusOr<T> r, T* out) {
  if (!r.ok()) return ToGrpcStatus(r.status());
  *out = *std::move(r);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* MasterService::Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* request,
                                              v1::JoinResponse* response) {
  return Unary(ctx, "Join", [&] { return Answer(job_->Join(*request), response); });
}

grpc::ServerUnaryReactor* MasterService::Leave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest* request,
                                               v1::Ack*) {
  return Unary(ctx, "Leave", [&] { return ToGrpcStatus(job_->Leave(*request)); });
}

grpc::ServerUnaryReactor* MasterService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                   const v1::HeartbeatRequest* request, v1::HeartbeatResponse*) {
  return Unary(ctx, "Heartbeat", [&] { return ToGrpcStatus(job_->Heartbeat(*request)); });
}

grpc::ServerUnaryReactor* MasterService::ReportFailure(grpc::CallbackServerContext* ctx,
                                                       const v1::FailureReport* request, v1::Ack*) {
  return Unary(ctx, "ReportFailure", [&] { return ToGrpcStatus(job_->ReportFailure(*request)); });
}

grpc::ServerUnaryReactor* MasterService::ReportWorkersDone(grpc::CallbackServerContext* ctx,
                                                           const v1::WorkersDoneRequest* request, v1::Ack*) {
  return Unary(ctx, "ReportWorkersDone", [&] { return ToGrpcStatus(job_->ReportWorkersDone(*request)); });
}

grpc::ServerUnaryReactor* MasterService::ReportProgress(grpc::CallbackServerContext* ctx,
                                                        const v1::ProgressReport* request,
                                                        v1::ProgressResponse* response) {
  return Unary(ctx, "ReportProgress", [&] { return ToGrpcStatus(job_->ReportProgress(*request, response)); });
}

grpc::ServerUnaryReactor* MasterService::ReportCheckResult(grpc::CallbackServerContext* ctx,
                                                           const v1::CheckResult* request, v1::Ack*) {
  return Unary(ctx, "ReportCheckResult", [&] { return ToGrpcStatus(job_->ReportCheckResult(*request)); });
}

grpc::ServerUnaryReactor* MasterService::KvSet(grpc::CallbackServerContext* ctx, const v1::KvSetRequest* request,
                                               v1::Ack*) {
  return Unary(ctx, "KvSet", [&] { return ToGrpcStatus(job_->KvSet(request->key(), request->value())); });
}

grpc::ServerUnaryReactor* MasterService::KvGet(grpc::CallbackServerContext* ctx, const v1::KvGetRequest* request,
                                               v1::KvGetResponse* response) {
  if (grpc::Status s = Authenticate(*ctx, "KvGet"); !s.ok()) {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(s);
    return r;
  }
  auto* r = new KvGetReactor(job_);
  r->Start(request->key(), request->wait_ms() / 1000.0, response);
  return r;
}

grpc::ServerWriteReactor<v1::Decision>* MasterService::Watch(grpc::CallbackServerContext* ctx,
                                                             const v1::WatchRequest* request) {
  auto* r = new WatchReactor(job_, request->node_id());
  if (grpc::Status s = Authenticate(*ctx, "Watch"); !s.ok()) {
    r->Finish(s);
    return r;
  }
  r->Start();
  return r;
}

grpc::ServerUnaryReactor* MasterService::ReportShardDurable(grpc::CallbackServerContext* ctx,
                                                            const v1::ShardDurableReport* request,
                                                            v1::ShardDurableResponse* response) {
  return Unary(ctx, "ReportShardDurable", [&] { return Answer(job_->ReportShardDurable(*request), response); });
}

grpc::ServerUnaryReactor* MasterService::GetStatus(grpc::CallbackServerContext* ctx, const v1::StatusRequest*,
                                                   v1::JobStatus* response) {
  return Unary(ctx, "GetStatus", [&] {
    *response = job_->Status();
    return grpc::Status::OK;
  });
}

}  // namespace ballast::master
