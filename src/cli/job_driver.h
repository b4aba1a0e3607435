// What `ballast launch` (local agent processes) and `ballast slurm` (one
// Slurm job step per node) share: the job's flags, the agents' command line,
// the master's options, and the loop that drives a job to its end through a
// scheduler backend and NodeManager (scheduler/node_manager.h: the one
// replacement policy).
//
// Threading: everything on the calling (main) thread; the master has its own.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include "cli/cli_util.h"
#include "cli/health_flags.h"
#include "cli/http_flags.h"
#include "cli/tls_flags.h"
#include "common/thread_priority.h"
#include "cli/master_process.h"
#include "master/master_server.h"
#include "scheduler/local/local_scheduler.h"
#include "scheduler/node_manager.h"

namespace ballast::cli {

struct JobFlags {
  std::string nodes = "1";
  int nproc_per_node = 1;
  int max_restarts = 3;
  int node_unit = 1;
  int max_replacements = -1;
  int port = 0;
  HttpFlags http;
  HealthFlags health;
  bool network_check = false;
  bool exclude_stragglers = false;
  std::string chaos;  // --chaos SPEC (common/chaos.h)
  std::string token;
  std::string python = "python3";
  bool module = false;
  bool no_python = false;
  std::string log_dir;
  std::string tee;
  std::string redirects;
  std::string role;
  double hang_timeout_s = 0;
  std::string save_every;  // --save-every N|auto|auto:MAX ("" = the script's)
  std::string mtbf;        // --mtbf DURATION ("" = the default prior)
  int ckpt_replicas = 1;
  int ckpt_copy_nice = kDefaultCopyNice;
  double ckpt_copy_share = 0;  // --ckpt-copy-share F (0 = the workers' default)
  bool no_warm_restart = false;
  bool no_warm_fork = false;
  std::string warm_modules;  // --warm-modules a,b (as `ballast run`)
  TlsFlags tls;
  std::string journal;  // --journal DIR: the master in a child process (cli/master_process.h)
  bool master_journaled = false;  // the master keeps a journal without --journal (`ray run`'s master actor)
  std::vector<std::string> script_and_args;

  NodeRange range;  // --nodes, parsed by Check
};

// Adds the shared flags to a command (everything from the script on belongs
// to the script).
void AddJobFlags(CLI::App& app, JobFlags* f);
// After parsing: the script, --nodes, --chaos, the defaults. -1 when the flags
// are good, else the exit code (a message was printed, naming `cmd`).
int CheckJobFlags(const char* cmd, const CLI::App& app, JobFlags* f);

// The `ballast run` command line of one agent.
std::vector<std::string> AgentArgv(const JobFlags& f, const std::string& master_endpoint, int node_rank);
// An agent's command and environment for a NodeManager request (token,
// chaos spec and incarnation).
scheduler::LocalCommand AgentCommand(const JobFlags& f, const DrivenMaster& m, const scheduler::NodeRequest& r);

// The master's options for these flags (bind and advertise host are the
// caller's), with its node callbacks forwarding to *node_manager.
master::MasterOptions JobMasterOptions(const JobFlags& f, std::atomic<scheduler::NodeManager*>* node_manager);

// NodeManager's options for these flags: node ranks 0..initial_nodes-1,
// --max-replacements, and the grace a released node's agent gets.
// The scheduler's node deaths go to the master `m` at once.
scheduler::NodeManagerOptions JobNodeManagerOptions(const JobFlags& f, int initial_nodes, DrivenMaster* m);

// Starts the job's master: in this process, or with --journal in a child
// process restarted from its journal when it dies (MasterProcess). On an
// error prints it (naming `cmd`) and sets *exit_code (2 for bad options).
// Logs the dashboard's address.
// The job's master: in this process, or with --journal a MasterProcess (a
// child process); with `host` a MasterProcess there, journaling to
// journal_dir (a path where the host runs it).
std::unique_ptr<DrivenMaster> StartJobMaster(const char* cmd, const JobFlags& f, const master::MasterOptions& options,
                                             int* exit_code, std::unique_ptr<MasterHost> host = nullptr,
                                             const std::string& journal_dir = "");

struct DriveOptions {
  const char* cmd = "launch";  // for messages: "ballast launch: ..."
  // Called once per loop turn after the node manager polled (drain bad
  // nodes, publish spares, ...).
  std::function<void()> each_turn;
};

// Starts the nodes (nodes.Start()), then runs the job to its end: polls the
// master and the node manager, stops when
// the job finished, every node is gone and the replacement budget used up, or
// a signal came (*signal != 0); then lets the agents exit, stops the rest and
// prints the summary. Returns the exit code.
int DriveJob(DrivenMaster& m, scheduler::SchedulerInterface& sched, scheduler::NodeManager& nodes,
             const JobFlags& f, const std::atomic<int>& signal, const DriveOptions& o);

}  // namespace ballast::cli
