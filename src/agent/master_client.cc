#include "agent/master_client.h"

#include <algorithm>
#include <chrono>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/tls.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

bool MasterClosedConnection(absl::string_view error) {
  const std::string e = absl::AsciiStrToLower(error);
  return absl::StrContains(e, "socket closed") || absl::StrContains(e, "connection reset") ||
         absl::StrContains(e, "broken pipe");
}

MasterClient::MasterClient(MasterClientOptions options) : options_(std::move(options)) {
  endpoint_ = options_.endpoint;
  channel_ = MasterChannel(endpoint_, options_.credentials);
  stub_ = v1::Master::NewStub(channel_);
}

MasterClient::~MasterClient() { Shutdown(); }

std::string MasterClient::endpoint() const {
  std::lock_guard<std::mutex> lock(mu_);
  return endpoint_;
}

std::shared_ptr<v1::Master::Stub> MasterClient::Stub() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stub_;
}

bool MasterClient::Connected() const {
  std::shared_ptr<grpc::Channel> channel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    channel = channel_;
  }
  return channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
}

bool MasterClient::Relocate() {
  if (!options_.locate) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (located_once_ && SecondsSince(located_at_) < locate_wait_s_) return false;
    located_once_ = true;
    located_at_ = Clock::now();
  }
  const std::string found = options_.locate();
  std::lock_guard<std::mutex> lock(mu_);
  if (found.empty() || found == endpoint_) {
    // Nothing new: look less often (every agent of a large job asks the API
    // server), with jitter so they spread out.
    thread_local std::mt19937 rng(std::random_device{}());
    const double next = std::min(locate_wait_s_ * 2, options_.locate_interval_max_s);
    locate_wait_s_ = next * std::uniform_real_distribution<double>(0.8, 1.2)(rng);
    return false;
  }
  locate_wait_s_ = options_.locate_interval_s;
  spdlog::warn("the job's master moved: {} -> {} (the job's master Lease says so); reconnecting there", endpoint_,
               found);
  endpoint_ = found;
  channel_ = MasterChannel(endpoint_, options_.credentials);
  stub_ = v1::Master::NewStub(channel_);
  return true;
}

void MasterClient::ConfigureContext(grpc::ClientContext* ctx, double timeout_s) const {
  ctx->AddMetadata(kTokenMetadataKey, options_.token);
  if (timeout_s > 0)
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          std::chrono::duration<double>(timeout_s)));
}

MasterClient::CallScope::CallScope(MasterClient* client, grpc::ClientContext* ctx, double timeout_s)
    : client_(client), ctx_(ctx) {
  client_->ConfigureContext(ctx, timeout_s);
  std::lock_guard<std::mutex> lock(client_->mu_);
  client_->calls_.insert(ctx);
  // A call that starts after Shutdown fails at once instead of delaying it.
  if (client_->shutdown_) ctx->TryCancel();
}

MasterClient::CallScope::~CallScope() {
  std::lock_guard<std::mutex> lock(client_->mu_);
  client_->calls_.erase(ctx_);
}

absl::StatusOr<v1::JoinResponse> MasterClient::JoinOnce(const v1::JoinRequest& request, double timeout_s,
                                                        bool wait_for_ready) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, timeout_s);
  ctx.set_wait_for_ready(wait_for_ready);
  v1::JoinResponse response;
  absl::Status s = FromGrpcStatus(Stub()->Join(&ctx, request, &response));
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::JoinResponse> MasterClient::Join(const v1::JoinRequest& request, double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    join_request_ = request;
  }
  auto start = Clock::now();
  double backoff = options_.backoff_initial_s;
  absl::Status last;
  // What an attempt saw that says why the master did not answer (a TLS
  // handshake failure, a master that closed the connection): the last
  // error may be a plain timeout.
  std::string telling;
  int attempts = 0;
  bool answer_wait = false;  // the one attempt past timeout_s on a connected channel was made
  while (true) {
    double remaining = timeout_s - SecondsSince(start);
    // Connected: the master is there, and its answer gets an ordinary call's
    // deadline (the handshake may have used up most of timeout_s).
    const bool connected = Connected();
    auto r = JoinOnce(request, connected ? options_.rpc_timeout_s
                                         : std::max(0.05, std::min(remaining, options_.rpc_timeout_s)));
    ++attempts;
    if (r.ok() || !Retryable(r.status())) return r;
    last = r.status();
    if (telling.empty() && (!TlsHint(std::string(last.message())).empty() || MasterClosedConnection(last.message()))) {
      telling = std::string(last.message());
    }
    if (attempts == 1 || attempts % 10 == 0)
      spdlog::info("master {} not reachable yet ({}); retrying", endpoint(), std::string(last.message()));
    remaining = timeout_s - SecondsSince(start);
    if (remaining <= 0) {
      // The connection came up as the budget ran out (a TLS handshake on a
      // loaded machine): one more attempt hears what the master says.
      if (answer_wait || connected || !Connected()) break;
      answer_wait = true;
      continue;
    }
    if (!WatchChannelUnlessShutdown(std::min(backoff, remaining))) return absl::CancelledError("shutting down");
    backoff = std::min(backoff * 2, options_.backoff_max_s);
    // A pod created by a master that is gone since: its successor is elsewhere.
    if (attempts >= 3 && Relocate()) backoff = options_.backoff_initial_s;
  }
  return absl::UnavailableError(absl::StrCat("no answer from ", endpoint(), " after ", attempts,
                                             " attempts: ", last.message(),
                                             telling.empty() || telling == last.message()
                                                 ? ""
                                                 : absl::StrCat("; earlier: ", telling)));
}

