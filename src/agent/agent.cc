#include "agent/agent.h"

#include "agent/health_watch.h"
#include "health/health_policy.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "common/save_every.h"
#include "common/tls.h"
#include "health/oom.h"
#include "agent/chaos_driver.h"
#include "common/chaos.h"
#include "health/failure_class.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// User-facing fatal messages go to stderr directly: they must reach the person
// at the terminal whatever the logging setup.
void PrintError(const std::string& msg) { std::fprintf(stderr, "ballast run: %s\n", msg.c_str()); }

bool Retryable(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

}  // namespace

std::string DeriveHost(const std::string& local_addr, const std::string& master_host) {
  if (!local_addr.empty()) return local_addr;
  if (master_host.empty() || IsLoopbackHost(master_host)) return "127.0.0.1";
  auto addr = LocalAddressToward(master_host);
  if (addr.ok()) return *addr;
  spdlog::warn("cannot find this host's address toward the master '{}' ({}); announcing the host name {} "
               "(pass --local-addr if other nodes cannot resolve it)",
               master_host, std::string(addr.status().message()), HostName());
  return HostName();
}

std::string AddGlooInterface(const std::string& host, std::map<std::string, std::string>* env) {
  if (env->count("GLOO_SOCKET_IFNAME") > 0 || IsLoopbackHost(host)) return "";
  std::string iface = InterfaceWithAddress(host);
  if (iface.empty() || ResolvesToLocalNonLoopback(HostName())) return "";
  (*env)["GLOO_SOCKET_IFNAME"] = iface;
  return iface;
}

std::string MakeNodeId() { return absl::StrCat(HostName(), "-", getpid(), "-", RandomHex(2)); }

std::string PythonPackageDir(const std::string& exe_path) {
  if (exe_path.empty()) return "";
  std::error_code ec;
  std::filesystem::path dir = std::filesystem::path(exe_path).parent_path() / ".." / "python";
  if (!std::filesystem::is_directory(dir, ec)) return "";
  return std::filesystem::weakly_canonical(dir, ec).string();
}

std::string WorkerPythonPath(const std::string& package_dir, const std::string& existing) {
  if (package_dir.empty()) return existing;
  if (existing.empty()) return package_dir;
  if (existing == package_dir || absl::StartsWith(existing, package_dir + ":")) return existing;
  return absl::StrCat(package_dir, ":", existing);
}

std::vector<std::string> WorkerCommand(const RunOptions& o) {
  std::vector<std::string> argv;
  if (o.no_python) {
    argv.push_back(o.training_script);
  } else {
    // -u: unbuffered, so a crashing worker's last lines reach the failure report.
    argv = {o.python, "-u"};
    if (o.module) argv.push_back("-m");
    argv.push_back(o.training_script);
  }
  argv.insert(argv.end(), o.training_args.begin(), o.training_args.end());
  return argv;
}

v1::JobSpec JoinSpec(const RunOptions& o) {
  v1::JobSpec spec;
  if (o.nnodes_given) {
    spec.set_min_nodes(o.min_nodes);
    spec.set_max_nodes(o.max_nodes);
  }
  if (o.max_restarts.has_value()) spec.set_max_restarts(*o.max_restarts);
  if (o.node_unit > 0) spec.set_node_unit(o.node_unit);
  if (!o.rdzv_id.empty()) spec.set_run_id(o.rdzv_id);
  if (o.last_call_s >= 0) spec.set_last_call_s(o.last_call_s);
  if (o.precheck) spec.set_precheck(true);
  if (o.exclude_stragglers) spec.set_exclude_stragglers(true);
  if (!o.on_nan.empty()) spec.set_on_nan(o.on_nan);
  if (o.max_rollbacks.has_value()) spec.set_max_rollbacks(*o.max_rollbacks);
  if (o.loss_spike_z > 0) spec.set_loss_spike_z(o.loss_spike_z);
  if (o.no_skip_data) spec.set_no_skip_data(true);
  if (o.replica_check_every.has_value()) spec.set_replica_check_every(*o.replica_check_every);
  return spec;
}

