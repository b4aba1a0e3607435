// JobMaster: the job state machine behind the Master gRPC service, and the
// one serialized owner of the job's state. Its components, each with one job
// and no lock of their own (they run under mu_): Rendezvous (who joined, the
// world they form), NodeTable (liveness), FaultPolicy (restart or fail),
// KvStore (round endpoints, replica records, KvGet waiters),
// CkptCommitTracker (flash checkpoint commits), FailureArbiter (when a worker
// failure is decided, and who is blamed), FailureLog and
// GoodputAccountant (what failures cost), PrecheckCoordinator (the pre-flight
// check), DecisionOutboxes (each node's decisions and Watch stream), and a
// borrowed Journal (durable state; job_master_journal.cc). EventLog has its
// own lock. It speaks proto messages and absl::Status only; master_service.cc
// adapts it to gRPC.
//
// Job states: "rendezvous" (waiting for enough nodes), "running" (a round is
// active), then "succeeded" or "failed" (final). Every change of the world is
// a new round with a larger number (see master.proto):
//  - first rendezvous: the round forms once MAX nodes joined, or >= MIN and
//    last_call_s passed after the last join;
//  - restart in place after a worker failure (uses one of max_restarts);
//  - scale down when a member is lost: at once if the rest still makes a valid
//    world, else back to "rendezvous" for up to wait_for_nodes_s;
//  - scale up when late nodes would make a bigger valid world (after the last
//    call, or at once when they reach MAX).
// Membership changes never use up restarts.
//
// Time: every timestamp comes from the injected clock; Tick() evaluates the
// timeouts (heartbeats, last call, waiting for nodes) and is driven by the
// server's ticker thread, or by hand in tests with FakeClock. Blocking waits
// (KvGet, NextDecision, WaitForFinish) use real time.
//
// Ownership: JobMaster owns all job state. The clock is borrowed and must
// outlive it. Watch handles share ownership of their outbox, so a handle stays
// valid after its node is gone (the stream then just ends).
//
// Thread safety: all public methods are thread-safe. One mutex (mu_) guards
// all state, including the outboxes; blocking calls wait on condition
// variables tied to it. Log lines are written after mu_ is released
// (JobLock), never under it. The on_node_lost callback runs outside the lock, after
// the state change, on the thread that detected the loss.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "ballast/v1/master.pb.h"
#include "health/health_policy.h"
#include "master/ckpt_commit_tracker.h"
#include "master/decision_outbox.h"
#include "master/event_log.h"
#include "master/failure_arbiter.h"
#include "master/failure_log.h"
#include "master/goodput.h"
#include "common/clock.h"
#include "common/ids.h"
#include "common/logging.h"
#include "master/fault_policy.h"
#include "master/journal.h"
#include "master/kv_store.h"
#include "master/node_table.h"
#include "master/sdc_checker.h"
#include "master/precheck_coordinator.h"
#include "master/rendezvous.h"

