#include "cli/master_process.h"

#include "cli/health_flags.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/chaos_driver.h"
#include "common/grpc_util.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "common/tls.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

// A master that keeps dying is not restarted forever (as `ballast master`'s
// own supervisor).
constexpr int kMaxQuickRestarts = 5;
constexpr double kQuickRestartWindowS = 60;

bool Final(const std::string& state) { return state == "succeeded" || state == "failed"; }

}  // namespace

MasterProcess::MasterProcess(MasterProcessOptions options) : options_(std::move(options)) {}

absl::StatusOr<Endpoint> LocalMasterHost::Start(const std::vector<std::string>& argv,
                                                const std::map<std::string, std::string>& env, bool restart) {
  (void)restart;  // a child that died is started again here
  if (port_ == 0) {
    // Every incarnation serves the same port: the agents reconnect there.
    absl::StatusOr<int> port = PickFreePort(bind_host_);
    if (!port.ok()) return port.status();
    port_ = *port;
  }
  SpawnOptions so;
  so.argv = argv;
  so.argv.insert(so.argv.end(), {"--host", bind_host_, "--port", std::to_string(port_), "--advertise-host",
                                 advertise_host_});
  so.env = env;
  absl::StatusOr<Subprocess> child = Subprocess::Spawn(so);
  if (!child.ok()) {
    return absl::Status(child.status().code(),
                        absl::StrCat("cannot start the master process: ", child.status().message()));
  }
  child_ = std::make_unique<Subprocess>(*std::move(child));
  return Endpoint{advertise_host_, port_};
}

std::optional<ExitStatus> LocalMasterHost::Poll() {
  if (child_ == nullptr) return std::nullopt;
  if (child_->status().has_value()) return child_->status();
  return child_->Poll();
}

void LocalMasterHost::Stop(double grace_s) {
  if (child_ == nullptr || !child_->running()) return;
  child_->Signal(SIGTERM);
  if (!child_->Wait(grace_s).has_value()) child_->Terminate(0);
}

void LocalMasterHost::Kill() {
  if (child_ != nullptr && child_->running()) kill(child_->pid(), SIGKILL);
}

std::string LocalMasterHost::Where() const { return absl::StrCat("pid ", child_ ? child_->pid() : -1); }

absl::StatusOr<std::unique_ptr<MasterProcess>> MasterProcess::Start(MasterProcessOptions options) {
  if (options.journal_dir.empty()) return absl::InvalidArgumentError("MasterProcess needs a journal directory");
  if (options.master.token.empty()) return absl::InvalidArgumentError("MasterProcess needs the job token");
  std::unique_ptr<MasterProcess> p(new MasterProcess(std::move(options)));
  const master::MasterOptions& m = p->options_.master;
  p->host_ = std::move(p->options_.host);
  if (p->host_ == nullptr) {
    p->host_ = std::make_unique<LocalMasterHost>(m.bind_host, m.advertise_host, m.port);
  }
  p->job_id_ = p->options_.master.job_id;
  RETURN_IF_ERROR(p->Spawn());
  RETURN_IF_ERROR(p->WaitReady());
  return p;
}

MasterProcess::~MasterProcess() { Shutdown(0); }

std::vector<std::string> MasterProcess::Argv() const {
  const master::MasterOptions& m = options_.master;
  std::vector<std::string> argv = {SelfExePath(),
                                   "master",
                                   "--journal",
                                   options_.journal_dir,
                                   "--no-supervise",
                                   "--serve-until-stopped",
                                   "--nnodes",
                                   absl::StrCat(m.min_nodes, ":", m.max_nodes),
                                   "--node-unit",
                                   std::to_string(m.node_unit),
                                   "--max-restarts",
                                   std::to_string(m.max_restarts),
                                   "--expected-nodes",
                                   std::to_string(m.expected_nodes)};
  // The job id: the one asked for, else (after the first start) the one the
  // journal's job has.
  if (!job_id_.empty()) argv.insert(argv.end(), {"--job-id", job_id_});
  if (m.precheck) argv.push_back("--network-check");
  if (m.exclude_stragglers) argv.push_back("--exclude-stragglers");
  for (std::string& a : HealthFlags::Argv(m.health)) argv.push_back(std::move(a));
  if (options_.http_port_given) argv.insert(argv.end(), {"--http-port", std::to_string(m.http_port)});
  if (m.metrics_public) argv.push_back("--metrics-public");
  if (!m.tls.cert.empty()) argv.insert(argv.end(), {"--tls-cert", m.tls.cert, "--tls-key", m.tls.key});
  if (!m.tls.ca.empty()) argv.insert(argv.end(), {"--tls-ca", m.tls.ca});
  return argv;
}