Agent::Agent(AgentOptions options) : options_(std::move(options)) {
  if (options_.node_id.empty()) {
    // A scheduler names its nodes (a pod, a local node): the agent takes that
    // name, so messages and the scheduler's objects agree.
    const char* given = std::getenv("BALLAST_NODE_ID");
    options_.node_id = given != nullptr && *given != '\0' ? given : MakeNodeId();
  }
  if (options_.host.empty()) {
    auto ep = ParseEndpoint(options_.endpoint, -1);
    options_.host = DeriveHost(options_.run.local_addr, ep.ok() ? ep->host : "");
  }
  WorkerSpec spec;
  spec.argv = WorkerCommand(options_.run);
  spec.base_env = CurrentEnvironment();
  if (std::string iface = AddGlooInterface(options_.host, &spec.base_env); !iface.empty()) {
    spdlog::info("workers get GLOO_SOCKET_IFNAME={} (the interface of {}): this host's name {} does not resolve to "
                 "a local address, and gloo would fall back to loopback",
                 iface, options_.host, HostName());
  }
  // `import ballast` in a worker finds the package built next to this binary
  // (an installed package needs nothing: then the directory does not exist).
  if (std::string pkg = PythonPackageDir(SelfExePath()); !pkg.empty()) {
    auto it = spec.base_env.find("PYTHONPATH");
    spec.base_env["PYTHONPATH"] = WorkerPythonPath(pkg, it == spec.base_env.end() ? "" : it->second);
  }
  // Progress cells: one per local rank, LOCAL_RANK picks the worker's cell.
  if (auto progress = ProgressMonitor::Create(std::max(1, options_.run.nproc_per_node)); progress.ok()) {
    progress_ = std::move(*progress);
    spec.base_env[kProgressShmEnv] = progress_->name();
  } else {
    spdlog::warn("progress: cannot create the shared-memory cells ({}); no hang detection or step times",
                 progress.status().ToString());
  }
  spec.role = options_.run.role;
  spec.node_id = options_.node_id;
  spec.log_dir = options_.run.log_dir;
  spec.redirects = options_.run.redirects;
  spec.tee = options_.run.tee;
  spec.console_stdout_fd = options_.console_stdout_fd;
  spec.console_stderr_fd = options_.console_stderr_fd;
  spec.stderr_tail_lines = options_.tunables.stderr_tail_lines;
  if (options_.run.warm_restart && !options_.run.no_python) {
    WarmOptions wo;
    wo.python = options_.run.python;
    wo.low_priority = CanRestoreNormalPriority();
    if (!wo.low_priority) {
      spdlog::info("warm interpreters import at normal priority: this agent may not move a SCHED_IDLE process back "
                   "(no CAP_SYS_NICE, RLIMIT_NICE < 20), so preparing them shares the CPU with the workers");
    }
    wo.modules = {"torch"};
    for (const std::string& m : options_.run.warm_modules) {
      if (m != "torch") wo.modules.push_back(m);
    }
    wo.hints = DistributedHints();
    wo.fork = options_.run.warm_fork;
    warm_ = std::make_unique<WarmPool>(std::move(wo));
    spec.warm = warm_.get();
    spec.script_argv = {options_.run.training_script};
    spec.script_argv.insert(spec.script_argv.end(), options_.run.training_args.begin(),
                            options_.run.training_args.end());
    spec.module = options_.run.module;
  }
  workers_ = std::make_unique<WorkerGroup>(std::move(spec));
  if (progress_ != nullptr) {
    HangResponderOptions ho;
    ho.node_id = options_.node_id;
    ho.hang.timeout_s = options_.run.hang_timeout_s;
    ho.hang.first_step_grace_s = options_.tunables.hang_first_step_grace_s;
    ho.hang.checkpoint_grace_s = options_.tunables.hang_checkpoint_grace_s;
    ho.hang.exit_grace_s = options_.tunables.hang_exit_grace_s;
    ho.dump_wait_s = options_.tunables.hang_dump_wait_s;
    hangs_ = std::make_unique<HangResponder>(std::move(ho), HangHooks::ForWorkers(workers_.get(), progress_.get()),
                                             [this] { return Fmt(); });
  }

  MasterClientOptions copts;
  copts.endpoint = options_.endpoint;
  copts.token = options_.token;
  copts.credentials = options_.credentials;
  copts.locate = options_.locate_master;
  copts.reconnect_timeout_s = options_.tunables.reconnect_timeout_s;
  copts.rpc_timeout_s = options_.tunables.rpc_timeout_s;
  client_ = std::make_unique<MasterClient>(copts);

  RoundAddressOptions ro;
  ro.node_id = options_.node_id;
  ro.host = options_.host;
  ro.node_rank = options_.run.node_rank;
  ro.kv_wait_s = options_.tunables.kv_wait_s;
  ro.reconnect_timeout_s = options_.tunables.reconnect_timeout_s;
  ro.addr_check_timeout_s = options_.tunables.addr_check_timeout_s;
  ro.store_connect_timeout_s = options_.tunables.store_connect_timeout_s;
  round_address_ = std::make_unique<RoundAddress>(
      std::move(ro),
      RoundAddressHooks::Real([this](const std::string& k, const std::string& v) { return client_->KvSet(k, v); },
                              [this](const std::string& k, double wait_s) { return client_->KvGet(k, wait_s); }),
      [this] { return Fmt(); });
}

Agent::~Agent() {
  if (client_) client_->Shutdown();
  if (workers_) workers_->Stop(0);
  // After the workers: the stores are unlinked here, and the persister thread
  // must not outlive client_. The replica sender and fetches use the stores.
  replicas_.reset();
  ckpt_.reset();
}

void Agent::StartCheckpointStores(const std::string& job_id) {
  // A SIGKILLed agent cannot unlink its stores and progress cells: reclaim
  // that memory now.
  RemoveStaleAgentShmObjects();
  if (!options_.flash_checkpoint) return;
  CkptPersisterOptions po;
  po.node_id = options_.node_id;
  po.local_world_size = options_.run.nproc_per_node;
  po.name_prefix = CkptStorePrefix(job_id, getpid());
  po.report_timeout_s = options_.tunables.ckpt_report_timeout_s;
  po.breakpoint_report_timeout_s = options_.tunables.ckpt_breakpoint_report_timeout_s;
  po.copy_nice = options_.run.ckpt_copy_nice;
  po.num_slots = options_.run.ckpt_replicas > 0 ? 4 : 3;
  if (disk_chaos_ != nullptr && disk_chaos_->armed()) {
    po.before_write = [d = disk_chaos_.get()](uint64_t step, const std::string& dir) {
      return d->BeforeWrite(step, dir);
    };
  }
  auto created = CkptPersister::Create(po, [this](const v1::ShardDurableReport& r, double timeout_s) {
    return client_->ReportShardDurable(r, timeout_s);
  });
  if (!created.ok()) {
    // The workers' Checkpointer then keeps its own store and persists in-process.
    spdlog::warn("flash checkpoint: cannot create the shared-memory stores ({}); workers will not get {} {}",
                 created.status().ToString(), kCkptShmEnv, Fmt());
    return;
  }
  ckpt_ = std::move(*created);
  ckpt_env_.assign(ckpt_->num_stores(), {});
  for (int lr = 0; lr < ckpt_->num_stores(); ++lr) ckpt_env_[lr][kCkptShmEnv] = ckpt_->store_name(lr);
  workers_->set_local_rank_env(ckpt_env_);
  ckpt_->Start();
  spdlog::info("flash checkpoint: {} shared-memory stores {}-0..{} {}", ckpt_->num_stores(), po.name_prefix,
               ckpt_->num_stores() - 1, Fmt());
  if (options_.run.ckpt_replicas <= 0) return;
  ReplicaOptions ro;
  ro.node_id = options_.node_id;
  ro.host = options_.host;
  ro.token = options_.token;
  ro.store_prefix = po.name_prefix;
  ro.replicas = options_.run.ckpt_replicas;
  ro.copy_nice = options_.run.ckpt_copy_nice;
  std::vector<ckpt::SlotStore*> stores;
  for (int lr = 0; lr < ckpt_->num_stores(); ++lr) stores.push_back(ckpt_->store(lr));
  auto replicas = ReplicaCoordinator::Start(
      ro, std::move(stores), [this](const std::string& k, const std::string& v) { return client_->KvSet(k, v); },
      [this](const std::string& k) { return client_->KvGet(k, 0); }, [this] { return Fmt(); });
  if (!replicas.ok()) {
    spdlog::warn("flash checkpoint: no peer replicas: {} {}", replicas.status().ToString(), Fmt());
    return;
  }
  replicas_ = std::move(*replicas);
  spdlog::info("flash checkpoint: replicas of this node's steps go to the next {} node(s); replica channel {} {}",
               options_.run.ckpt_replicas, replicas_->address(), Fmt());
}

