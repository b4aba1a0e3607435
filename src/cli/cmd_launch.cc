// ballast launch: the local backend. Runs a whole job on this machine: a
// master (in this process, or with --journal in a child process restarted
// from its journal when it dies: cli/master_process.h) and N agents
// (`ballast run`), each agent one "node". When
// an agent dies (or the master loses or excludes it), NodeManager starts a
// replacement agent for its node rank (what relaunching a pod is on
// Kubernetes), up to --max-replacements, so a crash loop cannot spin forever.
// With --spares K, K more agents (node ranks MAX..MAX+K-1) join the first
// rendezvous and wait outside the world as hot spares, their interpreters
// warm: a lost node's place goes at once to the spare that waited longest
// (JobMaster::FormAdmissible), and the replacement the node manager starts
// for the lost node joins as the newest spare (it has the lost node's rank,
// but waits behind the spares that joined before it).
//
// Threading: everything runs on the main thread except the master's own
// threads. Agents are forked from the main thread, which lives as long as they
// do (their PR_SET_PDEATHSIG is tied to it).
#include <atomic>
#include <csignal>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/job_driver.h"
#include "master/master_server.h"
#include "scheduler/local/local_scheduler.h"
#include "scheduler/node_manager.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

}  // namespace

int LaunchCommand(const Args& args) {
  CLI::App app{"Run a job on this machine: a master and N agents, each agent one node.", "launch"};
  JobFlags f;
  int start_nodes = -1;
  int spares = 0;
  AddJobFlags(app, &f);
  app.add_option("--start-nodes,--start_nodes", start_nodes, "Agents to start (default: MAX)")->check(PositiveCount());
  app.add_option("--spares", spares,
                 "Hot spare nodes: K more agents that join and wait outside the world with warm interpreters, "
                 "taking a lost node's place at once (the lost node's replacement becomes the next spare)")
      ->check(Count())
      ->capture_default_str();
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (int rc = CheckJobFlags("launch", app, &f); rc >= 0) return rc;
  if (start_nodes < 0) start_nodes = f.range.max;
  if (start_nodes < 1 || start_nodes > f.range.max) {
    std::fprintf(stderr, "ballast launch: --start-nodes %d must be between 1 and MAX nodes (%d)\n", start_nodes,
                 f.range.max);
    return kUsageExit;
  }
  if (spares > 0 && start_nodes < f.range.max) {
    std::fprintf(stderr,
                 "ballast launch: --spares %d wait beside a full world, but --start-nodes %d starts fewer than MAX "
                 "nodes (%d), so they would train instead: drop --start-nodes, or start more nodes without "
                 "--spares\n",
                 spares, start_nodes, f.range.max);
    return kUsageExit;
  }

  std::atomic<scheduler::NodeManager*> node_manager{nullptr};
  master::MasterOptions mopts = JobMasterOptions(f, &node_manager);
  mopts.bind_host = "127.0.0.1";
  mopts.advertise_host = "127.0.0.1";
  // The spares join the first round's rendezvous (and pre-flight check).
  if (spares > 0) mopts.expected_nodes = f.range.max + spares;
  int rc = 0;
  std::unique_ptr<DrivenMaster> server = StartJobMaster("launch", f, mopts, &rc);
  if (server == nullptr) return rc;
  DrivenMaster& m = *server;
  spdlog::info("job {}: master on {}; starting {} agent(s) (nodes {}{}, {} worker(s) each); status: "
               "BALLAST_TOKEN={} ballast status --master {}",
               m.job_id(), m.address(), start_nodes + spares, f.nodes,
               spares > 0 ? absl::StrCat(" + ", spares, " spare(s)") : "", f.nproc_per_node, m.token(), m.address());

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  scheduler::LocalScheduler sched([&](const scheduler::NodeRequest& r) { return AgentCommand(f, m, r); });
  scheduler::NodeManager nodes(&sched, JobNodeManagerOptions(f, start_nodes + spares, &m));
  node_manager.store(&nodes);
  DriveOptions o;
  o.cmd = "launch";
  return DriveJob(m, sched, nodes, f, g_signal, o);
}

}  // namespace ballast::cli
