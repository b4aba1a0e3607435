// ballast ray run: the Ray backend. The job's driver on a running Ray cluster
// (RAY_ADDRESS, --address, or the cluster this node belongs to): what users
// put after `ray job submit --working-dir . --` or in a KubeRay RayJob's
// entrypoint. It runs NodeManager, as `ballast launch` does, and the master:
// by default (--master-on head) `ballast master --journal` in a Ray actor on
// the head that Ray restarts there when it dies (RayMasterHost below), which
// the driver follows as it follows a --journal master process; with
// --master-on driver in this process (with --journal in a child process
// restarted from its journal). The nodes are agent actors, one per Ray node,
// placed and watched through the Ray bridge (scheduler/ray/ray_scheduler.h). Nodes beyond
// --nodes MAX are hot spares, as with `ballast launch` and `ballast slurm`. A
// lost node's replacement goes to another free Ray node, or waits for one
// (an autoscaled or recreated node) while the job goes on with >= MIN nodes.
//
// Threading: the main thread drives the master, the node manager and the
// bridge (which dies with it: PR_SET_PDEATHSIG).
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/job_driver.h"
#include "common/subprocess.h"
#include "common/net.h"
#include "common/tunables.h"
#include "master/master_server.h"
#include "nlohmann/json.hpp"
#include "scheduler/node_manager.h"
#include "scheduler/ray/ray_scheduler.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

// Runs python/ballast/_ray_bridge.py of the interpreter's `ballast` package
// as a script (not imported: `import ballast` imports torch), or the file
// BALLAST_RAY_BRIDGE names.
std::vector<std::string> BridgeArgv(const std::string& python) {
  if (const char* path = std::getenv("BALLAST_RAY_BRIDGE"); path != nullptr && *path != '\0') {
    return {python, path};
  }
  return {python, "-c",
          "import importlib.util, os, runpy, sys\n"
          "spec = importlib.util.find_spec('ballast')\n"
          "if spec is None:\n"
          "    sys.exit('ballast ray: the ballast package is not installed for ' + sys.executable + "
          "': pip install ballast[ray] there, or point --bridge-python at the interpreter that has it')\n"
          "runpy.run_path(os.path.join(list(spec.submodule_search_locations)[0], '_ray_bridge.py'), "
          "run_name='__main__')\n"};
}

// The master as a Ray actor: `ballast master --journal` in an actor that the
// bridge pins to one Ray node and Ray restarts there when it dies (or when
// its master process dies of a signal); every incarnation serves the same
// port. MasterProcess drives it as it drives a local child process.
class RayMasterHost : public MasterHost {
 public:
  using Spec = scheduler::ray::MasterActorSpec;
  using Event = scheduler::ray::MasterActorEvent;

  RayMasterHost(scheduler::ray::RayScheduler* ray, Spec spec, double start_timeout_s)
      : ray_(ray), spec_(std::move(spec)), start_timeout_s_(start_timeout_s) {}

  absl::StatusOr<Endpoint> Start(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                                 bool restart) override {
    if (!lost_.empty()) return absl::UnavailableError(absl::StrCat("the master's Ray actor is gone: ", lost_));
    if (!restart) {
      spec_.argv = argv;
      spec_.env = env;
      if (absl::Status s = ray_->StartMaster(spec_); !s.ok()) return s;
    }
    // The first incarnation, or the one Ray restarted.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                 std::chrono::duration<double>(start_timeout_s_));
    while (std::chrono::steady_clock::now() < deadline) {
      Read(0.2);
      while (!queue_.empty()) {
        Event e = std::move(queue_.front());
        queue_.pop_front();
        if (e.kind == Event::Kind::kStarted && e.incarnation > incarnation_) {
          incarnation_ = e.incarnation;
          where_ = absl::StrCat("pid ", e.pid, " in a Ray actor on ", e.host);
          ended_.reset();
          return Endpoint{spec_.advertise_host.empty() ? e.ip : spec_.advertise_host, e.port};
        }
        if (e.kind == Event::Kind::kLost) {
          lost_ = e.reason;
          return absl::UnavailableError(absl::StrCat(
              incarnation_ == 0 ? "cannot start the master's Ray actor: " : "the master's Ray actor is gone: ",
              e.reason));
        }
        if (e.kind == Event::Kind::kExited) {
          return absl::FailedPreconditionError(absl::StrCat("the master process exited (", e.status.Describe(),
                                                            ") before it served the job; see its error above"));
        }
      }
      if (ray_->closed()) return absl::UnavailableError("the Ray bridge ended; see its message above");
    }
    return absl::DeadlineExceededError(absl::StrFormat(
        "the master's Ray actor did not %s within %.0f s: is Ray node '%s' alive, with ballast installed at the "
        "driver's path or on PATH?",
        restart ? "come back" : "start", start_timeout_s_, spec_.node));
  }