std::string Agent::Fmt() const { return absl::StrCat("node=", options_.node_id, " round=", round_); }

void Agent::Post(Event e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

void Agent::PostSignal(int sig) {
  int n = ++signals_;
  // A second signal means "now": Stop() watches kill_now_ and SIGKILLs at once.
  if (n >= 2) kill_now_ = true;
  // A Join still retrying would hold the main loop for up to the connect
  // timeout: cancel it (the client is not used any more after a signal).
  if (joining_.load()) client_->Cancel();
  Post(SignalEvent{sig});
}

std::optional<Agent::Event> Agent::PopFor(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, timeout_s)), [&] { return !events_.empty(); });
  if (events_.empty()) return std::nullopt;
  Event e = std::move(events_.front());
  events_.pop_front();
  return e;
}

bool Agent::SupersedingEventPending() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Event& e : events_) {
    const auto* d = std::get_if<v1::Decision>(&e);
    if (d == nullptr) return true;  // signal or master lost
    // A reconnecting watch re-sends the current round: that changes nothing.
    if (d->has_start_round() && d->start_round().round() <= round_) continue;
    if (d->has_stop_workers() && d->stop_workers().round() < round_) continue;
    return true;
  }
  return false;
}

void Agent::PublishState() {
  v1::HeartbeatRequest hb;
  hb.set_node_id(options_.node_id);
  hb.set_round(running_round_ ? round_ : 0);
  for (const WorkerInfo& w : workers_->Workers()) {
    auto* ws = hb.add_workers();
    ws->set_local_rank(w.local_rank);
    ws->set_global_rank(w.global_rank);
    ws->set_pid(w.pid);
    ws->set_state(WorkerStateName(w.state));
  }
  std::lock_guard<std::mutex> lock(mu_);
  heartbeat_ = std::move(hb);
}