absl::Status MasterProcess::Spawn() {
  std::map<std::string, std::string> env = CurrentEnvironment();
  env["BALLAST_TOKEN"] = options_.master.token;  // not on the command line (ps shows it)
  absl::StatusOr<Endpoint> at = host_->Start(Argv(), env, /*restart=*/incarnations_ > 0);
  if (!at.ok()) return at.status();
  const std::string address = at->ToString();
  if (address != address_) {
    if (!address_.empty()) {
      spdlog::warn("{}: the master moved from {} to {}; agents that dial the old address do not follow", options_.cmd,
                   address_, address);
    }
    address_ = address;
    // Its status is read as an agent would: the master's CA (its own
    // certificate when self-signed), and that certificate as the client's.
    TlsFiles client = options_.master.tls;
    if (client.on() && client.ca.empty()) client.ca = client.cert;
    auto credentials = MasterChannelCredentials(client);
    if (!credentials.ok()) return credentials.status();
    stub_ = v1::Master::NewStub(MasterChannel(address_, *credentials));
  }
  exited_.reset();
  if (++incarnations_ == 1) first_started_ = std::chrono::steady_clock::now();
  spdlog::info("{}: master process {} (incarnation {}) on {}, journal {}", options_.cmd, host_->Where(),
               incarnations_, address_, options_.journal_dir);
  return absl::OkStatus();
}

absl::StatusOr<v1::JobStatus> MasterProcess::Fetch(double timeout_s) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kTokenMetadataKey, options_.master.token);
  // Wait (up to the deadline) for the channel to connect rather than fail
  // fast: a fail-fast call does not drive a connection attempt, and a TLS
  // handshake then never completes between calls.
  ctx.set_wait_for_ready(true);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(
                                                          std::chrono::duration<double>(timeout_s)));
  v1::StatusRequest req;
  v1::JobStatus st;
  if (stub_ == nullptr) return absl::UnavailableError("the master was stopped");
  grpc::Status s = stub_->GetStatus(&ctx, req, &st);
  if (!s.ok()) return FromGrpcStatus(s);
  return st;
}

void MasterProcess::NodeLost(const std::string& node_id, const std::string& reason) {
  if (stub_ == nullptr) return;  // stopped
  grpc::ClientContext ctx;
  ctx.AddMetadata(kTokenMetadataKey, options_.master.token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::LeaveRequest req;
  req.set_node_id(node_id);
  req.set_reason(reason);
  req.set_lost(true);
  v1::Ack ack;
  grpc::Status s = stub_->Leave(&ctx, req, &ack);
  if (!s.ok()) {
    spdlog::warn("{}: could not tell the master that node {} is gone ({}); its heartbeats will", options_.cmd,
                 node_id, s.error_message());
  }
}

void MasterProcess::Keep(v1::JobStatus st) {
  if (!st.master_instance().empty() && instances_.insert(st.master_instance()).second && instances_.size() > 1 &&
      static_cast<int>(instances_.size()) > incarnations_) {
    // Its host has not told yet (Ray reports an actor's restart late).
    spdlog::warn("{}: a restarted master serves the job (master process {}), resumed from the journal {}",
                 options_.cmd, st.master_instance(), options_.journal_dir);
  }
  last_ = std::move(st);
}

absl::Status MasterProcess::WaitReady() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(
                                                               std::chrono::duration<double>(options_.ready_timeout_s));
  absl::Status last = absl::DeadlineExceededError("no answer");
  while (std::chrono::steady_clock::now() < deadline) {
    if (std::optional<ExitStatus> st = host_->Poll(); st.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat("the master process exited (", st->Describe(),
                                                        ") before it served the job; see its error above"));
    }
    absl::StatusOr<v1::JobStatus> s = Fetch(0.5);
    if (s.ok()) {
      if (job_id_.empty()) job_id_ = s->job_id();
      Keep(*std::move(s));
      return absl::OkStatus();
    }
    last = s.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("the master process did not answer on ", address_, " within ",
                                                  options_.ready_timeout_s, " s: ", last.message()));
}

absl::Status MasterProcess::CheckChild() {
  if (host_ == nullptr || incarnations_ == 0 || exited_.has_value()) return absl::OkStatus();
  std::optional<ExitStatus> st = host_->Poll();
  if (!st.has_value()) return absl::OkStatus();
  if (st->signal == 0 || shut_down_) {
    exited_ = *st;  // it decided the job (its last status says how), or it was stopped
    return absl::OkStatus();
  }
  const auto now = std::chrono::steady_clock::now();
  while (!restarts_.empty() &&
         std::chrono::duration<double>(now - restarts_.front()).count() > kQuickRestartWindowS) {
    restarts_.pop_front();
  }
  if (static_cast<int>(restarts_.size()) >= kMaxQuickRestarts) {
    exited_ = *st;
    return absl::UnavailableError(absl::StrCat("the master process died again (", st->Describe(), "): ",
                                               kMaxQuickRestarts, " restarts within ", kQuickRestartWindowS,
                                               " s; see its log above (the journal ", options_.journal_dir,
                                               " keeps the job: `ballast master --journal ", options_.journal_dir,
                                               "` resumes it)"));
  }
  restarts_.push_back(now);
  spdlog::warn("{}: the master process ({}) died ({}); restarting it from the journal {} (its agents keep "
               "training and reconnect)",
               options_.cmd, host_->Where(), st->Describe(), options_.journal_dir);
  RETURN_IF_ERROR(Spawn());
  return WaitReady();
}