namespace ballast::master {

struct JobMasterOptions {
  std::string job_id;  // also the TORCHELASTIC_RUN_ID
  int min_nodes = 1;
  int max_nodes = 1;
  // Nodes the scheduler starts at once (MAX + hot spares; 0: max_nodes). The
  // first round, and its pre-flight check, wait up to last_call_s after the
  // last join for all of them: spares are checked with the rest, and the
  // lowest node ranks train while the spares wait.
  int expected_nodes = 0;
  int node_unit = 1;
  int max_restarts = 3;
  double last_call_s = 1.0;
  double heartbeat_interval_s = 1.0;
  double heartbeat_timeout_s = 5.0;
  double wait_for_nodes_s = 300.0;
  // A node whose Watch stream closed and did not reopen within this many
  // seconds is lost ("agent disconnected"), long before its heartbeat timeout:
  // an agent killed outright closes its connection at once. 0 disables it.
  double disconnect_grace_s = 0.0;
  // A failure report is decided this many seconds after it arrived (0: at
  // once). While any other member of the round is disconnected, the decision
  // waits until that node is back or lost: a worker failure caused by a lost
  // node is then a membership change, not a restart.
  double failure_settle_s = 0.0;
  // A hang report is held at least this long (with more than one member), so
  // the hang reports of other nodes arrive and the right rank is blamed
  // (FailureArbiter::OrderForBlame).
  double hang_settle_s = 0.0;
  // A member whose step time (progress reports) exceeds this factor times the
  // median over the round's reporting members is a straggler (Status()); <= 0: off.
  double straggler_factor = 2.0;
  // Pre-flight check (precheck_coordinator.h) before a round forms with nodes
  // not checked yet. Also turned on by an agent that joins with
  // JobSpec.precheck (ballast run --network-check).
  bool precheck = false;
  bool exclude_stragglers = false;  // exclude stragglers too, not just report them
  // What a bad loss (ballast.step(step, loss=)) does: health/health_policy.h.
  health::HealthPolicy health;
  PrecheckOptions precheck_options = PrecheckOptions::FromEnv();
  ClockInterface* clock = nullptr;  // required; borrowed
  // Called (outside the lock) when a node dies or leaves while the job runs.
  std::function<void(const std::string& node_id, const std::string& reason)> on_node_lost;
  // Called when a node's agent hung up its decision stream while the job runs
  // (its process or host may be gone; it is lost unless it reconnects within
  // disconnect_grace_s): a backend can start a replacement ahead of the loss.
  // Runs WITH the lock held: it must only queue (NodeManager::OnNodeDisconnected).
  std::function<void(const std::string& node_id)> on_node_disconnected;
  // Called when a node is excluded from the job (it failed the pre-flight
  // check, or is a straggler there with exclude_stragglers). Runs WITH the
  // lock held: it must only queue (NodeManager::OnNodeExcluded does).
  std::function<void(const std::string& node_id, const std::string& reason)> on_node_excluded;
  // StartRound carries every member (agents need the list: MASTER_ADDR
  // checks, replica peers). The simulator's agents do not, and at 1,000+
  // nodes the lists are members^2 entries per round: it turns them off.
  bool send_round_members = true;
  // Durable state (journal.h), borrowed; nullptr: none. The master records
  // its state there and, when the journal holds a job (journal->recovered()),
  // resumes that job: same round, members, restart count, checkpoint commits,
  // KV entries and failure history. Its nodes then have a heartbeat timeout
  // to reconnect; those that do keep training (the round does not change).
  // The options must match the journal's job (CheckJournalMatches).
  Journal* journal = nullptr;
  // A fresh master's goodput carries on from what came before it (the time
  // queued, the previous master's breakdown, the time preempted); one that
  // resumes from its journal has it there.
  GoodputBefore goodput_before;
};

// Whether options (from flags) may resume the job a journal holds:
// kFailedPrecondition naming the difference (another job id, --nnodes, ...).
absl::Status CheckJournalMatches(const JobMasterOptions& options, const v1::JournalJob& job);

// kInvalidArgument with a message that says what to fix, or OK.
absl::Status ValidateJobMasterOptions(const JobMasterOptions& options);

struct JobOutcome {
  bool succeeded = false;
  std::string message;
  int restart_count = 0;
};

class JobMaster {
 public:
  // A Watch stream's receiving end and its hold on its node's outbox
  // (decision_outbox.h).
  using DecisionSink = DecisionOutboxes::Sink;
  using WatchHandle = DecisionOutboxes::Handle;

  // Which members a StartRound lists: all of them to group rank 0 (its store
  // watch names the members that never connected) and in worlds of up to
  // kFullMemberListNodes; to the others group rank 0 (the MASTER_ADDR check
  // names it) and the next kRingNeighbors by group rank (flash-checkpoint
  // replicas, --ckpt-replicas <= 8). So a round costs O(nodes) entries, not
  // O(nodes^2) (10^8 at 10,000 nodes).
  static constexpr int kFullMemberListNodes = 64;
  static constexpr int kRingNeighbors = 8;

  // Options must be valid (ValidateJobMasterOptions).
  explicit JobMaster(JobMasterOptions options);
  ~JobMaster();
  JobMaster(const JobMaster&) = delete;
  JobMaster& operator=(const JobMaster&) = delete;