int Agent::Run() {
  const Tunables& t = options_.tunables;
  {
    // Fault injection for drills and tests (common/chaos.h).
    auto chaos = ChaosSpecFromEnv();
    if (!chaos.ok()) {
      PrintError(std::string(chaos.status().message()));
      return 2;
    }
    chaos_ = std::make_unique<ChaosDriver>(*chaos, options_.run.node_rank);
    disk_chaos_ = std::make_unique<DiskChaos>(*chaos, options_.run.node_rank);
    if (chaos->Find("partition", options_.run.node_rank) != nullptr) {
      // Checked now: a drill that cannot cut this node's network must not
      // pass for one that did.
      chaos_iface_ = IsLoopbackHost(options_.host) ? "" : InterfaceWithAddress(options_.host);
      if (chaos_iface_.empty()) {
        PrintError(absl::StrCat("chaos partition on node rank ", options_.run.node_rank, ": this node's address ",
                                options_.host,
                                " is not on a network interface of its own (loopback, or a name): run the nodes on "
                                "separate hosts or in network namespaces, and pass --local-addr IP"));
        return 2;
      }
    }
    if (chaos_->armed() || disk_chaos_->armed()) {
      spdlog::warn("chaos: {} (node rank {})", std::getenv(kChaosEnv), options_.run.node_rank);
    }
    PrecheckRunnerOptions po;
    po.node_id = options_.node_id;
    po.host = options_.host;
    po.node_rank = options_.run.node_rank;
    po.nproc_per_node = options_.run.nproc_per_node;
    po.python = options_.run.python;
    po.base_env = CurrentEnvironment();
    AddGlooInterface(options_.host, &po.base_env);
    if (std::string pkg = PythonPackageDir(SelfExePath()); !pkg.empty()) {
      auto it = po.base_env.find("PYTHONPATH");
      po.base_env["PYTHONPATH"] = WorkerPythonPath(pkg, it == po.base_env.end() ? "" : it->second);
    }
    po.chaos = *std::move(chaos);
    po.kv_wait_s = t.kv_wait_s;
    precheck_ = std::make_unique<PrecheckRunner>(std::move(po), client_.get());
  }
  v1::JoinRequest join;
  auto* node = join.mutable_node();
  node->set_node_id(options_.node_id);
  node->set_node_rank_hint(options_.run.node_rank);
  node->set_local_world_size(options_.run.nproc_per_node);
  node->set_host(options_.host);
  node->set_pid(getpid());
  *join.mutable_spec() = JoinSpec(options_.run);
  PublishState();

  double join_timeout = options_.run.join_timeout_s > 0 ? options_.run.join_timeout_s : t.connect_timeout_s;
  spdlog::info("joining master {} ({} workers on this node, host {}) node={}", options_.endpoint,
               options_.run.nproc_per_node, options_.host, options_.node_id);
  joining_ = true;
  auto joined = signals_.load() > 0 ? absl::StatusOr<v1::JoinResponse>(absl::CancelledError("signal"))
                                    : client_->Join(join, join_timeout);
  joining_ = false;
  if (!joined.ok()) {
    const absl::Status& s = joined.status();
    if (signals_.load() > 0) {
      auto e = PopFor(0);
      int sig = e.has_value() && std::holds_alternative<SignalEvent>(*e) ? std::get<SignalEvent>(*e).sig : SIGTERM;
      return 128 + sig;
    }
    if (absl::IsUnauthenticated(s)) {
      PrintError(absl::StrCat("the ballast master at ", options_.endpoint,
                              " refused this agent's token: pass the token it printed with --token or BALLAST_TOKEN"));
    } else if (absl::IsUnavailable(s) && MasterClosedConnection(s.message()) &&
               TlsHint(std::string(s.message())).empty()) {
      // All a client sees of a TLS mismatch other than a failed handshake of
      // its own: which side lacks what follows from this agent's settings.
      TlsFiles tls = options_.run.tls;
      tls.FillFromEnv();
      PrintError(absl::StrCat(
          "the ballast master at ", options_.endpoint, " accepted the connection and closed it without an answer (",
          join_timeout, " s of attempts): ",
          !tls.on()
              ? "a master that serves TLS does that to an agent without TLS; pass --tls-ca, and --tls-cert and "
                "--tls-key if it wants client certificates (or BALLAST_TLS_CA, BALLAST_TLS_CERT, BALLAST_TLS_KEY)"
          : tls.cert.empty()
              ? "a master with mutual TLS does that to an agent without a client certificate (the TLS handshake "
                "itself went through); pass --tls-cert and --tls-key (or BALLAST_TLS_CERT and BALLAST_TLS_KEY)"
              : "a master with mutual TLS does that to a client certificate its --tls-ca did not sign; is --tls-cert "
                "signed by that CA?"));
    } else if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) {
      PrintError(absl::StrCat("cannot reach the ballast master at ", options_.endpoint, " after ",
                              join_timeout, " s: is `ballast master` running there and the port open? "
                              "(BALLAST_CONNECT_TIMEOUT_S waits longer)", TlsHint(std::string(s.message()))));
    } else {
      PrintError(absl::StrCat("the ballast master at ", options_.endpoint, " refused to join this node: ",
                              s.message()));
    }
    return 1;
  }
  spdlog::info("joined job {} at master {} (nodes {}..{}, max restarts {}) node={}", joined->job_id(),
               options_.endpoint, joined->spec().min_nodes(), joined->spec().max_nodes(),
               joined->spec().max_restarts(), options_.node_id);
  StartCheckpointStores(joined->job_id());
  health_env_[health::kOnNanEnv] = joined->spec().on_nan().empty() ? "rollback" : joined->spec().on_nan();
  if (joined->spec().loss_spike_z() > 0) {
    health_env_[health::kLossSpikeEnv] = absl::StrCat(joined->spec().loss_spike_z());
  }
  health_env_[health::kReplicaCheckEveryEnv] = absl::StrCat(
      joined->spec().has_replica_check_every() ? joined->spec().replica_check_every() : 100);
  // The Checkpointer's save interval (python/ballast/save_policy.py); with
  // auto the workers estimate the failure rate from the restarts in the job's
  // age, counted from this agent's join (a replacement node's is younger: it
  // errs towards more frequent saves).
  if (!options_.run.save_every.empty()) health_env_[kSaveEveryEnv] = options_.run.save_every;
  if (options_.run.mtbf_s > 0) health_env_[kMtbfEnv] = absl::StrCat(options_.run.mtbf_s);
  if (options_.run.ckpt_copy_share > 0) health_env_[kCopyShareEnv] = absl::StrCat(options_.run.ckpt_copy_share);
  if (health_env_.count(kJobStartEnv) == 0) {  // the first join's, kept across a master's restart
    health_env_[kJobStartEnv] = absl::StrFormat("%.3f", absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  }
  // The check servers and the warm interpreters import torch while the
  // rendezvous completes.
  if (options_.run.precheck) precheck_->Warm();
  if (warm_ != nullptr) {
    warm_starter_ = std::make_unique<WarmStarter>(
        warm_.get(), workers_.get(), options_.run.nproc_per_node,
        WarmKv{[this](const std::string& k) { return client_->KvGet(k, 0); },
               [this](const std::string& k, const std::string& v) { return client_->KvSet(k, v); }},
        [this] { return Fmt(); });
    warm_starter_->KeepModulesBetweenRuns(options_.run.python, options_.run.training_script, options_.run.module);
    warm_starter_->PrepareNow();
  }

  client_->StartWatch(
      options_.node_id, [this](const v1::Decision& d) { Post(d); },
      [this](const absl::Status& s) { Post(MasterLost{s}); });
  double hb_interval = joined->heartbeat_interval_s() > 0 ? joined->heartbeat_interval_s() : t.heartbeat_interval_s;
  client_->StartHeartbeat(hb_interval, [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return heartbeat_;
  });

  std::optional<int> exit_code;
  auto next_poll = Clock::now();
  const auto poll_every = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.run.monitor_interval_s));
  while (!exit_code.has_value()) {
    double wait = std::chrono::duration<double>(next_poll - Clock::now()).count();
    if (auto e = PopFor(wait); e.has_value()) exit_code = Handle(*e);
    if (!exit_code.has_value() && Clock::now() >= next_poll) {
      exit_code = PollWorkers();
      next_poll = Clock::now() + poll_every;
    }
  }
  StopWorkers("the agent is exiting");
  if (chaos_link_down_) {
    // A partition drill never outlives its agent: the node gets its network back.
    absl::Status st = SetInterfaceUp(chaos_iface_, true);
    spdlog::warn("chaos: partition: the agent exits; network interface {} {}", chaos_iface_,
                 st.ok() ? "up again" : std::string(st.message()));
  }
  client_->Shutdown();
  return *exit_code;
}

std::optional<int> Agent::Handle(const Event& e) {
  if (const auto* d = std::get_if<v1::Decision>(&e)) return HandleDecision(*d);
  if (const auto* lost = std::get_if<MasterLost>(&e)) {
    PrintError(absl::StrCat(lost->status.message(), "; stopping this node's workers (", Fmt(), ")"));
    StopWorkers("the master is lost");
    return 1;
  }
  int sig = std::get<SignalEvent>(e).sig;
  spdlog::warn("got {}: stopping workers (a second signal kills them at once) {}", SignalName(sig), Fmt());
  StopWorkers(absl::StrCat("the agent got ", SignalName(sig)));
  // Best effort: tells the master now instead of after the heartbeat timeout.
  absl::Status s = client_->Leave(options_.node_id, absl::StrCat("agent got ", SignalName(sig)), 1.0);
  if (!s.ok()) spdlog::debug("leave: {}", s.ToString());
  return 128 + sig;
}

