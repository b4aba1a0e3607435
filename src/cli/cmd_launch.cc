// ballast launch: the local backend. Runs a whole job on this machine: an
// in-process master and N agents (`ballast run`), each agent one "node". When
// an agent dies (or the master loses or excludes it), NodeManager starts a
// replacement agent for its node rank (what relaunching a pod is on
// Kubernetes), up to --max-replacements, so a crash loop cannot spin forever.
//
// Threading: everything runs on the main thread except the master's own
// threads. Agents are forked from the main thread, which lives as long as they
// do (their PR_SET_PDEATHSIG is tied to it).
#include <signal.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <unistd.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/http_flags.h"
#include "cli/tls_flags.h"
#include "common/chaos.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "common/tunables.h"
#include "master/goodput.h"
#include "master/master_server.h"
#include "scheduler/local/local_scheduler.h"
#include "scheduler/node_manager.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

struct LaunchFlags {
  std::string nodes = "1";
  int start_nodes = -1;
  int nproc_per_node = 1;
  int max_restarts = 3;
  int node_unit = 1;
  int max_replacements = -1;
  int port = 0;
  HttpFlags http;
  bool network_check = false;      // --network-check: pre-flight check
  bool exclude_stragglers = false;
  std::string chaos;               // --chaos SPEC (common/chaos.h)
  std::string token;
  std::string python = "python3";
  bool module = false;
  bool no_python = false;
  std::string log_dir;
  std::string tee;
  std::string redirects;
  std::string role;
  double hang_timeout_s = 0;
  int ckpt_replicas = 1;
  TlsFlags tls;
  std::vector<std::string> script_and_args;
};

// The `ballast run` command line for one agent.
std::vector<std::string> AgentArgv(const LaunchFlags& f, const std::string& endpoint, int node_rank) {
  std::vector<std::string> argv = {SelfExePath(), "run", "--rdzv-endpoint", endpoint, "--nnodes", f.nodes,
                                   "--nproc-per-node", std::to_string(f.nproc_per_node),
                                   "--node-rank", std::to_string(node_rank), "--python", f.python};
  // TLS: the agents verify the master with its CA (or its own certificate,
  // when self-signed) and present the same certificate for mutual TLS.
  if (const TlsFiles tls = f.tls.Get(); tls.on()) {
    argv.insert(argv.end(), {"--tls-ca", tls.ca.empty() ? tls.cert : tls.ca});
    if (!tls.cert.empty()) argv.insert(argv.end(), {"--tls-cert", tls.cert, "--tls-key", tls.key});
  }
  if (f.module) argv.push_back("--module");
  if (f.no_python) argv.push_back("--no-python");
  if (f.network_check) argv.push_back("--network-check");
  if (f.exclude_stragglers) argv.push_back("--exclude-stragglers");
  if (!f.log_dir.empty()) argv.insert(argv.end(), {"--log-dir", f.log_dir});
  if (!f.tee.empty()) argv.insert(argv.end(), {"--tee", f.tee});
  if (!f.redirects.empty()) argv.insert(argv.end(), {"--redirects", f.redirects});
  if (!f.role.empty()) argv.insert(argv.end(), {"--role", f.role});
  if (f.hang_timeout_s > 0) argv.insert(argv.end(), {"--hang-timeout", absl::StrCat(f.hang_timeout_s)});
  if (f.ckpt_replicas != 1) argv.insert(argv.end(), {"--ckpt-replicas", std::to_string(f.ckpt_replicas)});
  argv.insert(argv.end(), f.script_and_args.begin(), f.script_and_args.end());
  return argv;
}

}  // namespace

