#include "cli/job_driver.h"

#include <algorithm>

#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "common/chaos.h"
#include "common/module_list.h"
#include "common/net.h"
#include "common/save_every.h"
#include "common/subprocess.h"
#include "common/tunables.h"
#include "master/goodput.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {

void AddJobFlags(CLI::App& app, JobFlags* f) {
  app.add_option("--nodes,--nnodes", f->nodes, "Nodes the job trains on: N or MIN:MAX")->required();
  app.add_option("--nproc-per-node,--nproc_per_node", f->nproc_per_node, "Workers per node")
      ->check(PositiveCount());
  app.add_option("--max-restarts,--max_restarts", f->max_restarts, "Worker-failure restarts before the job fails")
      ->check(Count())
      ->capture_default_str();
  app.add_option("--node-unit,--node_unit", f->node_unit, "The world's node count is a multiple of this")
      ->check(PositiveCount());
  app.add_option("--max-replacements,--max_replacements", f->max_replacements,
                 "Lost nodes replaced before giving up (default: BALLAST_MAX_NODE_REPLACEMENTS, 3)")
      ->check(Count());
  app.add_option("--port", f->port, "Master port (0: any free port)")->check(Port());
  f->http.Add(app);
  f->health.Add(app);
  app.add_flag("--network-check,--network_check", f->network_check,
               "Pre-flight check before training: nodes run matmul + allreduce in pairs; faulty ones are replaced");
  app.add_flag("--exclude-stragglers,--exclude_stragglers", f->exclude_stragglers,
               "Replace stragglers: nodes slower than BALLAST_STRAGGLER_FACTOR (2) x the median, in the pre-flight "
               "check (--network-check) or at runtime for 3 s in a row (their compute time per forward pass, from "
               "ballast.step(step, model=))");
  app.add_option("--chaos", f->chaos,
                 absl::StrCat("Fault injection (BALLAST_CHAOS; faults hit the first agent of a node rank unless they "
                              "name an incarnation): ",
                              ChaosKindsHelp()));
  app.add_option("--token", f->token, "Job token (default: $BALLAST_TOKEN, else random)");
  app.add_option("--journal", f->journal,
                 "Run the job's master in a child process with its journal in this directory: a master that dies "
                 "is restarted from the journal and the agents keep training (default: the master runs in this "
                 "process, without a journal)");
  f->tls.Add(app, /*server=*/true);
  app.add_option("--python", f->python, "Interpreter for the workers")->capture_default_str();
  app.add_flag("-m,--module", f->module, "Run the script as a Python module (python -m)");
  app.add_flag("--no-python,--no_python", f->no_python, "Run the script as a program, not with Python");
  app.add_option("--log-dir,--log_dir", f->log_dir, "Directory for worker logs");
  app.add_option("-t,--tee", f->tee, "Tee worker output to the log files (torchrun's -t)");
  app.add_option("-r,--redirects", f->redirects, "Redirect worker output to the log files (torchrun's -r)");
  app.add_option("--role", f->role, "Worker role name");
  app.add_option("--hang-timeout,--hang_timeout", f->hang_timeout_s,
                 "Restart workers whose ballast.step() progress stops for this many seconds (0: off)")
      ->check(Seconds());
  app.add_option("--save-every,--save_every", f->save_every,
                 "Which Checkpointer.save calls copy: every Nth step, or auto: the interval that loses the least "
                 "training time, from the measured save cost, step time and failure rate (auto:MAX: at most MAX "
                 "steps; default 1000) (default: the script's, else every call)");
  app.add_option("--mtbf", f->mtbf,
                 "--save-every auto's prior for the job's mean time between failures, e.g. 6h (weighs as one "
                 "failure; default 1h)");
  app.add_option("--ckpt-replicas,--ckpt_replicas", f->ckpt_replicas,
                 "Copy each rank's newest flash checkpoint step to the next K nodes' memory (0: off)")
      ->check(IntegerIn(0, 8, "a count from 0 to 8 (0: off)", "0..8"))
      ->capture_default_str();
  app.add_option("--ckpt-copy-nice,--ckpt_copy_nice", f->ckpt_copy_nice,
                 "Nice value of the threads that persist checkpoints and copy replicas (and of their disk I/O): they "
                 "yield the cores training needs (0: training's priority)")
      ->check(IntegerIn(0, 19, "a nice value from 0 to 19 (0: the copies run at training's priority)", "0..19"))
      ->capture_default_str();
  app.add_option("--ckpt-copy-share,--ckpt_copy_share", f->ckpt_copy_share,
                 "The share of the time the writes of persist=True checkpoint steps may take: when a write takes "
                 "longer, only the first such step of every k steps is written (default 0.25; 1: every step asked "
                 "for)")
      ->check(Fraction("a share of the time"));
  app.add_flag("--no-warm-restart,--no_warm_restart", f->no_warm_restart,
               "Start every worker in a new interpreter (default: a warm one per local rank waits, torch and what "
               "the last workers imported already loaded)");
  app.add_flag("--no-warm-fork,--no_warm_fork", f->no_warm_fork,
               "Hand the warm interpreter itself to a worker (default: it forks a copy with what it imported for "
               "each (re)start and stays)");
  app.add_option("--warm-modules,--warm_modules", f->warm_modules,
                 "Modules warm interpreters import besides torch, e.g. transformers,numpy");
  app.prefix_command();  // everything from the script on belongs to the script
}