std::optional<int> Agent::HandleDecision(const v1::Decision& d) {
  switch (d.kind_case()) {
    case v1::Decision::kStartRound:
      StartRound(d.start_round());
      return std::nullopt;
    case v1::Decision::kWait:
      if (running_round_) StopWorkers(absl::StrCat("waiting: ", d.wait().reason()), Breakpoint::kBackground);
      spdlog::info("waiting for a round: {} node={}", d.wait().reason(), options_.node_id);
      return std::nullopt;
    case v1::Decision::kStopWorkers:
      if (d.stop_workers().round() >= round_ && running_round_)
        StopWorkers(absl::StrCat("the master stops round ", d.stop_workers().round(), ": ",
                                 d.stop_workers().reason()),
                    Breakpoint::kBackground);
      return std::nullopt;
    case v1::Decision::kJobFinished: {
      const auto& f = d.job_finished();
      // A succeeded job's workers exited 0 having persisted what they wanted.
      StopWorkers("the job finished", f.succeeded() ? Breakpoint::kNone : Breakpoint::kWait);
      if (f.succeeded()) {
        spdlog::info("job succeeded {}", Fmt());
        return 0;
      }
      // The master's message names node, rank, cause and stderr tail.
      PrintError(absl::StartsWith(f.message(), "job failed") ? f.message() : absl::StrCat("job failed: ", f.message()));
      return 1;
    }
    case v1::Decision::kRunCheck:
      if (running_round_) StopWorkers("the master runs the pre-flight check", Breakpoint::kBackground);
      precheck_->Start(d.run_check(), [this] { return SupersedingEventPending(); });
      return std::nullopt;
    case v1::Decision::kExcluded:
      // Non-zero: a scheduler (ballast launch, a pod restart) replaces the node.
      if (const int64_t below = d.excluded().rollback_below(); below > 0) {
        // The job rolls back: this node's newest steps are dropped (they may
        // hold the corruption it was excluded for). Its newest step before
        // them is the world's rollback target: written before the agent
        // exits, and so before its replacement starts and looks for it.
        StopWorkers("this node was excluded from the job", Breakpoint::kNone);
        RewindCheckpoints(static_cast<uint64_t>(below));
        if (ckpt_ != nullptr && !kill_now_.load()) {
          ckpt_->BreakpointSave(absl::StrCat("this node was excluded; the job rolls back to a step before ", below));
        }
      } else {
        StopWorkers("this node was excluded from the job");
      }
      PrintError(absl::StrCat("this node was excluded from the job: ", d.excluded().reason(), " (", Fmt(), ")"));
      return 1;
    case v1::Decision::KIND_NOT_SET:
      break;
  }
  spdlog::warn("ignoring an empty decision from the master {}", Fmt());
  return std::nullopt;
}

void Agent::StopWorkers(const std::string& why, Breakpoint breakpoint) {
  if (precheck_ != nullptr) precheck_->Stop();
  round_address_->RoundEnded();
  if (!workers_->started()) {
    running_round_ = false;
    if (breakpoint == Breakpoint::kNone) exit_breakpoint_owed_ = false;  // the job succeeded, or a rollback
    if (breakpoint == Breakpoint::kWait && exit_breakpoint_owed_ && ckpt_ != nullptr && !kill_now_.load()) {
      exit_breakpoint_owed_ = false;
      ckpt_->BreakpointSave(why);
    }
    return;
  }
  if (workers_->AnyRunning()) spdlog::info("stopping workers: {} {}", why, Fmt());
  workers_->Stop(options_.tunables.stop_grace_s, &kill_now_);
  running_round_ = false;
  exit_breakpoint_owed_ = breakpoint == Breakpoint::kBackground;
  PublishState();
  // Breakpoint save, only now: with every worker dead no slot is being
  // written, so each store's newest committed step is final. Before a
  // restart it is pinned here and written by the persister's thread while
  // the next round's workers start (they restore from memory; waiting for
  // the disk cost a restart ~0.7 s per 64 MiB rank here); before the agent
  // exits it is written now.
  if (breakpoint == Breakpoint::kNone || ckpt_ == nullptr || kill_now_.load()) return;
  if (breakpoint == Breakpoint::kBackground) {
    ckpt_->BreakpointSaveAsync(why);
  } else {
    ckpt_->BreakpointSave(why);
  }
}

void Agent::WatchStore() {
  if (round_failed_reported_) return;
  std::optional<v1::FailureReport> report = round_address_->WatchStore(MonotonicNowNs(), round_start_);
  if (!report.has_value()) return;
  round_failed_reported_ = true;
  ReportFailure(*std::move(report));
}