  // --- The RPCs (see master.proto for the contract). ---
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request);
  absl::Status Leave(const v1::LeaveRequest& request);
  absl::Status Heartbeat(const v1::HeartbeatRequest& request);
  // Text fields above common/limits.h's bounds are cut, not refused.
  absl::Status ReportFailure(const v1::FailureReport& report);
  absl::Status ReportWorkersDone(const v1::WorkersDoneRequest& request);
  // `response` (optional) gets what the agent passes on to its workers.
  absl::Status ReportProgress(const v1::ProgressReport& report, v1::ProgressResponse* response = nullptr);
  // For a driver that speaks for many agents at once (`ballast simulate`),
  // under one lock: Heartbeat from each node in turn, and ReportProgress of
  // the same report from each (its node_id is the one in the list, not
  // report.node_id()). Each node is handled as its own call would; the first
  // error is returned, the other nodes are still handled.
  absl::Status Heartbeats(const std::vector<NodeId>& node_ids);
  absl::Status ReportProgressFrom(const std::vector<NodeId>& node_ids, const v1::ProgressReport& report);
  // Flash checkpoint: counts durable ranks per (dir, step). commit = true for
  // exactly one report per (dir, step), the one that completes world_size
  // ranks. kInvalidArgument for an empty dir, world_size < 1 or a rank
  // outside [0, world_size). Not round-checked (see master.proto).
  absl::StatusOr<v1::ShardDurableResponse> ReportShardDurable(const v1::ShardDurableReport& report);
  // Pre-flight check result (see master.proto): kAborted for a stale check,
  // NOT_FOUND for an unknown node.
  absl::Status ReportCheckResult(const v1::CheckResult& result);
  absl::Status KvSet(const std::string& key, std::string value);
  // Waits up to wait_s (real time) for `key`. NOT_FOUND when absent and
  // wait_s <= 0, DEADLINE_EXCEEDED after waiting, UNAVAILABLE on shutdown, and
  // CANCELLED as soon as `cancelled` (polled every 100 ms) returns true.
  absl::StatusOr<std::string> KvGet(const std::string& key, double wait_s,
                                    const std::function<bool()>& cancelled = {});
  // KvGet without a thread waiting (the callback server): `done` runs
  // exactly once, never with the lock held, with what KvGet would return -
  // at once, when the key is set, or when wait_s passed (checked at each
  // Tick). Returns an id for CancelKvWait, 0 when `done` already ran.
  using KvCallback = KvStore::Callback;
  uint64_t KvGetAsync(const std::string& key, double wait_s, KvCallback done);
  // Runs the waiter's `done` with CANCELLED unless it ran already.
  void CancelKvWait(uint64_t id);
  v1::JobStatus Status() const;
  // Status().goodput() alone: no pass over the nodes.
  v1::Goodput GoodputNow() const;
  // The journal's state when it moved past `seq` (its last_seq), else
  // nullopt (also without a journal): what a master kept outside its pod
  // mirrors (kubernetes/master_state.h).
  std::optional<v1::MasterSnapshot> JournalStateAfter(uint64_t seq) const;
  // The job's timeline (GET /api/v1/events); thread-safe, never takes the job lock.
  const EventLog& events() const { return events_; }
  // Recovery-time histogram (decision -> next round's first step) and the
  // failures the job recovered from by kind, for the metrics.
  Histogram RecoveryHistogram() const;
  std::map<std::string, int> RecoveriesByKind() const;
  Histogram CkptSaveHistogram() const;
  // Decisions queued so far (any node): a driver that polls every outbox
  // (the simulator) skips the poll when it has not moved.
  uint64_t decisions_pushed() const;

  // --- Watch streams. ---
  // Starts a stream for a node: its current decision (StartRound, Wait or
  // JobFinished) is queued first, so a reconnecting agent catches up. Replaces
  // any older stream of the node. NOT_FOUND for an unknown node.
  absl::StatusOr<WatchHandle> OpenWatch(const std::string& node_id);
  // The same for a stream that receives its decisions through `sink` (no
  // NextDecision; nullptr: the queue NextDecision reads): the current
  // decision is delivered before this returns.
  absl::StatusOr<WatchHandle> OpenWatch(const std::string& node_id, std::shared_ptr<DecisionSink> sink);
  // The stream's next decision, or nullopt after timeout_s (real time) without
  // one. An error means the stream must end with it: CANCELLED when a newer
  // Watch replaced it, NOT_FOUND when the node is gone, UNAVAILABLE on shutdown.
  absl::StatusOr<std::optional<v1::Decision>> NextDecision(const WatchHandle& handle,
                                                           double timeout_s);
  // The stream wrote the final JobFinished to its agent.
  void MarkFinalSent(const WatchHandle& handle);
  // The stream ended; a no-op for stale handles.
  void CloseWatch(const WatchHandle& handle);
  // True when every open stream of an alive node has been sent JobFinished
  // (vacuously true with no streams). Shutdown lingers on this.
  bool AllFinalDecisionsSent() const;

  // Evaluates heartbeat timeouts, last-call completion and wait-for-nodes
  // expiry at the clock's now. Called every ~50-100 ms.
  void Tick();

