// The per-node agent of `ballast run`: joins the job master, follows its
// decisions (StartRound, Wait, StopWorkers, JobFinished), supervises the
// node's workers and reports their failures or success.
//
// Ownership: Agent owns its MasterClient, its WorkerGroup and an event queue.
// The master (embedded or remote) is not owned: RunAgent (run_agent.cc) starts
// an embedded one when asked and hands the agent its endpoint and token.
//
// Threading: Run() is the single owner of all agent state and must be called
// from a thread that outlives the workers (the process's main thread in
// `ballast run`): workers die with the thread that forked them
// (PR_SET_PDEATHSIG). Other threads talk to it only through the event queue:
// the master client's watch thread posts decisions and "master lost",
// PostSignal posts signals (thread-safe, callable from a sigwait thread).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <variant>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "agent/chaos_driver.h"
#include "agent/ckpt_persister.h"
#include "agent/hang_responder.h"
#include "agent/master_client.h"
#include "agent/precheck_runner.h"
#include "agent/progress_monitor.h"
#include "agent/recovery_timeline.h"
#include "agent/replica_coordinator.h"
#include "agent/round_address.h"
#include "agent/run_options.h"
#include "agent/warm_starter.h"
#include "agent/worker_group.h"
#include "ballast/v1/master.pb.h"
#include "common/net.h"
#include "common/tunables.h"

namespace ballast::agent {

struct AgentOptions {
  RunOptions run;
  std::string endpoint;  // the master, host:port
  std::string token;
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // TLS to the master; nullptr: insecure
  // Where the master is now, when it may move (MasterClientOptions::locate).
  std::function<std::string()> locate_master;
  std::string node_id;   // "" = "<hostname>-<pid>-<4 hex>"
  std::string host;      // address others reach this node at; "" = derived from endpoint
  Tunables tunables = Tunables::Get();
  // Where forwarded worker output goes (tests redirect it).
  int console_stdout_fd = 1;
  int console_stderr_fd = 2;
  // Flash checkpoint: create one shared-memory store per local rank, hand it
  // to the workers (BALLAST_CKPT_SHM) and persist what they ask for.
  bool flash_checkpoint = true;
};

// The address other nodes reach this node at: local_addr when given;
// "127.0.0.1" for a loopback / localhost master; else the local address of
// this host's route to the master (a network the master, and so the other
// nodes, reach; a host name may not resolve elsewhere); HostName() when even
// that is unknown (the master's name does not resolve here).
std::string DeriveHost(const std::string& local_addr, const std::string& master_host);
// Adds GLOO_SOCKET_IFNAME to a worker environment when gloo could not pick a
// usable interface by itself: this host's name does not resolve to a local,
// non-loopback address (gloo then falls back to loopback, and every
// cross-host connection hangs), `host` is a numeric address of an interface
// here, and the user did not set the variable. Returns the interface set, or "".
std::string AddGlooInterface(const std::string& host, std::map<std::string, std::string>* env);

// "<hostname>-<pid>-<4 hex>".
std::string MakeNodeId();
// <dir of exe_path>/../python when that directory exists (the build tree's
// Python package: build/bin/ballast, build/python/ballast), else "".
std::string PythonPackageDir(const std::string& exe_path);
// The PYTHONPATH for workers: package_dir before the existing value (if any).
std::string WorkerPythonPath(const std::string& package_dir, const std::string& existing);
// The worker command line for the options (python -u script..., -m, --no-python).
std::vector<std::string> WorkerCommand(const RunOptions& options);
// The JobSpec a JoinRequest carries: only what was given on the command line.
v1::JobSpec JoinSpec(const RunOptions& options);

// Behaviour (see proto/ballast/v1/master.proto for the protocol):
//  - StartRound N > current: stop older workers (grace), publish (group rank 0)
//    or fetch the round's MASTER_ADDR:PORT through the master's KV store, start
//    the workers. Re-sent or older StartRounds are ignored.
//  - Wait / StopWorkers: stop the workers and wait for the next decision.
//  - A worker fails: ReportFailure (the first one per round), keep supervising.
//    All workers exit 0: ReportWorkersDone, wait for JobFinished.
//  - JobFinished: exit 0 or 1 (printing the master's message). A signal: stop
//    workers, Leave, exit 128+N. Master lost past reconnect_timeout_s: exit 1.
//  - Flash checkpoint (ckpt_persister.h): after Join and before the first
//    round, one SlotStore per local rank; they live as long as the agent. A
//    persister thread makes requested steps durable. Whenever running workers
//    are stopped for any reason but success, a breakpoint save persists each
//    store's newest in-memory step before anything else happens.
// Run() may be called once per Agent.
class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Runs until the job ends; returns the exit code: 0 job succeeded, 1 job
  // failed / could not join / master lost, 128+N stopped by signal N.
  int Run();

  // Thread-safe: asks the agent to stop as if it got signal sig. The first one
  // stops workers with the grace period; a second one SIGKILLs them at once.
  void PostSignal(int sig);

  const std::string& node_id() const { return options_.node_id; }

 private:
  struct MasterLost {
    absl::Status status;
  };
  struct SignalEvent {
    int sig;
  };
  using Event = std::variant<v1::Decision, MasterLost, SignalEvent>;

  void Post(Event e);
  std::optional<Event> PopFor(double timeout_s);
  // True when a queued event makes a round start pointless: a signal, a lost
  // master, or a decision other than a re-sent copy of the current round.
  bool SupersedingEventPending();