absl::Status MasterProcess::Poll(scheduler::NodeManager& nodes) {
  RETURN_IF_ERROR(CheckChild());
  if (exited_.has_value()) return absl::OkStatus();
  absl::StatusOr<v1::JobStatus> st = Fetch(2.0);
  if (!st.ok()) return absl::OkStatus();  // dying or restarting: the next turn sees it
  Keep(*std::move(st));
  // A finished job's agents hang up as they exit: not a node to replace.
  if (ResultOf(*last_).has_value()) return absl::OkStatus();
  InjectChaos();
  // What the in-process master's callbacks would have said: nodes that
  // turned dead, left or excluded since the last turn.
  for (const v1::NodeStatus& n : last_->nodes()) {
    // A disconnect is told once (OnNodeDisconnected), again after a reconnect.
    if (!n.disconnected()) {
      disconnected_.erase(n.node_id());
    } else if (disconnected_.insert(n.node_id()).second) {
      nodes.OnNodeDisconnected(n.node_id());
    }
    const std::string& state = n.state();
    const bool lost = state == "dead" || state == "left";
    const bool excluded = state == "excluded";
    if (!lost && !excluded) {
      reported_.erase(n.node_id());  // alive again (re-joined)
      continue;
    }
    auto [it, fresh] = reported_.emplace(n.node_id(), state);
    if (!fresh && it->second == state) continue;
    it->second = state;
    const std::string reason = n.reason().empty() ? state : n.reason();
    if (excluded) {
      nodes.OnNodeExcluded(n.node_id(), reason);
    } else {
      nodes.OnNodeLost(n.node_id(), reason);
    }
  }
  return absl::OkStatus();
}

void MasterProcess::InjectChaos() {
  if (!options_.kill_master.has_value() || chaos_fired_ || incarnations_ == 0 || !last_.has_value()) return;
  // By step, the agents report their node's step the moment it reaches the
  // fault's (agent/chaos_driver.h), so the status read every turn has it.
  const double since_start_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - first_started_).count();
  const std::optional<std::string> why = agent::KillMasterDue(*options_.kill_master, *last_, since_start_s);
  if (!why.has_value()) return;
  chaos_fired_ = true;
  spdlog::warn("{}: chaos: kill-master ({}): SIGKILL to the master process ({})", options_.cmd, *why,
               host_->Where());
  host_->Kill();
}

std::optional<master::JobResult> MasterProcess::ResultOf(const v1::JobStatus& st) {
  if (!Final(st.state())) return std::nullopt;
  return master::JobResult{st.state() == "succeeded", st.message(), st.restart_count()};
}

std::optional<master::JobResult> MasterProcess::WaitForFinish(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(
                                                               std::chrono::duration<double>(std::max(0.0, timeout_s)));
  // The status is read once per call (Poll reads it every loop turn too: a
  // status lists every node); then only the child is watched. The master
  // serves until it is stopped, so the end is read at the next call at the
  // latest, and an agent's exit meanwhile is not taken for a loss.
  if (!exited_.has_value() && !(last_.has_value() && ResultOf(*last_).has_value())) {
    if (absl::StatusOr<v1::JobStatus> st = Fetch(0.5); st.ok()) Keep(*std::move(st));
  }
  while (true) {
    if (last_.has_value()) {
      if (auto r = ResultOf(*last_); r.has_value()) return r;
    }
    if (exited_.has_value()) {
      // It exited without a final status seen: its exit code says how.
      return master::JobResult{exited_->ok(),
                               absl::StrCat("the master process exited (", exited_->Describe(),
                                            ") before the job's end was seen; see its log above"),
                               last_.has_value() ? last_->restart_count() : 0};
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (absl::Status c = CheckChild(); !c.ok()) spdlog::error("{}: {}", options_.cmd, std::string(c.message()));
  }
}

v1::JobStatus MasterProcess::Status() {
  if (!exited_.has_value()) {
    if (absl::StatusOr<v1::JobStatus> st = Fetch(2.0); st.ok()) Keep(*std::move(st));
  }
  return last_.value_or(v1::JobStatus());
}

void MasterProcess::Shutdown(double linger_s) {
  if (shut_down_) return;
  shut_down_ = true;
  if (host_ == nullptr || incarnations_ == 0) return;
  // Our connection closed first: a gRPC server's shutdown waits out its grace
  // (1 s) for a client that keeps one open.
  stub_.reset();
  // It serves until told to stop (--serve-until-stopped); a finished job's
  // master then lingers up to its own finish linger for the last agents.
  host_->Stop(std::max(0.0, linger_s) + 5);
}

}  // namespace ballast::cli