int LaunchCommand(const Args& args) {
  CLI::App app{"Run a job on this machine: a master and N agents, each agent one node.", "launch"};
  LaunchFlags f;
  app.add_option("--nodes,--nnodes", f.nodes, "Nodes the job runs on: N or MIN:MAX")->required();
  app.add_option("--start-nodes,--start_nodes", f.start_nodes, "Agents to start (default: MAX)");
  app.add_option("--nproc-per-node,--nproc_per_node", f.nproc_per_node, "Workers per node")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-restarts,--max_restarts", f.max_restarts, "Worker-failure restarts before the job fails")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--node-unit,--node_unit", f.node_unit, "The world's node count is a multiple of this")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-replacements,--max_replacements", f.max_replacements,
                 "Dead agents replaced before giving up (default: BALLAST_MAX_NODE_REPLACEMENTS, 3)");
  app.add_option("--port", f.port, "Master port (0: any free port)");
  f.http.Add(app);
  app.add_flag("--network-check,--network_check", f.network_check,
               "Pre-flight check before training: nodes run matmul + allreduce in pairs; faulty ones are replaced");
  app.add_flag("--exclude-stragglers,--exclude_stragglers", f.exclude_stragglers,
               "With --network-check: also replace nodes slower than 2x the median");
  app.add_option("--chaos", f.chaos,
                 absl::StrCat("Fault injection (BALLAST_CHAOS; faults hit the first agent of a node rank unless they name an incarnation): ",
                              ChaosKindsHelp()));
  app.add_option("--token", f.token, "Job token (default: $BALLAST_TOKEN, else random)");
  f.tls.Add(app, /*server=*/true);
  app.add_option("--python", f.python, "Interpreter for the workers")->capture_default_str();
  app.add_flag("-m,--module", f.module, "Run the script as a Python module (python -m)");
  app.add_flag("--no-python,--no_python", f.no_python, "Run the script as a program, not with Python");
  app.add_option("--log-dir,--log_dir", f.log_dir, "Directory for worker logs");
  app.add_option("-t,--tee", f.tee, "Tee worker output to the log files (torchrun's -t)");
  app.add_option("-r,--redirects", f.redirects, "Redirect worker output to the log files (torchrun's -r)");
  app.add_option("--role", f.role, "Worker role name");
  app.add_option("--hang-timeout,--hang_timeout", f.hang_timeout_s,
                 "Restart workers whose ballast.step() progress stops for this many seconds (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ckpt-replicas,--ckpt_replicas", f.ckpt_replicas,
                 "Copy each rank's newest flash checkpoint step to the next K nodes' memory (0: off)")
      ->check(CLI::Range(0, 8))
      ->capture_default_str();
  app.prefix_command();  // everything from the script on belongs to the script
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  f.script_and_args = app.remaining();
  if (f.script_and_args.empty()) {
    std::fprintf(stderr, "ballast launch: no training script given: ballast launch --nodes 2 --nproc-per-node 2 train.py [args]\n");
    return kUsageExit;
  }
  if (!f.script_and_args[0].empty() && f.script_and_args[0][0] == '-') {
    std::fprintf(stderr, "ballast launch: unknown flag %s; see `ballast launch --help`\n", f.script_and_args[0].c_str());
    return kUsageExit;
  }
  auto range = ParseNodeRange(f.nodes, "--nodes");
  if (!range.ok()) {
    std::fprintf(stderr, "ballast launch: %s\n", std::string(range.status().message()).c_str());
    return kUsageExit;
  }
  if (f.start_nodes < 0) f.start_nodes = range->max;
  if (f.start_nodes < 1 || f.start_nodes > range->max) {
    std::fprintf(stderr, "ballast launch: --start-nodes %d must be between 1 and MAX nodes (%d)\n", f.start_nodes,
                 range->max);
    return kUsageExit;
  }
  if (f.max_replacements < 0) f.max_replacements = Tunables::Get().max_node_replacements;
  if (auto chaos = ParseChaosSpec(f.chaos); !chaos.ok()) {
    std::fprintf(stderr, "ballast launch: --chaos: %s\n", std::string(chaos.status().message()).c_str());
    return kUsageExit;
  }

  master::MasterOptions mopts;
  mopts.bind_host = "127.0.0.1";
  mopts.advertise_host = "127.0.0.1";
  mopts.port = f.port;
  f.http.Apply(&mopts);
  mopts.tls = f.tls.Get();
  mopts.token = TokenFromFlagOrEnv(f.token);
  if (mopts.token.empty()) mopts.token = RandomHex(16);
  mopts.min_nodes = range->min;
  mopts.max_nodes = range->max;
  mopts.node_unit = f.node_unit;
  mopts.max_restarts = f.max_restarts;
  // The master tells the node manager (created once the master's address is
  // known, before any agent starts) which nodes it lost or excluded.
  std::atomic<scheduler::NodeManager*> node_manager{nullptr};
  scheduler::NodeCallbacks forward = scheduler::ForwardTo(&node_manager);
  mopts.on_node_lost = forward.lost;
  mopts.on_node_excluded = forward.excluded;
  auto server = master::MasterServer::Start(mopts);
  if (!server.ok()) {
    std::fprintf(stderr, "ballast launch: %s\n", std::string(server.status().message()).c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? kUsageExit : 1;
  }
  master::MasterServer& m = **server;
  spdlog::info("job {}: master on {}; starting {} agent(s) (nodes {}, {} worker(s) each); status: "
               "BALLAST_TOKEN={} ballast status --master {}",
               m.job_id(), m.address(), f.start_nodes, f.nodes, f.nproc_per_node, m.token(), m.address());
  if (m.http_port() > 0) spdlog::info("job {}: dashboard: {}", m.job_id(), m.dashboard_url());

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // Chaos faults hit the agent of a node rank whose incarnation they name
  // (the first by default): a replacement is a healthy node unless a fault
  // names its incarnation.
  scheduler::LocalScheduler sched([&](const scheduler::NodeRequest& r) {
    scheduler::LocalCommand cmd{AgentArgv(f, m.address(), r.node_rank), {{"BALLAST_TOKEN", m.token()}}};
    if (!f.chaos.empty()) {
      cmd.env[kChaosEnv] = f.chaos;
      cmd.env[kChaosIncarnationEnv] = std::to_string(r.incarnation);
    }
    return cmd;
  });
  scheduler::NodeManagerOptions nmo;
  nmo.initial_nodes = f.start_nodes;
  nmo.max_replacements = f.max_replacements;
  nmo.release_grace_s = Tunables::Get().stop_grace_s + 2;
  scheduler::NodeManager nodes(&sched, nmo);
  node_manager.store(&nodes);
  if (auto st = nodes.Start(); !st.ok()) {
    std::fprintf(stderr, "ballast launch: %s\n", std::string(st.message()).c_str());
    sched.StopAll(0);
    return 1;
  }

  std::optional<master::JobResult> result;
  std::string launch_failure;
  while (!result.has_value() && g_signal.load() == 0) {
    result = m.WaitForFinish(0.1);
    if (result.has_value()) break;
    nodes.Poll(/*job_finished=*/false);
    if (nodes.Exhausted()) {
      result = m.WaitForFinish(0.5);  // the last agent may have exited right after the job ended
      if (!result.has_value()) {
        launch_failure = absl::StrCat("every agent exited and --max-replacements ", f.max_replacements,
                                      " is used up; see the agents' errors above");
        break;
      }
    }
  }

  int sig = g_signal.load();
  if (sig != 0 && !result.has_value()) {
    spdlog::warn("stopped by signal {}: stopping agents and their workers", sig);
    sched.StopAll(Tunables::Get().stop_grace_s + 2);
    m.Shutdown(0);
    return 128 + sig;
  }
  // Agents exit on their own once they hear JobFinished; give them the time
  // to, then stop whatever is left.
  const double linger = Tunables::Get().finish_linger_s;
  for (int i = 0; i < static_cast<int>(linger * 20) && !sched.RunningNodes().empty(); ++i) {
    nodes.Poll(/*job_finished=*/true);
    usleep(50000);
  }
  sched.StopAll(Tunables::Get().stop_grace_s);
  // The job in one paragraph: where its wall time went, what it survived.
  const v1::JobStatus final_status = m.Status();
  spdlog::info("job {} summary: {}; {} worker restart(s), {} node replacement(s); {}", m.job_id(),
               master::FormatGoodput(final_status.goodput()), final_status.restart_count(), nodes.replacements(),
               master::FormatFailures(final_status));
  m.Shutdown(0);
  if (!launch_failure.empty()) {
    std::fprintf(stderr, "ballast launch: job %s failed: %s\n", m.job_id().c_str(), launch_failure.c_str());
    return 1;
  }
  if (result->succeeded) {
    spdlog::info("job {} succeeded: {} worker restart(s), {} node replacement(s)", m.job_id(), result->restart_count,
                 nodes.replacements());
    return 0;
  }
  std::fprintf(stderr, "ballast launch: job %s failed: %s\n", m.job_id().c_str(), result->message.c_str());
  return 1;
}

}  // namespace ballast::cli