absl::Status MasterClient::Leave(const std::string& node_id, const std::string& reason, double timeout_s) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, timeout_s);
  v1::LeaveRequest req;
  req.set_node_id(node_id);
  req.set_reason(reason);
  v1::Ack ack;
  return FromGrpcStatus(Stub()->Leave(&ctx, req, &ack));
}

absl::Status MasterClient::Heartbeat(const v1::HeartbeatRequest& request) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, options_.rpc_timeout_s);
  v1::HeartbeatResponse resp;
  return FromGrpcStatus(Stub()->Heartbeat(&ctx, request, &resp));
}

absl::Status MasterClient::ReportFailure(const v1::FailureReport& report) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, options_.rpc_timeout_s);
  v1::Ack ack;
  return FromGrpcStatus(Stub()->ReportFailure(&ctx, report, &ack));
}

absl::Status MasterClient::ReportCheckResult(const v1::CheckResult& result) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, options_.rpc_timeout_s);
  v1::Ack ack;
  return FromGrpcStatus(Stub()->ReportCheckResult(&ctx, result, &ack));
}

absl::Status MasterClient::ReportWorkersDone(const std::string& node_id, int64_t round) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, options_.rpc_timeout_s);
  v1::WorkersDoneRequest req;
  req.set_node_id(node_id);
  req.set_round(round);
  v1::Ack ack;
  return FromGrpcStatus(Stub()->ReportWorkersDone(&ctx, req, &ack));
}

absl::StatusOr<v1::ProgressResponse> MasterClient::ReportProgress(const v1::ProgressReport& report,
                                                                  double timeout_s) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, timeout_s > 0 ? timeout_s : options_.rpc_timeout_s);
  v1::ProgressResponse response;
  absl::Status s = FromGrpcStatus(Stub()->ReportProgress(&ctx, report, &response));
  if (!s.ok()) return s;
  return response;
}

absl::Status MasterClient::KvSet(const std::string& key, const std::string& value) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, options_.rpc_timeout_s);
  v1::KvSetRequest req;
  req.set_key(key);
  req.set_value(value);
  v1::Ack ack;
  return FromGrpcStatus(Stub()->KvSet(&ctx, req, &ack));
}

absl::StatusOr<v1::ShardDurableResponse> MasterClient::ReportShardDurable(const v1::ShardDurableReport& report,
                                                                          double timeout_s) {
  grpc::ClientContext ctx;
  CallScope scope(this, &ctx, timeout_s > 0 ? timeout_s : options_.rpc_timeout_s);
  v1::ShardDurableResponse resp;
  absl::Status s = FromGrpcStatus(Stub()->ReportShardDurable(&ctx, report, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<std::string> MasterClient::KvGet(const std::string& key, double wait_s) {
  grpc::ClientContext ctx;
  // The master blocks up to wait_s; our deadline leaves room for its answer.
  CallScope scope(this, &ctx, wait_s + options_.rpc_timeout_s);
  v1::KvGetRequest req;
  req.set_key(key);
  req.set_wait_ms(static_cast<int64_t>(wait_s * 1000));
  v1::KvGetResponse resp;
  absl::Status s = FromGrpcStatus(Stub()->KvGet(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp.value();
}

bool MasterClient::SleepUnlessShutdown(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return shutdown_; });
  return !shutdown_;
}

bool MasterClient::WatchChannelUnlessShutdown(double seconds) {
  std::shared_ptr<grpc::Channel> channel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    channel = channel_;
  }
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shutdown_) return false;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    // Short slices: Cancel() cannot wake a watch, so it is heard within 50 ms.
    const auto slice = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(50));
    if (channel->WaitForStateChange(state, std::chrono::system_clock::now() + slice)) {
      state = channel->GetState(/*try_to_connect=*/true);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  return !shutdown_;
}

absl::Status MasterClient::Rejoin() {
  std::optional<v1::JoinRequest> req;
  {
    std::lock_guard<std::mutex> lock(mu_);
    req = join_request_;
  }
  if (!req.has_value()) return absl::FailedPreconditionError("re-join before the first Join");
  // Waits for the channel to connect (up to the backoff cap) instead of
  // failing fast while it is between connection attempts: a master that
  // restarted in 50 ms was otherwise found only after several backoffs (5 s).
  return JoinOnce(*req, options_.backoff_max_s, /*wait_for_ready=*/true).status();
}

void MasterClient::ReportLost(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_ || lost_reported_) return;
    lost_reported_ = true;
  }
  if (on_lost_) on_lost_(status);
}