int CheckJobFlags(const char* cmd, const CLI::App& app, JobFlags* f) {
  f->script_and_args = app.remaining();
  if (f->script_and_args.empty()) {
    std::fprintf(stderr, "ballast %s: no training script given: ballast %s --nodes 2 --nproc-per-node 2 train.py [args]\n",
                 cmd, cmd);
    return kUsageExit;
  }
  if (!f->script_and_args[0].empty() && f->script_and_args[0][0] == '-') {
    std::fprintf(stderr, "ballast %s: unknown flag %s; see `ballast %s --help`\n", cmd, f->script_and_args[0].c_str(),
                 cmd);
    return kUsageExit;
  }
  auto range = ParseNodeRange(f->nodes, "--nodes");
  if (!range.ok()) {
    std::fprintf(stderr, "ballast %s: %s\n", cmd, std::string(range.status().message()).c_str());
    return kUsageExit;
  }
  f->range = *range;
  if (f->max_replacements < 0) f->max_replacements = Tunables::Get().max_node_replacements;
  if (auto chaos = ParseChaosSpec(f->chaos); !chaos.ok()) {
    std::fprintf(stderr, "ballast %s: --chaos: %s\n", cmd, std::string(chaos.status().message()).c_str());
    return kUsageExit;
  } else if (std::string(cmd) == "launch" &&
             std::any_of(chaos->faults.begin(), chaos->faults.end(),
                         [](const ChaosFault& x) { return x.kind == "partition"; })) {
    std::fprintf(stderr,
                 "ballast launch: --chaos partition cuts a node's own network interface, and `ballast launch` runs "
                 "every node on this machine's loopback: run the nodes with `ballast run` on separate hosts or in "
                 "network namespaces (BALLAST_CHAOS=partition:...)\n");
    return kUsageExit;
  } else if (!chaos->All("kill-master").empty() && f->journal.empty() && !f->master_journaled) {
    std::fprintf(stderr,
                 "ballast %s: --chaos kill-master needs --journal DIR: without a journal the master runs in this "
                 "process, and killing it ends the job\n",
                 cmd);
    return kUsageExit;
  }
  if (auto modules = ParseModuleList(f->warm_modules); !modules.ok()) {
    std::fprintf(stderr, "ballast %s: --warm-modules: %s\n", cmd, std::string(modules.status().message()).c_str());
    return kUsageExit;
  }
  if (!f->save_every.empty()) {
    if (absl::Status s = ValidateSaveEvery(f->save_every, "--save-every"); !s.ok()) {
      std::fprintf(stderr, "ballast %s: %s\n", cmd, std::string(s.message()).c_str());
      return kUsageExit;
    }
  }
  if (!f->mtbf.empty()) {
    if (auto d = ParseDurationSeconds(f->mtbf, "--mtbf"); !d.ok()) {
      std::fprintf(stderr, "ballast %s: %s\n", cmd, std::string(d.status().message()).c_str());
      return kUsageExit;
    }
  }
  if (auto health = f->health.Get(); !health.ok()) {
    std::fprintf(stderr, "ballast %s: %s\n", cmd, std::string(health.status().message()).c_str());
    return kUsageExit;
  }
  return -1;
}