  std::optional<ExitStatus> Poll() override {
    if (ended_.has_value()) return ended_;
    Read(0);
    // Up to the first end: what follows it (Ray's restart) is the next Start's.
    while (!queue_.empty() && !ended_.has_value()) {
      Event e = std::move(queue_.front());
      queue_.pop_front();
      if (e.kind == Event::Kind::kExited) {
        ended_ = e.status;
      } else if (e.kind == Event::Kind::kDied || e.kind == Event::Kind::kLost) {
        spdlog::warn("ray run: the master ({}) died: {}", where_, e.reason);
        if (e.kind == Event::Kind::kLost) lost_ = e.reason;
        ended_ = ExitStatus{0, SIGKILL};  // as a crash: MasterProcess restarts it (Ray already did)
      }
    }
    if (!ended_.has_value() && ray_->closed()) {
      lost_ = "the Ray bridge ended";
      ended_ = ExitStatus{0, SIGKILL};
    }
    return ended_;
  }

  void Stop(double grace_s) override {
    if (!ray_->StopMaster(grace_s).ok()) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                 std::chrono::duration<double>(grace_s + 10));
    while (std::chrono::steady_clock::now() < deadline && !ray_->closed()) {
      for (const Event& e : ray_->MasterEvents(0.2)) {
        if (e.kind == Event::Kind::kStopped || e.kind == Event::Kind::kLost) return;
      }
    }
    spdlog::warn("ray run: the bridge did not confirm that the master's actor stopped");
  }

  void Kill() override { (void)ray_->KillMaster(); }
  std::string Where() const override { return where_; }

 private:
  void Read(double timeout_s) {
    for (Event& e : ray_->MasterEvents(timeout_s)) queue_.push_back(std::move(e));
  }

  scheduler::ray::RayScheduler* ray_;
  Spec spec_;
  const double start_timeout_s_;
  int incarnation_ = 0;
  std::string where_ = "in a Ray actor";
  std::deque<Event> queue_;
  std::optional<ExitStatus> ended_;
  std::string lost_;
};

