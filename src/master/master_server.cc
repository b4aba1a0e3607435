#include "master/master_server.h"

#include <grpcpp/grpcpp.h>

#include <cctype>
#include <chrono>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "common/tunables.h"
#include "master/http_server.h"
#include "master/job_master.h"
#include "master/master_service.h"
#include "spdlog/spdlog.h"

namespace ballast::master {
namespace {

// The ticker evaluates timeouts this often: fine enough that last call and
// heartbeat timeouts fire within ~50 ms of their time, cheap enough to ignore.
constexpr absl::Duration kTickInterval = absl::Milliseconds(50);
// How long server shutdown lets in-flight RPCs finish before cancelling them.
constexpr auto kServerShutdownGrace = std::chrono::seconds(1);

std::string HostPort(const std::string& host, int port) {
  // IPv6 literals need brackets in a gRPC address.
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

struct MasterServer::Impl {
  MasterOptions options;
  std::string job_id;
  std::string address;
  int port = 0;
  std::unique_ptr<Journal> journal;  // before the job: it outlives the job's use of it
  std::unique_ptr<JobMaster> job;
  std::unique_ptr<MasterService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<MasterHttpServer> http;
  std::string advertise_host;
  absl::Notification stop_ticker;
  std::thread ticker;
  std::mutex shutdown_mu;  // held for the whole Shutdown so callers see it done
  bool shut_down = false;
};

absl::StatusOr<std::unique_ptr<MasterServer>> MasterServer::Start(const MasterOptions& options) {
  if (options.token.empty()) {
    return absl::InvalidArgumentError(
        "the job master needs a job token: pass --token or set BALLAST_TOKEN (any non-empty "
        "secret the agents also get)");
  }
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port must be between 0 (pick a free one) and 65535, got ", options.port));
  }
  RETURN_IF_ERROR(health::Validate(options.health));
  const Tunables& tunables = Tunables::Get();
  JobMasterOptions jo;
  jo.job_id = options.job_id.empty() ? absl::StrCat("ballast-", RandomHex(6)) : options.job_id;
  jo.min_nodes = options.min_nodes;
  jo.max_nodes = options.max_nodes;
  jo.expected_nodes = options.expected_nodes;
  jo.node_unit = options.node_unit;
  jo.max_restarts = options.max_restarts;
  jo.last_call_s = options.last_call_s >= 0 ? options.last_call_s : tunables.last_call_s;
  jo.heartbeat_interval_s = options.heartbeat_interval_s >= 0 ? options.heartbeat_interval_s
                                                              : tunables.heartbeat_interval_s;
  jo.heartbeat_timeout_s = options.heartbeat_timeout_s >= 0 ? options.heartbeat_timeout_s
                                                            : tunables.heartbeat_timeout_s;
  jo.wait_for_nodes_s =
      options.wait_for_nodes_s >= 0 ? options.wait_for_nodes_s : tunables.wait_for_nodes_s;
  jo.disconnect_grace_s = tunables.disconnect_grace_s;
  jo.failure_settle_s = tunables.failure_settle_s;
  jo.hang_settle_s = tunables.hang_settle_s;
  jo.straggler_factor = tunables.straggler_factor;
  jo.precheck = options.precheck;
  jo.exclude_stragglers = options.exclude_stragglers;
  jo.health = options.health;
  jo.clock = options.clock != nullptr ? options.clock : SteadyClock::Get();
  jo.on_node_lost = options.on_node_lost;
  jo.on_node_excluded = options.on_node_excluded;
  jo.on_node_disconnected = options.on_node_disconnected;
  jo.goodput_before = options.goodput_before;
  std::unique_ptr<Journal> journal;
  int port = options.port;
  if (!options.journal_dir.empty()) {
    ASSIGN_OR_RETURN(journal, Journal::Open(Journal::Options{options.journal_dir}));
    if (journal->recovered()) {
      const v1::JournalJob& job = journal->job();
      if (options.job_id.empty()) jo.job_id = job.job_id();
      RETURN_IF_ERROR(CheckJournalMatches(jo, job));
      if (port == 0) port = job.port();
      if (port != job.port()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the journal's job was served on port ", job.port(), ", not --port ", port,
            ": its agents reconnect to that port; drop --port or pass --port ", job.port()));
      }
    }
    spdlog::info("job={} journal {}: {}", jo.job_id, options.journal_dir, journal->recovery_note());
    jo.journal = journal.get();
  }
  RETURN_IF_ERROR(ValidateJobMasterOptions(jo));

