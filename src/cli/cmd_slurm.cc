// ballast slurm: the Slurm backend. Run from a batch script (or salloc) on
// the allocation's batch host: an in-process master, and one agent per node
// as its own job step (scheduler/slurm/slurm_scheduler.h). Nodes beyond
// --nodes MAX are hot spares: their agents join and wait outside the world
// (pre-checked with --network-check), so a lost node's place is taken at
// heartbeat speed, without waiting for Slurm. Allocation nodes beyond MAX +
// --spares take replacements. A lost node is never used again in the job.
//
// Threading: the main thread drives the master's node manager and the steps
// (their srun processes die with it).
#include <atomic>
#include <csignal>
#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/job_driver.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "common/tunables.h"
#include "master/master_server.h"
#include "scheduler/node_manager.h"
#include "scheduler/slurm/slurm_scheduler.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

// The address the other allocation nodes reach this one at: the route's
// source address toward another node (a numeric address: nothing needs DNS),
// else what this node's name resolves to, else loopback for a one-node job.
absl::StatusOr<std::string> AdvertiseAddress(const scheduler::slurm::SlurmAllocation& a) {
  for (const std::string& node : a.nodes) {
    if (node == a.batch_host) continue;
    if (auto addr = LocalAddressToward(node); addr.ok() && !IsLoopbackHost(*addr)) return *addr;
  }
  const std::string self = a.batch_host.empty() ? HostName() : a.batch_host;
  if (auto addrs = ResolveNumeric(self); addrs.ok()) {
    for (const std::string& addr : *addrs) {
      if (!IsLoopbackHost(addr)) return addr;
    }
  }
  if (a.nodes.size() == 1) return std::string("127.0.0.1");
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot find an address of this node (", self, ") that the other nodes of ", a.Describe(),
      " reach: none of their names resolves here; give one with --advertise-host ADDR"));
}

// With --drain-bad-nodes, drains in Slurm each node NodeManager newly marked
// bad (excluded by the pre-flight check); says so when Slurm refuses, and
// when the flag is off. *seen: the nodes handled already.
void DrainBadNodes(scheduler::slurm::SlurmScheduler& sched, const std::set<std::string>& bad, bool enabled,
                   const std::string& job_id, std::set<std::string>* seen) {
  for (const std::string& node : bad) {
    if (!seen->insert(node).second) continue;
    if (!enabled) {
      spdlog::info("slurm: node {} is not drained in Slurm (give --drain-bad-nodes to drain nodes that fail the "
                   "pre-flight check)",
                   node);
      continue;
    }
    const std::string reason = absl::StrCat("ballast job ", job_id, ": failed the pre-flight check");
    if (absl::Status s = sched.Drain(node, reason); s.ok()) {
      spdlog::warn("slurm: drained node {} in Slurm (reason \"{}\"); `scontrol update nodename={} state=resume` "
                   "returns it",
                   node, reason, node);
    } else if (absl::IsPermissionDenied(s)) {
      spdlog::warn("slurm: --drain-bad-nodes: not permitted to drain node {}: {}", node, std::string(s.message()));
    } else {
      spdlog::warn("slurm: --drain-bad-nodes: cannot drain node {}: {}", node, std::string(s.message()));
    }
  }
}

}  // namespace