int RayRun(const Args& args) {
  CLI::App app{"Run a job on a Ray cluster: a master actor on the head and one agent actor per Ray node; nodes "
               "beyond --nodes MAX are hot spares, a lost node is replaced on another free Ray node.",
               "ray run"};
  JobFlags f;
  int spares = 0;
  std::string address;
  double cpus_per_node = 1;
  double gpus_per_node = 0;
  std::string ray_resources;
  std::string bridge_python;
  std::string advertise_host;
  std::string master_on = "head";
  AddJobFlags(app, &f);
  app.add_option("--spares", spares,
                 "Hot spare nodes: agents on K more Ray nodes that join and wait outside the world, taking a lost "
                 "node's place at once")
      ->check(Count())
      ->capture_default_str();
  app.add_option("--address", address, "The Ray cluster (default: $RAY_ADDRESS, else the cluster of this node)");
  app.add_option("--cpus-per-node,--cpus_per_node", cpus_per_node,
                 "CPUs each agent actor takes on its Ray node (the node must have them free)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--gpus-per-node,--gpus_per_node", gpus_per_node,
                 "GPUs each agent actor takes on its Ray node: give the node's GPU count, so no other job's actor "
                 "lands there")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--ray-resources,--ray_resources", ray_resources,
                 "Custom Ray resources each agent actor takes, as JSON: '{\"trainer\": 1}' (nodes started with "
                 "`ray start --resources`)");
  app.add_option("--bridge-python,--bridge_python", bridge_python,
                 "Interpreter with Ray and Ballast installed that talks to the cluster (default: $BALLAST_PYTHON, "
                 "which the pip-installed `ballast` command sets, else --python)");
  app.add_option("--advertise-host,--advertise_host", advertise_host,
                 "Address the agents reach the master at (default: its Ray node's address)");
  app.add_option("--master-on,--master_on", master_on,
                 "Where the master runs: 'head' (a Ray actor on the head node that Ray restarts there, with its "
                 "journal in --journal DIR on that node, default a temporary directory), a Ray node's IP or id "
                 "(the same, on that node), or 'driver' (in this process; with --journal DIR in a child process "
                 "restarted from it)")
      ->capture_default_str();
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  f.master_journaled = master_on != "driver";
  if (int rc = CheckJobFlags("ray run", app, &f); rc >= 0) return rc;
  nlohmann::json resources = nlohmann::json::object();
  if (!ray_resources.empty()) {
    resources = nlohmann::json::parse(ray_resources, nullptr, /*allow_exceptions=*/false);
    bool ok = resources.is_object();
    for (auto it = resources.begin(); ok && it != resources.end(); ++it) ok = it->is_number() && it->get<double>() >= 0;
    if (!ok) {
      std::fprintf(stderr, "ballast ray run: --ray-resources '%s' is not a JSON object of resource names to "
                           "non-negative amounts, e.g. '{\"trainer\": 1}'\n", ray_resources.c_str());
      return kUsageExit;
    }
  }
  if (bridge_python.empty()) {
    const char* env = std::getenv("BALLAST_PYTHON");
    bridge_python = env != nullptr && *env != '\0' ? env : f.python;
  }

  // The master's address comes from the bridge (this node's Ray address), so
  // the bridge starts first; the agents' command needs the master, set below
  // before any launch.
  std::unique_ptr<DrivenMaster> server;
  scheduler::ray::RaySchedulerOptions ro;
  ro.bridge_argv = BridgeArgv(bridge_python);
  ro.bridge_env = CurrentEnvironment();
  // Every agent's and rank's line reaches this driver's log (`ray job logs`), not "[repeated 2x across cluster]".
  ro.bridge_env.emplace("RAY_DEDUP_LOGS", "0");
  ro.bridge_env["BALLAST_RAY_OPTIONS"] = nlohmann::json{{"address", address},
                                                        {"cpus", cpus_per_node},
                                                        {"gpus", gpus_per_node},
                                                        {"resources", resources},
                                                        {"pending_s", Tunables::Get().ray_pending_s}}
                                             .dump();
  ro.command_for = [&](const scheduler::NodeRequest& r) { return AgentCommand(f, *server, r); };
  spdlog::info("ray: connecting to the Ray cluster ({})", address.empty() ? "RAY_ADDRESS, else this node's" : address);
  auto sched = scheduler::ray::RayScheduler::Start(ro);
  if (!sched.ok()) {
    std::fprintf(stderr, "ballast ray run: %s\n", std::string(sched.status().message()).c_str());
    return 1;
  }
  std::atomic<scheduler::NodeManager*> node_manager{nullptr};
  master::MasterOptions mopts = JobMasterOptions(f, &node_manager);
  mopts.bind_host = "0.0.0.0";
  mopts.advertise_host = advertise_host.empty() ? (*sched)->driver_ip() : advertise_host;
  mopts.expected_nodes = f.range.max + spares;  // the spares join the first round's rendezvous
  int rc = 0;
  if (master_on == "driver") {
    server = StartJobMaster("ray run", f, mopts, &rc);
  } else {
    // The master actor: its journal on its node, named by the job id (so known before it starts).
    if (mopts.job_id.empty()) mopts.job_id = absl::StrCat("ballast-", RandomHex(6));
    scheduler::ray::MasterActorSpec spec;
    spec.node = master_on;
    spec.advertise_host = advertise_host;
    spec.journal = f.journal;
    if (spec.journal.empty()) {
      spec.journal = absl::StrCat("/tmp/", mopts.job_id, ".journal");
      spec.cleanup = true;
    }
    const std::string journal = spec.journal;
    spdlog::info("ray: the master runs as a Ray actor on {} (its journal: {} there)",
                 master_on == "head" ? std::string("the head node") : absl::StrCat("Ray node ", master_on), journal);
    server = StartJobMaster("ray run", f, mopts, &rc,
                            std::make_unique<RayMasterHost>(sched->get(), std::move(spec),
                                                            Tunables::Get().ray_master_start_s),
                            journal);
  }
  if (server == nullptr) return rc;
  DrivenMaster& m = *server;
  spdlog::info("job {}: master on {} ({}); {} agent actor(s): nodes {}{}, {} worker(s) each; status: "
               "BALLAST_TOKEN={} ballast status --master {}",
               m.job_id(), m.address(), (*sched)->cluster(), f.range.max + spares, f.nodes,
               spares > 0 ? absl::StrCat(" + ", spares, " spare(s)") : "", f.nproc_per_node, m.token(), m.address());

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  scheduler::NodeManagerOptions nmo = JobNodeManagerOptions(f, f.range.max + spares, &m);
  // An agent killed with everything on its node (a pod or container deleted)
  // closes its stream at once; Ray's death notice takes its health checks
  // (seconds by default) and the master's reconnect grace is 1 s. The
  // replacement's placement, agent and interpreters start at the close.
  nmo.early_replacement = true;
  scheduler::NodeManager nodes(sched->get(), nmo);
  node_manager.store(&nodes);
  DriveOptions o;
  o.cmd = "ray run";
  rc = DriveJob(m, **sched, nodes, f, g_signal, o);
  server.reset();  // a master actor is stopped through the bridge, which goes with sched
  return rc;
}

}  // namespace

int RayCommand(const Args& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::fputs("usage: ballast ray run [options] SCRIPT [args]\n"
               "\n"
               "  run   run a job on a Ray cluster: a master actor on the head, one agent actor per Ray node\n"
               "\n"
               "`ballast ray run --help` describes its options.\n",
               args.empty() ? stderr : stdout);
    return args.empty() ? kUsageExit : 0;
  }
  if (args[0] == "run") return RayRun(Args(args.begin() + 1, args.end()));
  std::fprintf(stderr, "ballast ray: unknown command '%s' (try `ballast ray run --help`)\n", args[0].c_str());
  return kUsageExit;
}

}  // namespace ballast::cli