std::vector<std::string> AgentArgv(const JobFlags& f, const std::string& master_endpoint, int node_rank) {
  std::vector<std::string> argv = {SelfExePath(), "run", "--rdzv-endpoint", master_endpoint, "--nnodes", f.nodes,
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
  if (f.ckpt_copy_nice != kDefaultCopyNice) {
    argv.insert(argv.end(), {"--ckpt-copy-nice", std::to_string(f.ckpt_copy_nice)});
  }
  if (f.ckpt_copy_share > 0) argv.insert(argv.end(), {"--ckpt-copy-share", absl::StrCat(f.ckpt_copy_share)});
  if (!f.save_every.empty()) argv.insert(argv.end(), {"--save-every", f.save_every});
  if (!f.mtbf.empty()) argv.insert(argv.end(), {"--mtbf", f.mtbf});
  if (f.no_warm_restart) argv.push_back("--no-warm-restart");
  if (f.no_warm_fork) argv.push_back("--no-warm-fork");
  if (!f.warm_modules.empty()) argv.insert(argv.end(), {"--warm-modules", f.warm_modules});
  argv.insert(argv.end(), f.script_and_args.begin(), f.script_and_args.end());
  return argv;
}

scheduler::LocalCommand AgentCommand(const JobFlags& f, const DrivenMaster& m, const scheduler::NodeRequest& r) {
  scheduler::LocalCommand cmd{AgentArgv(f, m.address(), r.node_rank), {{"BALLAST_TOKEN", m.token()}}};
  // Chaos faults hit the agent of a node rank whose incarnation they name
  // (the first by default): a replacement is a healthy node unless a fault
  // names its incarnation.
  if (!f.chaos.empty()) {
    cmd.env[kChaosEnv] = f.chaos;
    cmd.env[kChaosIncarnationEnv] = std::to_string(r.incarnation);
  }
  return cmd;
}

master::MasterOptions JobMasterOptions(const JobFlags& f, std::atomic<scheduler::NodeManager*>* node_manager) {
  master::MasterOptions mopts;
  mopts.port = f.port;
  f.http.Apply(&mopts);
  mopts.tls = f.tls.Get();
  mopts.token = TokenFromFlagOrEnv(f.token);
  if (mopts.token.empty()) mopts.token = RandomHex(16);
  mopts.min_nodes = f.range.min;
  mopts.max_nodes = f.range.max;
  mopts.node_unit = f.node_unit;
  mopts.max_restarts = f.max_restarts;
  mopts.health = *f.health.Get();  // checked by CheckJobFlags
  // The master tells the node manager (created once the master's address is
  // known, before any agent starts) which nodes it lost or excluded.
  scheduler::NodeCallbacks forward = scheduler::ForwardTo(node_manager);
  mopts.on_node_lost = forward.lost;
  mopts.on_node_excluded = forward.excluded;
  mopts.on_node_disconnected = forward.disconnected;
  return mopts;
}

scheduler::NodeManagerOptions JobNodeManagerOptions(const JobFlags& f, int initial_nodes, DrivenMaster* m) {
  scheduler::NodeManagerOptions nmo;
  nmo.initial_nodes = initial_nodes;
  nmo.max_replacements = f.max_replacements;
  nmo.release_grace_s = Tunables::Get().stop_grace_s + 2;
  nmo.on_scheduler_lost = [m](const std::string& node_id, const std::string& reason) { m->NodeLost(node_id, reason); };
  return nmo;
}

std::unique_ptr<DrivenMaster> StartJobMaster(const char* cmd, const JobFlags& f, const master::MasterOptions& options,
                                             int* exit_code, std::unique_ptr<MasterHost> host,
                                             const std::string& journal_dir) {
  if (!f.journal.empty() || host != nullptr) {
    MasterProcessOptions po;
    po.master = options;
    po.journal_dir = host != nullptr ? journal_dir : f.journal;
    po.host = std::move(host);
    po.http_port_given = f.http.port != -2;
    po.cmd = cmd;
    if (auto chaos = ParseChaosSpec(f.chaos); chaos.ok() && !chaos->All("kill-master").empty()) {
      po.kill_master = *chaos->All("kill-master")[0];
    }
    auto p = MasterProcess::Start(std::move(po));
    if (!p.ok()) {
      std::fprintf(stderr, "ballast %s: %s\n", cmd, std::string(p.status().message()).c_str());
      *exit_code = p.status().code() == absl::StatusCode::kInvalidArgument ? kUsageExit : 1;
      return nullptr;
    }
    return std::move(*p);
  }
  auto server = master::MasterServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "ballast %s: %s\n", cmd, std::string(server.status().message()).c_str());
    *exit_code = server.status().code() == absl::StatusCode::kInvalidArgument ? kUsageExit : 1;
    return nullptr;
  }
  master::MasterServer& m = **server;
  if (m.http_port() > 0) spdlog::info("job {}: dashboard: {}", m.job_id(), m.dashboard_url());
  return std::make_unique<InProcessMaster>(std::move(*server));
}