  std::unique_ptr<MasterServer> server(new MasterServer());
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  impl.options = options;
  impl.journal = std::move(journal);
  impl.job_id = jo.job_id;
  impl.job = std::make_unique<JobMaster>(jo);
  impl.service = std::make_unique<MasterService>(impl.job.get(), options.token);

  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, MasterServerCredentials(options.tls));
  grpc::ServerBuilder builder;
  std::string listen = HostPort(options.bind_host, port);
  builder.AddListeningPort(listen, credentials, &impl.port);
  // Bounds on what one message may carry (common/limits.h).
  builder.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  builder.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  builder.RegisterService(impl.service.get());
  // Keepalive pings notice a dead agent's half-open Watch stream within ~15 s.
  // Heartbeats remain the source of truth for liveness; this only frees the
  // stream's thread. Agents may ping every 10 s, so accept that without
  // sending GOAWAY (too_many_pings).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  impl.server = builder.BuildAndStart();
  if (impl.server == nullptr || impl.port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "the job master could not listen on ", listen,
        ": is the port in use or the address not on this machine? pick another --port or "
        "--host"));
  }
  impl.job->RecordPort(impl.port);  // a restarted master listens there again
  std::string advertise = options.advertise_host.empty() ? HostName() : options.advertise_host;
  impl.address = HostPort(advertise, impl.port);
  impl.advertise_host = advertise;
  if (options.http_port >= 0) {
    HttpOptions ho;
    ho.bind_host = options.bind_host;
    ho.port = options.http_port;
    ho.token = options.token;
    ho.metrics_public = options.metrics_public;
    absl::StatusOr<std::unique_ptr<MasterHttpServer>> http = MasterHttpServer::Start(ho, impl.job.get());
    if (!http.ok() && options.http_port_is_default && ho.port != 0) {
      spdlog::warn("job={} HTTP port {} (the gRPC port + 1) is taken: serving the dashboard and metrics on a free "
                   "port instead (pass --http-port to choose)",
                   impl.job_id, ho.port);
      ho.port = 0;
      http = MasterHttpServer::Start(ho, impl.job.get());
    }
    if (!http.ok()) return http.status();  // ~MasterServer stops the gRPC server
    impl.http = *std::move(http);
    spdlog::info("job={} dashboard and metrics on http://{}/ (/api/v1/job, /api/v1/events, /metrics{})", impl.job_id,
                 HostPort(advertise, impl.http->port()), options.metrics_public ? ", /metrics without token" : "");
  }

  JobMaster* job = impl.job.get();
  absl::Notification* stop = &impl.stop_ticker;
  impl.ticker = std::thread([job, stop] {
    while (!stop->WaitForNotificationWithTimeout(kTickInterval)) job->Tick();
  });
  spdlog::info("job={} master listening on {} (agents reach it at {}); --nnodes {}:{} node unit "
               "{} max restarts {} last call {} s heartbeat {}/{} s wait for nodes {} s{}",
               impl.job_id, HostPort(options.bind_host, impl.port), impl.address, jo.min_nodes,
               jo.max_nodes, jo.node_unit, jo.max_restarts, jo.last_call_s,
               jo.heartbeat_interval_s, jo.heartbeat_timeout_s, jo.wait_for_nodes_s,
               jo.precheck ? (jo.exclude_stragglers ? " pre-flight check on (stragglers excluded)" : " pre-flight check on")
                           : "");
  return server;
}

MasterServer::~MasterServer() {
  if (impl_ != nullptr) Shutdown(0);
}

int MasterServer::port() const { return impl_->port; }
std::string MasterServer::address() const { return impl_->address; }
const std::string& MasterServer::token() const { return impl_->options.token; }
const std::string& MasterServer::job_id() const { return impl_->job_id; }
int MasterServer::http_port() const { return impl_->http != nullptr ? impl_->http->port() : 0; }
bool MasterServer::resumed() const { return impl_->journal != nullptr && impl_->journal->recovered(); }

std::string MasterServer::dashboard_url() const {
  if (impl_->http == nullptr) return "";
  std::string token;  // percent-encoded: a user's token may hold any byte
  for (unsigned char c : impl_->options.token) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      token += static_cast<char>(c);
    } else {
      absl::StrAppendFormat(&token, "%%%02X", c);
    }
  }
  return absl::StrCat("http://", HostPort(impl_->advertise_host, impl_->http->port()), "/?token=", token);
}

std::optional<JobResult> MasterServer::WaitForFinish(double timeout_s) {
  std::optional<JobOutcome> outcome = impl_->job->WaitForFinish(timeout_s);
  if (!outcome.has_value()) return std::nullopt;
  return JobResult{outcome->succeeded, outcome->message, outcome->restart_count};
}

v1::JobStatus MasterServer::Status() const { return impl_->job->Status(); }

std::optional<v1::MasterSnapshot> MasterServer::JournalStateAfter(uint64_t seq) const {
  return impl_->job->JournalStateAfter(seq);
}

void MasterServer::Abort(const std::string& message) { impl_->job->Abort(message); }

void MasterServer::Suspended() { impl_->job->Suspended(); }

void MasterServer::NodeLost(const std::string& node_id, const std::string& reason) {
  v1::LeaveRequest request;
  request.set_node_id(node_id);
  request.set_reason(reason);
  request.set_lost(true);
  (void)impl_->job->Leave(request);
}

void MasterServer::Shutdown(double linger_s) {
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.shutdown_mu);
  if (impl.shut_down) return;
  impl.shut_down = true;
  // Linger only for a finished job: then every open stream is about to carry
  // its JobFinished, and agents must hear it before we go. An unfinished job
  // has no final decision to wait for.
  if (linger_s > 0 && impl.job->outcome().has_value()) {
    absl::Time deadline = absl::Now() + absl::Seconds(linger_s);
    while (!impl.job->AllFinalDecisionsSent() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  // Wake every blocked Watch/KvGet first so server shutdown does not wait on them.
  impl.job->Shutdown();
  if (impl.http != nullptr) impl.http->Stop();  // after the job: its long-polls have ended
  if (impl.server != nullptr) {  // null only when Start failed to listen
    impl.server->Shutdown(std::chrono::system_clock::now() + kServerShutdownGrace);
    impl.server->Wait();
  }
  impl.stop_ticker.Notify();
  if (impl.ticker.joinable()) impl.ticker.join();
  spdlog::info("job={} master stopped", impl.job_id);
}

}  // namespace ballast::master