  // Journals the gRPC port agents reach the master at (once it listens).
  void RecordPort(int port);

  // Fails the job with `message` (e.g. the scheduler cannot provide nodes):
  // every agent gets JobFinished. A no-op once the job finished.
  void Abort(const std::string& message);
  // The job was suspended (Kueue evicted it, or spec.suspend): its time is
  // preempted from now on (goodput), until this master stops.
  void Suspended();

  // The result once the job finished.
  std::optional<JobOutcome> outcome() const;
  // Blocks up to timeout_s (real time; < 0: forever) for the job to finish.
  std::optional<JobOutcome> WaitForFinish(double timeout_s);
  // Ends every stream and wait (they return UNAVAILABLE). Idempotent.
  void Shutdown();

  const std::string& job_id() const { return options_.job_id; }
  const v1::JobSpec& spec() const { return spec_; }

 private:
  // The job lock (mu_). Lines logged while it is held are written after it
  // is released (DeferLogs, declared first so it ends last): no log I/O
  // under the job lock.
  class ABSL_SCOPED_LOCKABLE JobLock {
   public:
    explicit JobLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : lock_(mu) {}
    ~JobLock() ABSL_UNLOCK_FUNCTION() = default;

   private:
    DeferLogs defer_;
    absl::MutexLock lock_;
  };
  enum class JobState { kRendezvous, kRunning, kSucceeded, kFailed };
  using LostList = std::vector<std::pair<NodeId, std::string>>;  // (node, reason)