int DriveJob(DrivenMaster& m, scheduler::SchedulerInterface& sched, scheduler::NodeManager& nodes,
             const JobFlags& f, const std::atomic<int>& signal, const DriveOptions& o) {
  if (absl::Status st = nodes.Start(); !st.ok()) {
    std::fprintf(stderr, "ballast %s: %s\n", o.cmd, std::string(st.message()).c_str());
    sched.StopAll(0);
    m.Shutdown(0);
    return 1;
  }
  std::optional<master::JobResult> result;
  std::string failure;
  while (!result.has_value() && signal.load() == 0) {
    result = m.WaitForFinish(0.1);
    if (result.has_value()) break;
    if (absl::Status s = m.Poll(nodes); !s.ok()) {
      failure = std::string(s.message());
      break;
    }
    nodes.Poll(/*job_finished=*/false);
    if (o.each_turn) o.each_turn();
    if (nodes.Exhausted()) {
      result = m.WaitForFinish(0.5);  // the last agent may have exited right after the job ended
      if (!result.has_value()) {
        failure = absl::StrCat("every agent exited and --max-replacements ", f.max_replacements,
                               " is used up (or no node is left to start one on); see the agents' errors above");
        break;
      }
    }
  }

  const int sig = signal.load();
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
  if (!f.chaos.empty()) {
    std::string report = master::FormatChaosReport(f.chaos, final_status);
    if (m.master_restarts() > 0) {
      absl::StrAppend(&report, "\n  the master process died ", m.master_restarts(),
                      " time(s) and was restarted from its journal (worker restarts in the whole job: ",
                      final_status.restart_count(), ")");
    }
    spdlog::info("{}", report);
  }
  m.Shutdown(0);
  if (!failure.empty()) {
    std::fprintf(stderr, "ballast %s: job %s failed: %s\n", o.cmd, m.job_id().c_str(), failure.c_str());
    return 1;
  }
  if (result->succeeded) {
    spdlog::info("job {} succeeded: {} worker restart(s), {} node replacement(s)", m.job_id(), result->restart_count,
                 nodes.replacements());
    return 0;
  }
  std::fprintf(stderr, "ballast %s: job %s failed: %s\n", o.cmd, m.job_id().c_str(), result->message.c_str());
  return 1;
}

}  // namespace ballast::cli