int SlurmCommand(const Args& args) {
  CLI::App app{"Run a job inside a Slurm allocation: a master on the batch host and one agent step per node; "
               "nodes beyond --nodes MAX are hot spares.",
               "slurm"};
  JobFlags f;
  int spares = 0;
  bool drain_bad_nodes = false;
  std::string advertise_host;
  std::vector<std::string> srun_args;
  AddJobFlags(app, &f);
  app.add_option("--spares", spares,
                 "Hot spare nodes: agents that join and wait outside the world, taking a lost node's place at once "
                 "(the allocation needs MAX + SPARES nodes; more are used for replacements)")
      ->check(Count())
      ->capture_default_str();
  app.add_flag("--drain-bad-nodes,--drain_bad_nodes", drain_bad_nodes,
               "Drain nodes that fail the pre-flight check (or are stragglers with --exclude-stragglers) in Slurm: "
               "scontrol update state=drain, when Slurm permits this user");
  app.add_option("--advertise-host,--advertise_host", advertise_host,
                 "Address agents reach the master at (default: this node's address toward the other nodes)");
  app.add_option("--srun-arg,--srun_arg", srun_args,
                 "An extra option for each agent step's srun, e.g. --srun-arg=--gpus-per-node=8 (repeatable)");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (int rc = CheckJobFlags("slurm", app, &f); rc >= 0) return rc;

  scheduler::slurm::SlurmTools tools;
  tools.timeout_s = Tunables::Get().slurm_command_timeout_s;
  auto alloc = scheduler::slurm::ReadAllocation(CurrentEnvironment(), tools);
  if (!alloc.ok()) {
    std::fprintf(stderr, "ballast slurm: %s\n", std::string(alloc.status().message()).c_str());
    return kUsageExit;
  }
  const int needed = f.range.max + spares;
  if (static_cast<int>(alloc->nodes.size()) < needed) {
    std::fprintf(stderr,
                 "ballast slurm: --nodes %s%s needs %d nodes, but %s has %zu (SLURM_JOB_NUM_NODES): submit with "
                 "`sbatch -N %d --no-kill`, or lower --nodes MAX or --spares\n",
                 f.nodes.c_str(), spares > 0 ? absl::StrCat(" --spares ", spares).c_str() : "", needed,
                 alloc->Describe().c_str(), alloc->nodes.size(), needed);
    return kUsageExit;
  }
  if (advertise_host.empty()) {
    auto addr = AdvertiseAddress(*alloc);
    if (!addr.ok()) {
      std::fprintf(stderr, "ballast slurm: %s\n", std::string(addr.status().message()).c_str());
      return kUsageExit;
    }
    advertise_host = *addr;
  }

  std::atomic<scheduler::NodeManager*> node_manager{nullptr};
  master::MasterOptions mopts = JobMasterOptions(f, &node_manager);
  mopts.bind_host = "0.0.0.0";
  mopts.advertise_host = advertise_host;
  mopts.job_id = absl::StrCat("slurm-", alloc->job_id);
  mopts.expected_nodes = needed;  // the spares join the first round's rendezvous (and check)
  int rc = 0;
  std::unique_ptr<DrivenMaster> server = StartJobMaster("slurm", f, mopts, &rc);
  if (server == nullptr) return rc;
  DrivenMaster& m = *server;
  spdlog::info("job {}: master on {} ({}); {} agent step(s): nodes {} + {} spare(s), {} worker(s) each; status: "
               "BALLAST_TOKEN={} ballast status --master {}",
               m.job_id(), m.address(), alloc->Describe(), needed, f.nodes, spares, f.nproc_per_node, m.token(),
               m.address());

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  scheduler::slurm::SlurmSchedulerOptions so;
  so.allocation = *alloc;
  so.tools = tools;
  so.node_state_poll_s = Tunables::Get().slurm_node_state_poll_s;
  so.spares = spares;
  so.command_for = [&](const scheduler::NodeRequest& r) {
    scheduler::LocalCommand cmd = AgentCommand(f, m, r);
    cmd.argv.insert(cmd.argv.begin(), srun_args.begin(), srun_args.end());
    return cmd;
  };
  scheduler::slurm::SlurmScheduler sched(so);
  scheduler::NodeManagerOptions nmo = JobNodeManagerOptions(f, needed, &m);
  nmo.name = [&sched](int rank, int incarnation) { return sched.NextNodeName(rank, incarnation); };
  scheduler::NodeManager nodes(&sched, nmo);
  node_manager.store(&nodes);

  std::set<std::string> seen_bad;
  DriveOptions o;
  o.cmd = "slurm";
  o.each_turn = [&]() { DrainBadNodes(sched, nodes.avoid_hosts(), drain_bad_nodes, m.job_id(), &seen_bad); };
  return DriveJob(m, sched, nodes, f, g_signal, o);
}

}  // namespace ballast::cli