  static const char* JobStateName(JobState s);
  static const char* const kAwaitingCheckReason;  // Wait reason of an unchecked joiner
  bool finished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state_ == JobState::kSucceeded || state_ == JobState::kFailed;
  }
  absl::Status CheckSpec(const v1::JobSpec& given) const;
  absl::Status CheckRound(const char* what, Round round) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status HeartbeatLocked(const NodeId& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReportProgressLocked(const NodeId& node_id, const v1::ProgressReport& report,
                                    v1::ProgressResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Feeds the goodput accountant the world's step from the members' reports.
  void WorldProgress(double now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Folds the progress reports since the last call into the world's step
  // (WorldProgress): before every state change, at each tick and in Status().
  // Const because Status() folds too: the accountant, failure log and step
  // history it feeds are a cache of the reports (hence mutable).
  void FlushProgress(double now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the straggler check compares over the current round's members:
  // their compute times per forward pass when every member reports one
  // (ballast.step(step, model=)), else their step times (0: unknown), which
  // synchronous training makes the same everywhere.
  struct StragglerTimes {
    std::map<NodeId, double> times;       // what is compared
    bool compute = false;                 // times are compute times
    std::map<NodeId, double> step_times;  // the step times, for the status
  };
  StragglerTimes RoundStragglerTimes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The current round's members that reported in it, and whether every
  // member reports compute times (what RoundStragglerTimes compares).
  struct RoundReports {
    std::vector<std::pair<const NodeId*, const NodeRecord*>> current;
    bool compute = false;
  };
  RoundReports CurrentRoundReports() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Logs a node once when it turns into a straggler (at most once a second);
  // with exclude_stragglers, excludes (and so replaces) one that stays a
  // straggler for kStragglerExcludeChecks checks in a row.
  void CheckStragglers(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr double kStragglerCheckIntervalS = 1.0;
  static constexpr int kStragglerExcludeChecks = 3;
  // Tick's work on the job state (timeouts, held failures, rounds); the lost
  // nodes' callbacks run after the lock.
  void TickLocked(LostList* lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NnodesText() const;
  v1::JoinResponse JoinAnswer() const;

  // Queues `d` for the node and makes it the node's current decision when it
  // is a StartRound, Wait or JobFinished.
  void Push(const NodeId& node_id, v1::Decision d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PushWait(const NodeId& node_id, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string SurplusReason() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before the first round: MAX joined, but not every node the scheduler
  // started (expected_nodes), and the last call since the last join runs.
  bool WaitingForStartingNodes(double now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string RendezvousWaitReason(double now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Starts the next round with `world`: StartRound to members, Wait to the rest.
  void StartRound(const World& world, bool is_restart, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Round completion / scale up / wait-for-nodes expiry at `now`.
  void Evaluate(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Nodes died or left: removes them and, if an active member is among them,
  // re-forms the world once (scale down, or below MIN: stop and wait).
  void LoseNodes(const std::vector<NodeId>& ids, NodeState how, const std::string& reason,
                 double now, LostList* lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Too few nodes for a valid world: stop the members and wait for joins.
  void EnterBelowMin(const std::string& context, double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeSucceed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the fault policy to a validated failure report of the current round.
  // detection_s: from the last sign of health to now (FailureRecord).
  // exclude: nodes to exclude from the job first (a replica that diverged).
  void HandleFailure(const v1::FailureReport& report, const std::string& host, double detection_s,
                     const std::vector<NodeId>& exclude = {}) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Acts on a fingerprint verdict (SdcChecker): exclude the diverged ranks'
  // nodes and roll back to the newest agreed step, recompute after a tie, or
  // fail the job after a second one.
  void ApplySdcVerdict(const SdcChecker::Verdict& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A member of the round other than `except` whose Watch stream is closed.
  std::optional<NodeId> DisconnectedMember(const NodeId& except) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decides held failure reports whose settle time passed (FailureArbiter);
  // drops those a node loss made stale.
  void DecidePendingFailures(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(bool succeeded, const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a decided failure to the log (and the journal).
  void AddFailure(v1::FailureRecord r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsMember(const NodeId& node_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyLost(const LostList& lost);
  // Pre-flight check (job_master_precheck.cc). Returns true while the check
  // holds the round back: it runs, or it just started because a participant
  // was not checked yet.
  bool PrecheckGate(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Advances a running check whose round is complete; acts on its verdict.
  void DrivePrecheck(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyPrecheckOutcome(const PrecheckOutcome& outcome, double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While the job runs: drives a check of joining nodes, or starts one for
  // participants that are not members and not checked yet (after the last
  // call, so a burst of joins is checked at once). Returns true while a check
  // runs: scaling up waits for it.
  bool JoinerCheckGate(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends each node its RunCheck decision of a check round.
  void PushRunChecks(CheckDecisions decisions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a running pre-flight check includes the node.
  bool InRunningCheck(const NodeId& node_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a running check when one of its nodes left the rendezvous.
  void AbortCheckIfNodeLeft() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a participant may be placed in a round: always without the
  // pre-flight check, else once it passed one.
  bool Admissible(const NodeId& node_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The admissible participants, and the world (or its size) they make while
  // the job runs. A round that forms during rendezvous follows the check gate.
  std::vector<NodeId> AdmissibleNodes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int AdmissibleWorldNodes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<World> FormAdmissible() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a node out of the job for good: Excluded decision, out of the
  // rendezvous, its re-joins refused.
  void ExcludeNode(const NodeId& node_id, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- The journal (job_master_journal.cc). ---
  // Appends a record; a failed write is logged once and the master goes on
  // without durability (training must not stop because the master's disk did).
  void Record(v1::JournalRecord record, bool sync) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round state record (written whole when it changes; synced).
  void RecordRound() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordNodeUp(const NodeSpec& spec, int64_t pid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The goodput totals, every kGoodputMarkIntervalS.
  void MaybeRecordGoodput(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr double kGoodputMarkIntervalS = 2.0;
  // Rebuilds the job from the journal's state (in the constructor): the
  // round and policy, the nodes, the goodput, each node's current decision.
  void Restore(const v1::MasterSnapshot& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreRound(const v1::MasterSnapshot& state, double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreNodes(const v1::MasterSnapshot& state, double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreGoodput(const v1::MasterSnapshot& state, double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreDecisions(double now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where the job's clock starts: now, or (resuming) as long ago as the job began.
  static double StartTime(const JobMasterOptions& options);
  // Seconds since the Unix epoch (the journal's and other processes' times).
  static double UnixNow();
  // A Unix time on this master's clock, whose time is `now`: this clock
  // starts anew in each process; a time after now is now.
  static double FromUnix(double now, double unix_s) { return now - std::max(0.0, UnixNow() - unix_s); }
  // A member's StartRound decision of the current round.
  v1::Decision MakeStartRound(const MemberAssignment& m, const World& world) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobMasterOptions options_;
  const v1::JobSpec spec_;
  ClockInterface* const clock_;
  const double start_time_;
  const std::string instance_;  // JobStatus.master_instance
  Journal* const journal_;
  mutable bool journal_failed_ ABSL_GUARDED_BY(mu_) = false;
  double goodput_marked_at_ ABSL_GUARDED_BY(mu_) = -1e18;
  // Fed lazily from the progress reports (FlushProgress), so mutable.
  mutable GoodputAccountant goodput_ ABSL_GUARDED_BY(mu_);
  mutable FailureLog failures_ ABSL_GUARDED_BY(mu_);
  mutable StepHistory step_history_ ABSL_GUARDED_BY(mu_);
  mutable bool progress_dirty_ ABSL_GUARDED_BY(mu_) = false;
  // Checkpoint shard writes the agents reported failed (progress reports).
  int persist_errors_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_persist_error_ ABSL_GUARDED_BY(mu_);
  double stragglers_checked_at_ ABSL_GUARDED_BY(mu_) = -1e18;
  // Bumped when a report changes a node's round or times.
  uint64_t straggler_inputs_ ABSL_GUARDED_BY(mu_) = 0;
  // What a straggler check read the last time it found none: (reports,
  // nodes_.version(), round, the world's size; a new world comes with a new
  // round, or is empty). The next check of the same inputs finds none either
  // and is skipped (each is a pass over every member; a simulated job ticks
  // at every event).
  std::optional<std::tuple<uint64_t, uint64_t, int64_t, size_t>> stragglers_none_at_ ABSL_GUARDED_BY(mu_);
  // Seconds each checkpoint save blocked a worker (from progress reports).
  Histogram ckpt_save_ ABSL_GUARDED_BY(mu_){{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  EventLog events_;  // its own lock (see event_log.h)

  mutable absl::Mutex mu_;
  JobState state_ ABSL_GUARDED_BY(mu_) = JobState::kRendezvous;
  Rendezvous rdzv_ ABSL_GUARDED_BY(mu_);
  NodeTable nodes_ ABSL_GUARDED_BY(mu_);
  FaultPolicy policy_ ABSL_GUARDED_BY(mu_);
  Round round_ ABSL_GUARDED_BY(mu_);  // none until the first round
  int restart_count_ ABSL_GUARDED_BY(mu_) = 0;
  World world_ ABSL_GUARDED_BY(mu_);                 // the current round's world
  std::set<NodeId> done_ ABSL_GUARDED_BY(mu_);  // members that reported done
  // Set while below MIN after a loss: when the wait began and what was lost.
  std::optional<double> below_min_since_ ABSL_GUARDED_BY(mu_);
  std::string below_min_context_ ABSL_GUARDED_BY(mu_);
  v1::FailureInfo last_failure_ ABSL_GUARDED_BY(mu_);
  FailureArbiter arbiter_ ABSL_GUARDED_BY(mu_);  // held failure reports
  std::string message_ ABSL_GUARDED_BY(mu_);
  std::optional<JobOutcome> outcome_ ABSL_GUARDED_BY(mu_);
  absl::CondVar finished_cv_;
  KvStore kv_ ABSL_GUARDED_BY(mu_);  // its waiters' answers run after the lock is released
  DecisionOutboxes outboxes_ ABSL_GUARDED_BY(mu_);  // each node's decisions and Watch stream
  CkptCommitTracker ckpt_ ABSL_GUARDED_BY(mu_);  // flash checkpoint commits
  // Training health (health_policy.h): the steps a rollback drops (0: none),
  // sent with every StartRound until a round after the rollback made its
  // first step (a round superseded before that drops them again: harmless),
  // and the samples every round skips.
  int64_t rollback_below_ ABSL_GUARDED_BY(mu_) = 0;
  Round rollback_round_ ABSL_GUARDED_BY(mu_);    // the last rollback's round
  int64_t rolled_back_below_ ABSL_GUARDED_BY(mu_) = 0;  // ... and the steps it dropped
  std::string skip_data_ ABSL_GUARDED_BY(mu_);
  SdcChecker sdc_ ABSL_GUARDED_BY(mu_);  // parameter fingerprints (silent data corruption)
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Pre-flight check state.
  struct Precheck {
    bool enabled = false;
    bool exclude_stragglers = false;
    PrecheckCoordinator coordinator;
    std::set<NodeId> passed;                  // nodes that passed a check
    std::map<NodeId, double> best_times;      // their check times (straggler reference)
    std::map<NodeId, std::string> excluded;   // node id -> why
    std::string verdict;                           // the last verdict, for status
  };
  Precheck precheck_ ABSL_GUARDED_BY(mu_);
  // Nodes the job's scheduler reported gone (Leave with `lost`), and why: a
  // re-join from one (an agent on a Ray node already declared dead, not yet
  // killed) is refused, as its replacement takes its place.
  std::map<NodeId, std::string> scheduler_lost_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ballast::master