void MasterClient::StartWatch(const std::string& node_id, DecisionCallback on_decision, LostCallback on_lost) {
  on_decision_ = std::move(on_decision);
  on_lost_ = std::move(on_lost);
  watch_thread_ = std::thread([this, node_id] { WatchLoop(node_id); });
}

void MasterClient::WatchLoop(std::string node_id) {
  // Time the connection was first found broken; reset by every decision read.
  Clock::time_point broken_since{};  // valid while broken_since_set
  bool broken_since_set = false;
  double backoff = options_.backoff_initial_s;
  bool need_rejoin = false;
  while (true) {
    if (need_rejoin) {
      // A master that moved (a new master pod): its Lease names the new address.
      if (Relocate()) backoff = options_.backoff_initial_s;
      absl::Status s = Rejoin();
      bool shutting_down;
      {
        std::lock_guard<std::mutex> lock(mu_);
        shutting_down = shutdown_;
      }
      // CANCELLED not of our doing: a master that was shutting down (its pod
      // being replaced) cancelled the call; the next one may answer.
      if (!s.ok() && !Retryable(s) && !(absl::IsCancelled(s) && !shutting_down)) {
        // The master is up but refuses us (new token, contradicting spec, ...):
        // waiting will not help.
        ReportLost(absl::Status(s.code(), absl::StrCat("the master refused this agent's re-join: ", s.message())));
        return;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shutdown_) return;
    }
    grpc::ClientContext ctx;
    CallScope scope(this, &ctx, 0);  // no deadline: the stream lives as long as the agent
    v1::WatchRequest req;
    req.set_node_id(node_id);
    auto reader = Stub()->Watch(&ctx, req);
    v1::Decision decision;
    while (reader->Read(&decision)) {
      if (broken_since_set) {  // connected again: the next loss looks from the first interval
        std::lock_guard<std::mutex> lock(mu_);
        located_once_ = false;
        locate_wait_s_ = options_.locate_interval_s;
      }
      broken_since_set = false;
      backoff = options_.backoff_initial_s;
      if (on_decision_) on_decision_(decision);
    }
    absl::Status s = FromGrpcStatus(reader->Finish());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shutdown_) return;
    }
    if (!broken_since_set) {
      broken_since_set = true;
      broken_since = Clock::now();
      spdlog::warn("lost the watch stream to master {} ({}: {}); reconnecting", endpoint(),
                   absl::StatusCodeToString(s.code()), std::string(s.message()));
    }
    if (absl::IsUnauthenticated(s)) {
      ReportLost(absl::UnauthenticatedError(absl::StrCat("the master refused this agent's token: ", s.message())));
      return;
    }
    double lost_for = SecondsSince(broken_since);
    if (lost_for >= options_.reconnect_timeout_s) {
      ReportLost(absl::UnavailableError(absl::StrCat("lost the ballast master at ", endpoint(), " for ",
                                                     static_cast<int>(lost_for), " s: ", s.message())));
      return;
    }
    if (!SleepUnlessShutdown(std::min(backoff, options_.reconnect_timeout_s - lost_for))) return;
    backoff = std::min(backoff * 2, options_.backoff_max_s);
    // The master may have restarted or declared this node dead: join again
    // (idempotent per node id) before watching.
    need_rejoin = true;
  }
}

void MasterClient::StartHeartbeat(double interval_s, HeartbeatSource source) {
  heartbeat_source_ = std::move(source);
  heartbeat_thread_ = std::thread([this, interval_s] { HeartbeatLoop(interval_s); });
}

void MasterClient::HeartbeatLoop(double interval_s) {
  Clock::time_point failing_since{};  // valid while failing_since_set
  bool failing_since_set = false;
  while (SleepUnlessShutdown(interval_s)) {
    absl::Status s = Heartbeat(heartbeat_source_());
    if (s.ok()) {
      failing_since_set = false;
      continue;
    }
    if (absl::IsNotFound(s)) {
      // The master forgot us (declared dead, or restarted): join again.
      spdlog::warn("master {} does not know this node ({}); joining again", endpoint(), std::string(s.message()));
      s = Rejoin();
      if (s.ok()) {
        failing_since_set = false;
        continue;
      }
    }
    if (!failing_since_set) {
      failing_since_set = true;
      failing_since = Clock::now();
    }
    spdlog::debug("heartbeat to {} failed: {}", endpoint(), s.ToString());
    if (SecondsSince(failing_since) >= options_.reconnect_timeout_s) {
      ReportLost(absl::UnavailableError(absl::StrCat("no heartbeat reached the ballast master at ", endpoint(),
                                                     " for ", static_cast<int>(SecondsSince(failing_since)),
                                                     " s: ", s.message())));
      return;
    }
  }
}

void MasterClient::Cancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
    for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
  }
  cv_.notify_all();
}

void MasterClient::Shutdown() {
  Cancel();
  if (watch_thread_.joinable()) watch_thread_.join();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

}  // namespace ballast::agent