void Agent::StartRound(const v1::StartRound& start) {
  if (start.round() <= round_) {
    spdlog::debug("ignoring StartRound {}: already at round {} node={}", start.round(), round_, options_.node_id);
    return;
  }
  timeline_.DecisionArrived(MonotonicNowNs());
  // Older workers go first: a new round never overlaps the old one. Before
  // a rollback, no breakpoint save: the newest steps may hold the bad loss.
  const bool rollback = start.rollback_below() > 0;
  StopWorkers(absl::StrCat("round ", start.round(), " replaces round ", round_),
              rollback ? Breakpoint::kNone : Breakpoint::kBackground);
  if (rollback) RewindCheckpoints(static_cast<uint64_t>(start.rollback_below()));
  timeline_.OldWorkersStopped(MonotonicNowNs());
  round_ = start.round();
  round_start_ = start;
  if (ckpt_ != nullptr) ckpt_->set_round(round_);
  round_failed_reported_ = false;
  const int nproc = options_.run.nproc_per_node;

  auto report_start_failure = [&](const std::string& cause, bool unreachable = false) {
    spdlog::error("cannot start the workers of round {}: {} {}", round_, cause, Fmt());
    v1::FailureReport report;
    report.set_node_id(options_.node_id);
    report.set_round(round_);
    report.set_local_rank(0);
    report.set_global_rank(start.rank_offset());
    // No worker ran: an exit status of 127 ("could not start") unless the
    // cause is the agent's own verdict.
    report.set_exit_code(unreachable ? 0 : 127);
    report.set_cause(cause);
    if (unreachable) {
      health::FailureEvidence evidence;
      evidence.master_addr_unreachable = true;
      health::FailureClass fc = health::Classify(evidence);
      report.set_kind(health::FailureKindName(fc.kind));
      report.set_max_retries(fc.max_retries);
    }
    round_failed_reported_ = true;
    ReportFailure(report);
  };

  auto endpoint = round_address_->Resolve(start, [this] { return SupersedingEventPending(); });
  if (absl::IsAborted(endpoint.status())) {
    spdlog::info("round {} superseded before its workers started {}", round_, Fmt());
    return;
  }
  if (!endpoint.ok()) {
    report_start_failure(absl::StrCat("no MASTER_ADDR/MASTER_PORT for the round: ", endpoint.status().message()));
    return;
  }
  if (std::string cause = round_address_->Check(start, *endpoint); !cause.empty()) {
    report_start_failure(cause, /*unreachable=*/true);
    return;
  }

  RoundSpec rs;
  rs.round = start.round();
  rs.group_rank = start.group_rank();
  rs.group_world_size = start.group_world_size();
  rs.rank_offset = start.rank_offset();
  rs.world_size = start.world_size();
  rs.local_world_size = nproc;
  rs.restart_count = start.restart_count();
  rs.max_restarts = start.max_restarts();
  rs.run_id = start.run_id();
  rs.master_addr = endpoint->host;
  rs.master_port = endpoint->port;
  rs.env = health_env_;
  if (!start.skip_data().empty()) rs.env[health::kSkipDataEnv] = start.skip_data();
  // A rollback round's workers must find a step below this one (Checkpointer.load
  // says so by name when none is left anywhere, instead of starting over).
  if (rollback) rs.env["BALLAST_ROLLBACK_BELOW"] = absl::StrCat(start.rollback_below());
  // No worker runs now: the cells start clean, and the first-step grace counts from here.
  if (progress_ != nullptr) progress_->Reset();
  fp_sent_.assign(static_cast<size_t>(nproc), 0);
  round_started_ns_ = MonotonicNowNs();
  if (chaos_ != nullptr) chaos_->RoundStarted(round_started_ns_, start.restart_count());
  next_progress_report_ns_ = round_started_ns_;
  if (replicas_ != nullptr) {
    replicas_->BeforeRound(start);
    // The replicas held here as the round starts: a world of another size
    // reads the lost ranks' steps from them (Checkpointer.load).
    std::vector<std::map<std::string, std::string>> env = ckpt_env_;
    const std::string held = absl::StrJoin(replicas_->HeldStores(), ",");
    const int holders = std::min(options_.run.ckpt_replicas, start.group_world_size() - 1);
    for (auto& e : env) {
      if (!held.empty()) e[kCkptReplicasEnv] = held;
      if (holders > 0) e[kCkptReplicaPeersEnv] = absl::StrCat(holders);
    }
    workers_->set_local_rank_env(std::move(env));
  }
  absl::Status s = workers_->Start(rs);
  if (!s.ok()) {
    report_start_failure(std::string(s.message()));
    PublishState();
    return;
  }
  running_round_ = true;
  oom_kills_seen_ = health::CgroupOomKills();
  timeline_.WorkersStarted(MonotonicNowNs());
  if (warm_starter_ != nullptr) warm_starter_->WorkersStarted(timeline_.started_ns());
  round_address_->WorkersStarted(start, rs.master_port);
  PublishState();
  spdlog::info("round {}: node {} of {}, ranks {}-{} of {}, restart {}/{}, MASTER_ADDR={}:{}, {} start {}", round_,
               start.group_rank(), start.group_world_size(), start.rank_offset(), start.rank_offset() + nproc - 1,
               start.world_size(), start.restart_count(), start.max_restarts(), rs.master_addr, rs.master_port,
               workers_->start_summary(), Fmt());
}