  // Handlers return an exit code when the agent should exit.
  std::optional<int> Handle(const Event& e);
  std::optional<int> HandleDecision(const v1::Decision& d);
  void StartRound(const v1::StartRound& start);
  std::optional<int> PollWorkers();
  // On the node of global rank 0: fails the round when a member node never
  // reached the torch store (RoundAddress::WatchStore).
  void WatchStore();
  void ReportFailure(v1::FailureReport report);
  // Stops the workers; then, unless the job succeeded, the breakpoint save:
  // in the background when the agent goes on (a restart must not wait for
  // the disk), else before returning.
  enum class Breakpoint { kNone, kBackground, kWait };
  void StopWorkers(const std::string& why, Breakpoint breakpoint = Breakpoint::kWait);
  // Creates the checkpoint stores (after Join: their names carry the job id).
  void StartCheckpointStores(const std::string& job_id);
  void PublishState();
  // Hang detection (--hang-timeout, HangResponder): a hung worker's stacks
  // are dumped, it is killed and its failure reported with the hang evidence.
  // Sends the chaos drills due now (chaos_driver.h).
  void InjectChaos();
  void CheckHangs();
  // A worker recorded a bad loss (ballast.step(step, loss=)): stop the
  // workers without a breakpoint save and report it (health_watch.h).
  void CheckHealth();
  // A rollback round: drop every checkpoint step >= below here (memory,
  // replicas held for peers, disk) before the workers start.
  void RewindCheckpoints(uint64_t below);
  // Every progress_report_interval_s (or now): the node's min step and step time.
  void MaybeReportProgress(bool now_please = false);
  // The recovery timeline: logs, once the round's workers all stepped, when
  // each stage of the (re)start happened (see Timeline).
  void TrackTimeline();
  std::string Fmt() const;  // "node=<id> round=<n>" log keys

  AgentOptions options_;
  std::unique_ptr<MasterClient> client_;
  // Warm interpreters (warm_pool.h); null with --no-warm-restart or
  // --no-python. Declared before workers_, which points to it.
  std::unique_ptr<WarmPool> warm_;
  std::unique_ptr<WorkerGroup> workers_;
  // When warm_'s interpreters are prepared and what they preload (after Join).
  std::unique_ptr<WarmStarter> warm_starter_;
  // Chaos disk-full/disk-error (chaos_driver.h): declared before ckpt_,
  // which calls it from its threads, so it is destroyed after it.
  std::unique_ptr<DiskChaos> disk_chaos_;
  // Null when flash checkpoint is off or /dev/shm is unusable. Declared after
  // client_ so it is destroyed first (its thread reports through client_).
  std::unique_ptr<CkptPersister> ckpt_;
  // Peer replicas (--ckpt-replicas > 0 with flash checkpoint;
  // replica_coordinator.h). Declared after ckpt_: destroyed before the stores.
  std::unique_ptr<ReplicaCoordinator> replicas_;
  // BALLAST_CKPT_SHM of each local rank (the round adds BALLAST_CKPT_REPLICAS).
  std::vector<std::map<std::string, std::string>> ckpt_env_;
  // Pre-flight check workers (RunCheck decisions); created in Run().
  std::unique_ptr<PrecheckRunner> precheck_;
  // The workers' progress cells (BALLAST_PROGRESS_SHM); null when /dev/shm is unusable.
  std::unique_ptr<ProgressMonitor> progress_;
  // Declared after progress_ and workers_, which it points to; null when
  // progress_ is.
  std::unique_ptr<HangResponder> hangs_;
  // Chaos drills this agent injects (chaos_driver.h); created in Run().
  std::unique_ptr<ChaosDriver> chaos_;
  std::string chaos_iface_;  // chaos partition: the interface of options_.host
  bool chaos_link_down_ = false;  // ... and it is down now
  uint64_t round_started_ns_ = 0;       // CLOCK_MONOTONIC when round_'s workers started
  uint64_t next_progress_report_ns_ = 0;
  // The round's MASTER_ADDR:PORT: publish or fetch, address probe, store watch.
  std::unique_ptr<RoundAddress> round_address_;
  v1::StartRound round_start_;  // the StartRound of round_
  RecoveryTimeline timeline_;  // the current (re)start's stages
  v1::StartTimeline last_timeline_;  // the last completed one, for the master's status
  // When the round's workers had all made a step, and the (lowest) step then.
  struct FirstStep {
    int64_t round = 0;
    uint64_t ns = 0;
    uint64_t step = 0;
  };
  FirstStep first_step_;

  // Main-loop state (Run's thread only).
  int64_t round_ = 0;          // the newest round this node was started into, 0 = none
  bool round_failed_reported_ = false;
  // The workers' training-health settings, from the master (BALLAST_ON_NAN,
  // BALLAST_LOSS_SPIKE); they come with each round.
  std::map<std::string, std::string> health_env_;
  // The newest fingerprint step sent to the master, per local rank (this round).
  std::vector<uint64_t> fp_sent_;
  // Fingerprints published since the last report (progress cells), for the
  // master's silent-data-corruption check.
  std::vector<v1::Fingerprint> NewFingerprints();
  // The OOM kills counted in this agent's memory cgroup (health/oom.h) when
  // its workers started or a SIGKILLed one was last classified.
  std::optional<int64_t> oom_kills_seen_;
  bool running_round_ = false;  // workers of round_ were started and not stopped
  // The workers were stopped with a background breakpoint save, which writes
  // only the steps a rank asked to persist: if the agent exits before another
  // round's workers run (a preemption's SIGTERM just after the master stopped
  // this node's round because another node left), the exit still owes the
  // full breakpoint save of what is in memory.
  bool exit_breakpoint_owed_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  v1::HeartbeatRequest heartbeat_ ABSL_GUARDED_BY(mu_);  // snapshot for the heartbeat thread
  std::atomic<int> signals_{0};
  std::atomic<bool> kill_now_{false};
  std::atomic<bool> joining_{false};  // Run() is in its initial Join
};

}  // namespace ballast::agent
