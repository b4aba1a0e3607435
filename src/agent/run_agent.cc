// RunAgent: resolves where the master is (a remote `ballast master`, or an
// embedded one for --standalone and for node rank 0 with --master-addr), turns
// SIGINT/SIGTERM into agent events, and runs the Agent on the calling thread.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/agent.h"
#include "agent/run_options.h"
#include "common/net.h"
#include "common/tunables.h"
#include "kube/lease.h"
#include "spdlog/spdlog.h"

#include "master/goodput.h"
#include "master/master_server.h"

namespace ballast::agent {
namespace {

constexpr int kDefaultMasterPort = 29500;  // torchrun's --master-port default

void PrintError(const std::string& msg) { std::fprintf(stderr, "ballast run: %s\n", msg.c_str()); }

// Blocks SIGINT/SIGTERM in the calling thread (inherited by every thread it
// creates afterwards, gRPC's included) and turns them into Agent::PostSignal
// calls on a dedicated sigtimedwait thread. Workers get an empty mask (Spawn
// resets it), so they still receive the SIGTERM the agent sends them.
class SignalForwarder {
 public:
  SignalForwarder() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~SignalForwarder() {
    Detach();
    // Signals that arrived after the agent finished stay pending until the
    // mask is restored, where they take their default action: the agent was
    // exiting anyway.
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  void Attach(Agent* agent) {
    thread_ = std::thread([this, agent] {
      timespec tick{0, 100 * 1000 * 1000};
      while (!stop_.load()) {
        int sig = sigtimedwait(&set_, nullptr, &tick);
        if (sig > 0) agent->PostSignal(sig);
      }
    });
  }
  void Detach() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  sigset_t set_;
  sigset_t old_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

// BALLAST_MASTER_LEASE=ns/name (a worker pod of an ElasticJob): the job's
// master Lease names where its master serves now, read with the pod's
// service account when the master is lost. "" when it cannot be read.
static std::function<std::string()> LeaseLocator(const std::string& lease) {
  const size_t slash = lease.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == lease.size()) {
    spdlog::warn("BALLAST_MASTER_LEASE={} is not NAMESPACE/NAME: a master that moves is not followed", lease);
    return nullptr;
  }
  struct State {
    std::mutex mu;
    std::unique_ptr<kube::KubeClient> client;
    bool warned = false;
  };
  auto state = std::make_shared<State>();
  const std::string ns = lease.substr(0, slash);
  const std::string name = lease.substr(slash + 1);
  return [state, ns, name, lease]() -> std::string {
    std::lock_guard<std::mutex> lock(state->mu);
    absl::Status err;
    if (state->client == nullptr) {
      auto cfg = kube::KubeConfig::Load("");
      if (cfg.ok()) {
        state->client = std::make_unique<kube::KubeClient>(*cfg);
      } else {
        err = cfg.status();
      }
    }
    if (state->client != nullptr) {
      auto ep = kube::LeaseAnnotation(state->client.get(), ns, name, "ballast.dev/master-endpoint");
      if (ep.ok()) return *ep;
      err = ep.status();
    }
    if (!state->warned) {
      state->warned = true;
      spdlog::warn("cannot read the job's master Lease {} to find a master that moved: {} (the pod's service account "
                   "needs `get leases` there: the operator binds ClusterRole ballast-worker to it)",
                   lease, std::string(err.message()));
    }
    return "";
  };
}

int RunAgent(const RunOptions& options) {
  SignalForwarder signals;  // before any thread exists
  const Tunables& tunables = Tunables::Get();
  AgentOptions ao;
  ao.run = options;
  ao.tunables = tunables;

  // Where the master is, and whether this process hosts it.
  bool embedded = false;
  bool standalone = false;
  std::string bind_host;
  int bind_port = 0;
  if (!options.rdzv_endpoint.empty() && !options.standalone) {
    ao.endpoint = options.rdzv_endpoint;
  } else if (options.standalone || options.max_nodes <= 1) {
    embedded = standalone = true;
    bind_host = "127.0.0.1";
  } else if (!options.master_addr.empty()) {
    int port = options.master_port > 0 ? options.master_port : kDefaultMasterPort;
    ao.endpoint = Endpoint{options.master_addr, port}.ToString();
    if (options.node_rank < 0) {
      PrintError("--master-addr with --nnodes > 1 needs --node-rank on every node: the node with --node-rank 0 "
                 "hosts the ballast master");
      return 1;
    }
    if (options.node_rank == 0) {
      embedded = true;
      bind_host = "0.0.0.0";
      bind_port = port;
    }
  } else {
    PrintError("no master for a multi-node job: pass --rdzv-endpoint HOST:PORT of a running `ballast master` "
               "(or --master-addr/--master-port with --node-rank, or --standalone for one node)");
    return 1;
  }

  if (!standalone && options.token.empty()) {
    PrintError(absl::StrCat("the ballast master at ", ao.endpoint,
                            " needs the job token: pass --token TOKEN or set BALLAST_TOKEN "
                            "(`ballast master` prints it when it starts)"));
    return 1;
  }
  ao.token = options.token;
  TlsFiles tls = options.tls;
  tls.FillFromEnv();
  {
    auto credentials = MasterChannelCredentials(tls);
    if (!credentials.ok()) {
      PrintError(std::string(credentials.status().message()));
      return 2;
    }
    ao.credentials = *credentials;
  }
  if (const char* lease = std::getenv("BALLAST_MASTER_LEASE"); lease != nullptr && *lease != '\0' && !embedded) {
    ao.locate_master = LeaseLocator(lease);
  }

  if (!embedded && (options.http_port.has_value() || options.metrics_public)) {
    spdlog::warn("--http-port/--metrics-public ignored: this agent joins the master at {}, which serves HTTP itself "
                 "(pass them to that `ballast master`)",
                 ao.endpoint);
  }
  std::unique_ptr<master::MasterServer> master;
  if (embedded) {
    master::MasterOptions mo;
    mo.bind_host = bind_host;
    mo.port = bind_port;
    mo.advertise_host = standalone ? "127.0.0.1" : options.master_addr;
    mo.token = standalone ? RandomHex(16) : options.token;
    mo.job_id = options.rdzv_id;
    mo.min_nodes = standalone ? 1 : options.min_nodes;
    mo.max_nodes = standalone ? 1 : options.max_nodes;
    mo.node_unit = options.node_unit > 0 ? options.node_unit : 1;
    mo.max_restarts = options.max_restarts.value_or(3);
    mo.last_call_s = options.last_call_s;
    mo.http_port = options.http_port.value_or(master::HttpPortBeside(bind_port));
    mo.http_port_is_default = !options.http_port.has_value();
    mo.metrics_public = options.metrics_public;
    mo.tls = tls;
    if (!options.on_nan.empty()) mo.health.on_nan = *health::ParseOnNan(options.on_nan);  // checked by the parser
    mo.health.max_rollbacks = options.max_rollbacks.value_or(mo.health.max_rollbacks);
    mo.health.loss_spike_z = options.loss_spike_z;
    mo.health.skip_data = !options.no_skip_data;
    mo.health.replica_check_every = options.replica_check_every.value_or(mo.health.replica_check_every);
    auto started = master::MasterServer::Start(mo);
    if (!started.ok()) {
      PrintError(absl::StrCat("cannot start the embedded ballast master on ", bind_host, ":", bind_port, ": ",
                              started.status().message()));
      return 1;
    }
    master = std::move(*started);
    if (standalone) {
      ao.endpoint = absl::StrCat("127.0.0.1:", master->port());
      ao.token = master->token();
    }
    spdlog::info("embedded ballast master listening on {}:{} job={}", bind_host, master->port(), master->job_id());
    if (master->http_port() > 0) spdlog::info("job {} dashboard: {}", master->job_id(), master->dashboard_url());
  }

  int code = 1;
  {
    Agent agent(ao);
    signals.Attach(&agent);
    code = agent.Run();
    signals.Detach();
  }
  if (master) {
    const v1::JobStatus final_status = master->Status();
    spdlog::info("job {} summary: {}; {} worker restart(s); {}", master->job_id(),
                 master::FormatGoodput(final_status.goodput()), final_status.restart_count(),
                 master::FormatFailures(final_status));
    // Other nodes must hear the final decision before the master goes away.
    master->Shutdown(standalone ? std::min(1.0, tunables.finish_linger_s) : tunables.finish_linger_s);
  }
  return code;
}

}  // namespace ballast::agent
