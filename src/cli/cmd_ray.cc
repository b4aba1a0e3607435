// ballast ray run: the Ray backend. The job's driver on a running Ray cluster
// (RAY_ADDRESS, --address, or the cluster this node belongs to): what users
// put after `ray job submit --working-dir . --` or in a KubeRay RayJob's
// entrypoint. It runs the master (in this process, or with --journal in a
// child process restarted from its journal) and NodeManager, as `ballast
// launch` does; the nodes are agent actors, one per Ray node, placed and
// watched through the Ray bridge (scheduler/ray/ray_scheduler.h). Nodes beyond
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

#include "absl/strings/str_cat.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/job_driver.h"
#include "common/subprocess.h"
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

int RayRun(const Args& args) {
  CLI::App app{"Run a job on a Ray cluster: a master here and one agent actor per Ray node; nodes beyond --nodes "
               "MAX are hot spares, a lost node is replaced on another free Ray node.",
               "ray run"};
  JobFlags f;
  int spares = 0;
  std::string address;
  double cpus_per_node = 1;
  double gpus_per_node = 0;
  std::string ray_resources;
  std::string bridge_python;
  std::string advertise_host;
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
                 "Address the agents reach the master at (default: this node's Ray address)");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
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
  if (advertise_host.empty()) advertise_host = (*sched)->driver_ip();

  std::atomic<scheduler::NodeManager*> node_manager{nullptr};
  master::MasterOptions mopts = JobMasterOptions(f, &node_manager);
  mopts.bind_host = "0.0.0.0";
  mopts.advertise_host = advertise_host;
  mopts.expected_nodes = f.range.max + spares;  // the spares join the first round's rendezvous
  int rc = 0;
  server = StartJobMaster("ray run", f, mopts, &rc);
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
  return DriveJob(m, **sched, nodes, f, g_signal, o);
}

}  // namespace

int RayCommand(const Args& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::fputs("usage: ballast ray run [options] SCRIPT [args]\n"
               "\n"
               "  run   run a job on a Ray cluster: a master here, one agent actor per Ray node\n"
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