void Agent::ReportFailure(v1::FailureReport report) {
  auto t0 = Clock::now();
  while (true) {
    report.set_seen_age_s(SecondsSince(t0));
    absl::Status s = client_->ReportFailure(report);
    if (s.ok()) return;
    if (absl::IsAborted(s)) {
      spdlog::debug("failure report for round {} is stale: {}", report.round(), std::string(s.message()));
      return;
    }
    // A master unreachable (restarting from its journal) must still hear
    // about the failure, or the surviving ranks would wait in their
    // collectives: retry as long as the agent waits for a lost master.
    if (!Retryable(s) || SecondsSince(t0) > options_.tunables.reconnect_timeout_s || signals_.load() > 0 ||
        SupersedingEventPending()) {
      spdlog::warn("could not report the failure of rank {} to the master: {} {}", report.global_rank(),
                   s.ToString(), Fmt());
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

std::optional<int> Agent::PollWorkers() {
  InjectChaos();
  if (precheck_ != nullptr) precheck_->Poll();
  if (!running_round_) {
    // A hot spare (or a node between rounds): its warm interpreters get
    // ready and take in what the training nodes publish.
    if (warm_starter_ != nullptr) warm_starter_->Poll(MonotonicNowNs(), false);
    return std::nullopt;
  }
  std::vector<WorkerEvent> events = workers_->Poll();
  for (const WorkerEvent& e : events) {
    if (e.kind == WorkerEvent::Kind::kFailed) {
      // The worker's stderr already reached the console (or its log file), so
      // the tail is only repeated at debug level.
      spdlog::error("worker failed: {} (pid {}) node={} rank={} local_rank={} round={}", e.status.Describe(), e.pid,
                    options_.node_id, e.global_rank, e.local_rank, e.round);
      // The steps this node made up to now, before the failure: the master
      // counts the time after the last of them as lost.
      if (!round_failed_reported_) MaybeReportProgress(/*now_please=*/true);
      // The first failure of this round (one left from a round whose first
      // step never came is stale).
      timeline_.FailureSeen(MonotonicNowNs());
      if (!e.stderr_tail.empty()) spdlog::debug("last stderr lines of rank {}:\n{}", e.global_rank, e.stderr_tail);
      // One report per round: the master restarts the whole round on the first
      // failure, and the others are usually its consequence.
      if (round_failed_reported_) continue;
      round_failed_reported_ = true;
      v1::FailureReport report;
      report.set_node_id(options_.node_id);
      report.set_round(e.round);
      report.set_local_rank(e.local_rank);
      report.set_global_rank(e.global_rank);
      report.set_exit_code(e.status.exit_code);
      report.set_signal(e.status.signal);
      report.set_stderr_tail(e.stderr_tail);
      // The cause and its retry limit come from the classification table.
      health::FailureEvidence evidence;
      evidence.exit_code = e.status.exit_code;
      evidence.signal = e.status.signal;
      evidence.stderr_tail = e.stderr_tail;
      if (e.status.signal == SIGKILL) {
        // The kernel counts its OOM kills in the cgroup the workers share with us.
        const std::optional<int64_t> kills = health::CgroupOomKills();
        evidence.oom_killed = kills.has_value() && oom_kills_seen_.has_value() && *kills > *oom_kills_seen_;
        oom_kills_seen_ = kills;
      }
      health::FailureClass fc = health::Classify(evidence);
      report.set_cause(fc.cause);
      report.set_kind(health::FailureKindName(fc.kind));
      report.set_max_retries(fc.max_retries);
      ReportFailure(report);
    } else {
      spdlog::info("all {} workers exited 0; waiting for the other nodes {}", options_.run.nproc_per_node, Fmt());
      MaybeReportProgress(/*now_please=*/true);  // the last steps, for the master's goodput accountant
      auto t0 = Clock::now();
      absl::Status s;
      do {
        s = client_->ReportWorkersDone(options_.node_id, e.round);
        if (s.ok() || absl::IsAborted(s) || !Retryable(s)) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      } while (SecondsSince(t0) < options_.tunables.reconnect_timeout_s && signals_.load() == 0);
      if (!s.ok() && !absl::IsAborted(s)) spdlog::warn("could not report workers done: {} {}", s.ToString(), Fmt());
    }
  }
  if (!events.empty()) PublishState();
  if (running_round_) {
    CheckHealth();
    CheckHangs();
    WatchStore();
    MaybeReportProgress();
    TrackTimeline();
  }
  if (warm_starter_ != nullptr) warm_starter_->Poll(MonotonicNowNs(), running_round_);
  return std::nullopt;
}

void Agent::InjectChaos() {
  if (chaos_ == nullptr || !chaos_->armed()) return;
  std::vector<ChaosDriver::Worker> workers;
  if (running_round_) {
    for (const WorkerInfo& w : workers_->Workers()) {
      ChaosDriver::Worker v{w.global_rank, w.pid, w.state == WorkerState::kRunning};
      if (progress_ != nullptr && w.local_rank < progress_->num_cells()) {
        const CellSnapshot c = progress_->Read(w.local_rank);
        v.stepped = c.timestamp_ns != 0;
        v.step = c.step;
      }
      workers.push_back(v);
    }
  }
  for (const ChaosAction& a : chaos_->Due(MonotonicNowNs(), workers)) {
    switch (a.kind) {
      case ChaosAction::Kind::kKillAgent:
        spdlog::warn("chaos: {}: SIGKILL to this agent (pid {}) {}", a.what, getpid(), Fmt());
        spdlog::default_logger()->flush();
        kill(getpid(), SIGKILL);
        break;
      case ChaosAction::Kind::kKillWorker:
        spdlog::warn("chaos: {}: SIGKILL to worker rank {} {}", a.what, a.global_rank, Fmt());
        kill(a.pid, SIGKILL);
        break;
      case ChaosAction::Kind::kStopWorker:
        spdlog::warn("chaos: {}: SIGSTOP to worker rank {} (it hangs) {}", a.what, a.global_rank, Fmt());
        kill(a.pid, SIGSTOP);
        break;
      case ChaosAction::Kind::kReportStep:
        // The launcher kills the master when the master's status shows the
        // step: sent now, not at the next periodic report (up to 2 s later).
        spdlog::info("chaos: {}: reporting this node's step to the master now {}", a.what, Fmt());
        MaybeReportProgress(/*now_please=*/true);
        break;
      case ChaosAction::Kind::kLinkDown:
      case ChaosAction::Kind::kLinkUp: {
        const bool up = a.kind == ChaosAction::Kind::kLinkUp;
        absl::Status st = SetInterfaceUp(chaos_iface_, up);
        chaos_link_down_ = st.ok() ? !up : chaos_link_down_;
        if (st.ok()) {
          spdlog::warn("chaos: {}: network interface {} ({}) {} {}", a.what, chaos_iface_, options_.host,
                       up ? "up again" : absl::StrCat("down for ", a.seconds, " s"), Fmt());
        } else {
          spdlog::error("chaos: {}: {} {}", a.what, std::string(st.message()), Fmt());
        }
        break;
      }
    }
  }
}

void Agent::TrackTimeline() {
  if (!timeline_.pending()) return;
  workers_->ReadControl();
  std::vector<RecoveryTimeline::Worker> running;
  for (const WorkerInfo& w : workers_->Workers()) {
    if (w.state != WorkerState::kRunning) continue;
    const bool stepped = progress_ != nullptr && w.local_rank < progress_->num_cells() &&
                         progress_->Read(w.local_rank).timestamp_ns > timeline_.started_ns();
    running.push_back({w.pg_up_s, stepped, w.pg_call_s});
  }
  const uint64_t now = MonotonicNowNs();
  const bool recovery = round_start_.restart_count() > 0 || round_ > 1;
  RecoveryTimeline::Progress p = timeline_.Track(running, now, round_, recovery, workers_->start_summary());
  // The workers' process groups are up (warm workers say so): their start
  // is past its CPU-heavy part, so the next restart's interpreters may
  // start importing now (a script that never calls ballast.step() would
  // otherwise wait for the fallback).
  if (p.all_pg_up && warm_starter_ != nullptr) warm_starter_->ProcessGroupsUp(now);
  if (!p.record.has_value()) return;
  // The round's first step, for the master's goodput accountant: every
  // worker made one (the lowest step now; a worker may be a step further).
  first_step_ = FirstStep{round_, now, progress_->Summarize().min_step};
  // Warm interpreters for the next restart may start now, and import what
  // these workers imported after their start.
  if (warm_starter_ != nullptr) warm_starter_->FirstStep(now);
  last_timeline_ = *std::move(p.record);  // for `ballast status` (sent with the progress reports)
  next_progress_report_ns_ = 0;           // report it now
  spdlog::info("{} {}", *p.line, Fmt());
}

void Agent::CheckHangs() {
  if (hangs_ == nullptr || round_failed_reported_) return;
  std::optional<v1::FailureReport> report = hangs_->Check(MonotonicNowNs(), round_started_ns_, round_);
  if (!report.has_value()) return;
  timeline_.FailureSeen(MonotonicNowNs());
  // Reported now, with the hang as its cause; the reaped SIGKILL (and the
  // other workers' failures that follow it) are then consequences.
  round_failed_reported_ = true;
  ReportFailure(*std::move(report));
}

void Agent::CheckHealth() {
  if (progress_ == nullptr || round_failed_reported_ || !running_round_) return;
  for (const WorkerInfo& w : workers_->Workers()) {
    if (w.state != WorkerState::kRunning || w.local_rank >= progress_->num_cells()) continue;
    std::optional<HealthRecord> bad = progress_->ReadHealth(w.local_rank);
    if (!bad.has_value()) continue;
    v1::FailureReport report = HealthFailureReport(*bad, options_.node_id, round_, w.local_rank, w.global_rank);
    spdlog::warn("worker rank {} (local rank {}) reported a bad loss: {}; stopping the workers {}", w.global_rank,
                 w.local_rank, report.cause(), Fmt());
    timeline_.FailureSeen(MonotonicNowNs());
    MaybeReportProgress(/*now_please=*/true);
    round_failed_reported_ = true;
    // Reported before the workers stop: the other ranks' crashes that follow
    // must not reach the master first. No breakpoint save: the newest steps
    // may already hold the bad loss.
    ReportFailure(std::move(report));
    StopWorkers("a worker reported a bad loss", Breakpoint::kNone);
    return;
  }
}

std::vector<v1::Fingerprint> Agent::NewFingerprints() {
  std::vector<v1::Fingerprint> out;
  if (progress_ == nullptr) return out;
  for (int lr = 0; lr < progress_->num_cells() && lr < static_cast<int>(fp_sent_.size()); ++lr) {
    std::optional<FingerprintRecord> f = progress_->ReadFingerprint(lr);
    if (!f.has_value() || f->step <= fp_sent_[lr]) continue;
    fp_sent_[lr] = f->step;
    v1::Fingerprint& p = out.emplace_back();
    p.set_rank(round_start_.rank_offset() + lr);
    p.set_step(static_cast<int64_t>(f->step));
    p.set_value(f->value);
    p.set_group(f->group);
  }
  return out;
}

void Agent::RewindCheckpoints(uint64_t below) {
  std::string what = ckpt_ != nullptr ? ckpt_->Rewind(below) : "no checkpoint stores";
  if (replicas_ != nullptr) absl::StrAppend(&what, "; ", replicas_->Rewind(below), " replica step(s) dropped");
  spdlog::warn("rollback: every checkpoint step from {} on is dropped: {} {}", below, what, Fmt());
}

void Agent::MaybeReportProgress(bool now_please) {
  if (progress_ == nullptr) return;
  const uint64_t now = MonotonicNowNs();
  auto fingerprint_pending = [this] {
    for (int lr = 0; lr < progress_->num_cells() && lr < static_cast<int>(fp_sent_.size()); ++lr) {
      std::optional<FingerprintRecord> f = progress_->ReadFingerprint(lr);
      if (f.has_value() && f->step > fp_sent_[lr]) return true;
    }
    return false;
  };
  // A new fingerprint goes out at once: the master compares them as they
  // come; so does a report while a worker waits to hear a verdict (its pinned
  // rollback target moves only once the step it holds next is agreed).
  if (now < next_progress_report_ns_ && !now_please && !fingerprint_pending() && progress_->SdcWaiting() == 0) return;
  next_progress_report_ns_ = now + static_cast<uint64_t>(options_.tunables.progress_report_interval_s * 1e9);
  ProgressSummary sum = progress_->Summarize();
  if (!sum.any_step) return;
  v1::ProgressReport report;
  report.set_node_id(options_.node_id);
  report.set_round(round_);
  report.set_step(static_cast<int64_t>(sum.min_step));
  report.set_step_time_s(sum.step_time_s);
  report.set_compute_time_s(sum.compute_time_s);
  report.set_step_age_s(now > sum.min_step_ns ? static_cast<double>(now - sum.min_step_ns) / 1e9 : 0);
  report.set_ckpt_saves(static_cast<int64_t>(sum.ckpt_saves));
  report.set_ckpt_stall_max_s(sum.ckpt_stall_max_s);
  report.set_ckpt_stall_sum_s(sum.ckpt_stall_sum_s);
  if (first_step_.round == round_) {
    report.set_first_step_known(true);
    report.set_first_step(static_cast<int64_t>(first_step_.step));
    report.set_first_step_age_s(static_cast<double>(now - std::min(now, first_step_.ns)) / 1e9);
  }
  if (last_timeline_.round() > 0) *report.mutable_timeline() = last_timeline_;
  for (v1::Fingerprint& f : NewFingerprints()) *report.add_fingerprints() = std::move(f);
  if (ckpt_ != nullptr) {
    for (std::string& e : ckpt_->TakeWriteErrors()) report.add_persist_errors(std::move(e));
  }
  report.set_sdc_agreed_step(static_cast<int64_t>(progress_->SdcAgreed()));
  // Best effort with a short deadline: the main loop must keep supervising.
  absl::StatusOr<v1::ProgressResponse> r = client_->ReportProgress(report, 0.5);
  if (!r.ok()) {
    spdlog::debug("progress report: {} {}", r.status().ToString(), Fmt());
    return;
  }
  progress_->SetSdcAgreed(static_cast<uint64_t>(std::max<int64_t>(0, r->sdc_agreed_step())));
}

}  // namespace ballast::agent
