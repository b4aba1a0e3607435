#include "master/job_master.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "common/replica_record.h"
#include "health/failure_class.h"
#include "master/straggler.h"
#include "spdlog/spdlog.h"

namespace ballast::master {
namespace {

v1::JobSpec MakeSpec(const JobMasterOptions& o) {
  v1::JobSpec spec;
  spec.set_min_nodes(o.min_nodes);
  spec.set_max_nodes(o.max_nodes);
  spec.set_node_unit(o.node_unit);
  spec.set_max_restarts(o.max_restarts);
  spec.set_run_id(o.job_id);
  spec.set_last_call_s(o.last_call_s);
  spec.set_wait_for_nodes_s(o.wait_for_nodes_s);
  spec.set_on_nan(health::OnNanName(o.health.on_nan));
  spec.set_max_rollbacks(o.health.max_rollbacks);
  spec.set_loss_spike_z(o.health.loss_spike_z);
  spec.set_no_skip_data(!o.health.skip_data);
  spec.set_replica_check_every(o.health.replica_check_every);
  return spec;
}

RendezvousConfig MakeRendezvousConfig(const JobMasterOptions& o) {
  return RendezvousConfig{o.min_nodes, o.max_nodes, o.node_unit, o.last_call_s};
}

std::string DescribeDecision(const v1::Decision& d) {
  switch (d.kind_case()) {
    case v1::Decision::kStartRound: {
      const auto& s = d.start_round();
      return absl::StrCat("start_round group_rank=", s.group_rank(), "/", s.group_world_size(),
                          " rank_offset=", s.rank_offset(), " world_size=", s.world_size(),
                          " restart_count=", s.restart_count());
    }
    case v1::Decision::kWait:
      return absl::StrCat("wait reason=\"", d.wait().reason(), "\"");
    case v1::Decision::kStopWorkers:
      return absl::StrCat("stop_workers reason=\"", d.stop_workers().reason(), "\"");
    case v1::Decision::kJobFinished:
      return absl::StrCat("job_finished succeeded=", d.job_finished().succeeded());
    case v1::Decision::kRunCheck:
      return absl::StrCat("run_check check=", d.run_check().check_id(), " round=", d.run_check().check_round(),
                          " group=", d.run_check().group_id(), " group_rank=", d.run_check().group_rank(), "/",
                          d.run_check().group_world_size());
    case v1::Decision::kExcluded:
      return absl::StrCat("excluded reason=\"", d.excluded().reason(), "\"");
    case v1::Decision::KIND_NOT_SET:
      break;
  }
  return "empty";
}

// "2:4", or "2" when MIN == MAX would be ambiguous to some readers; keep the
// explicit form so it matches what the user typed most often.
std::string Nnodes(int min_nodes, int max_nodes) { return absl::StrCat(min_nodes, ":", max_nodes); }

}  // namespace

absl::Status ValidateJobMasterOptions(const JobMasterOptions& o) {
  if (o.clock == nullptr) return absl::InvalidArgumentError("JobMaster needs a clock");
  if (o.job_id.empty()) {
    return absl::InvalidArgumentError("the job id (--rdzv-id / run id) must not be empty");
  }
  if (o.min_nodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes MIN must be at least 1, got ", o.min_nodes));
  }
  if (o.max_nodes < o.min_nodes) {
    return absl::InvalidArgumentError(absl::StrCat("--nnodes MIN:MAX needs MIN <= MAX, got ",
                                                   Nnodes(o.min_nodes, o.max_nodes)));
  }
  if (o.node_unit < 1 || o.node_unit > o.max_nodes) {
    return absl::InvalidArgumentError(absl::StrCat("--node-unit must be between 1 and MAX nodes (",
                                                   o.max_nodes, "), got ", o.node_unit));
  }
  int largest = o.max_nodes - o.max_nodes % o.node_unit;
  if (largest < o.min_nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nnodes ", Nnodes(o.min_nodes, o.max_nodes), " with --node-unit ", o.node_unit,
        " can never form a world: the largest multiple of ", o.node_unit, " up to ", o.max_nodes,
        " is ", largest, ", below MIN; lower MIN or the node unit, or raise MAX"));
  }
  if (o.max_restarts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-restarts must be >= 0, got ", o.max_restarts));
  }
  if (!(o.heartbeat_interval_s > 0) || !(o.heartbeat_timeout_s > o.heartbeat_interval_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat timings need 0 < interval < timeout, got interval ", o.heartbeat_interval_s,
        " s and timeout ", o.heartbeat_timeout_s,
        " s (BALLAST_HEARTBEAT_INTERVAL_S / BALLAST_HEARTBEAT_TIMEOUT_S)"));
  }
  if (!(o.last_call_s >= 0) || !(o.wait_for_nodes_s >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("last call (", o.last_call_s, " s) and wait for nodes (", o.wait_for_nodes_s,
                     " s) must be >= 0 (BALLAST_LAST_CALL_S / BALLAST_WAIT_FOR_NODES_S)"));
  }
  return absl::OkStatus();
}

const char* JobMaster::JobStateName(JobState s) {
  switch (s) {
    case JobState::kRendezvous:
      return "rendezvous";
    case JobState::kRunning:
      return "running";
    case JobState::kSucceeded:
      return "succeeded";
    case JobState::kFailed:
      return "failed";
  }
  return "unknown";
}

JobMaster::JobMaster(JobMasterOptions options)
    : options_(std::move(options)),
      spec_(MakeSpec(options_)),
      clock_(options_.clock),
      start_time_(StartTime(options_)),
      instance_(absl::StrCat(getpid(), "@", HostName(), "/", absl::ToUnixMillis(absl::Now()))),
      journal_(options_.journal),
      goodput_(start_time_),
      events_(clock_, start_time_),
      rdzv_(MakeRendezvousConfig(options_)),
      nodes_(clock_, options_.heartbeat_timeout_s),
      policy_(options_.max_restarts, options_.health),
      arbiter_(options_.failure_settle_s, options_.hang_settle_s) {
  message_ = absl::StrCat("waiting for nodes (--nnodes ", NnodesText(), ")");
  precheck_.enabled = options_.precheck;
  precheck_.exclude_stragglers = options_.exclude_stragglers;
  precheck_.coordinator = PrecheckCoordinator(options_.precheck_options);
  const bool resumes = journal_ != nullptr && journal_->recovered();
  if (!resumes && !options_.goodput_before.empty()) {
    const GoodputBefore& b = options_.goodput_before;
    const double now = clock_->Now();
    auto at = [&](double unix_s) { return unix_s > 0 ? FromUnix(now, unix_s) : 0.0; };
    goodput_.Held(b.breakdown, at(b.at_unix_s), b.queued_s, at(b.admitted_unix_s));
  }
  if (journal_ == nullptr) return;
  JobLock lock(&mu_);
  if (resumes) {
    Restore(journal_->state());
    return;
  }
  v1::JournalRecord r;
  v1::JournalJob* job = r.mutable_job();
  job->set_job_id(options_.job_id);
  *job->mutable_spec() = spec_;
  job->set_start_unix_s(UnixNow());
  Record(std::move(r), /*sync=*/true);
}

JobMaster::~JobMaster() { Shutdown(); }

std::string JobMaster::NnodesText() const {
  return Nnodes(options_.min_nodes, options_.max_nodes);
}

// ---------------------------------------------------------------------------
// Validation helpers.

absl::Status JobMaster::CheckSpec(const v1::JobSpec& given) const {
  std::vector<std::string> diffs;
  if ((given.min_nodes() != 0 && given.min_nodes() != spec_.min_nodes()) ||
      (given.max_nodes() != 0 && given.max_nodes() != spec_.max_nodes())) {
    int gmin = given.min_nodes() != 0 ? given.min_nodes() : spec_.min_nodes();
    int gmax = given.max_nodes() != 0 ? given.max_nodes() : spec_.max_nodes();
    diffs.push_back(absl::StrCat("this agent was started with --nnodes ", Nnodes(gmin, gmax),
                                 " but the job master runs --nnodes ", NnodesText(),
                                 "; start the agent with the same --nnodes or without it"));
  }
  if (given.node_unit() != 0 && given.node_unit() != spec_.node_unit()) {
    diffs.push_back(absl::StrCat("this agent was started with --node-unit ", given.node_unit(),
                                 " but the job master runs --node-unit ", spec_.node_unit(),
                                 "; start the agent with the same --node-unit or without it"));
  }
  if (given.has_max_restarts() && given.max_restarts() != spec_.max_restarts()) {
    diffs.push_back(absl::StrCat("this agent was started with --max-restarts ",
                                 given.max_restarts(), " but the job master runs --max-restarts ",
                                 spec_.max_restarts(),
                                 "; start the agent with the same --max-restarts or without it"));
  }
  if (given.has_last_call_s() && given.last_call_s() != spec_.last_call_s()) {
    diffs.push_back(absl::StrCat("this agent was started with --rdzv-conf last_call_timeout=", given.last_call_s(),
                                 " but the job master waits ", spec_.last_call_s(),
                                 " s after the last join (its --last-call); start the agent with the same value or "
                                 "without it"));
  }
  if (!given.run_id().empty() && given.run_id() != spec_.run_id()) {
    diffs.push_back(absl::StrCat("this agent was started with --rdzv-id ", given.run_id(),
                                 " but the job master runs --rdzv-id ", spec_.run_id(),
                                 "; start the agent with the same --rdzv-id or without it"));
  }
  auto health_diff = [&](const char* flag, const std::string& agent, const std::string& master) {
    diffs.push_back(absl::StrCat("this agent was started with ", flag, " ", agent, " but the job master runs ", flag,
                                 " ", master, "; start the agent with the same ", flag, " or without it"));
  };
  if (!given.on_nan().empty() && given.on_nan() != spec_.on_nan()) {
    health_diff("--on-nan", given.on_nan(), spec_.on_nan());
  }
  if (given.has_max_rollbacks() && given.max_rollbacks() != spec_.max_rollbacks()) {
    health_diff("--max-rollbacks", absl::StrCat(given.max_rollbacks()), absl::StrCat(spec_.max_rollbacks()));
  }
  if (given.loss_spike_z() != 0 && given.loss_spike_z() != spec_.loss_spike_z()) {
    health_diff("--loss-spike", absl::StrCat(given.loss_spike_z()),
                spec_.loss_spike_z() > 0 ? absl::StrCat(spec_.loss_spike_z()) : "off");
  }
  if (given.has_replica_check_every() && given.replica_check_every() != spec_.replica_check_every()) {
    health_diff("--replica-check-every", absl::StrCat(given.replica_check_every()),
                absl::StrCat(spec_.replica_check_every()));
  }
  if (given.no_skip_data() && !spec_.no_skip_data()) {
    diffs.push_back("this agent was started with --no-skip-data but the job master skips the bad steps' data; "
                    "start the agent without it or the master with it");
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrJoin(diffs, "; also "));
}

absl::Status JobMaster::CheckRound(const char* what, Round round) const {
  if (round < round_) {
    return absl::AbortedError(absl::StrCat("stale round ", round.value(), " (current is ", round_.value(), ")"));
  }
  if (round > round_) {
    return absl::FailedPreconditionError(absl::StrCat(what, " names round ", round.value(),
                                                      ", which has not started (current is ",
                                                      round_.value(), ")"));
  }
  return absl::OkStatus();
}

bool JobMaster::IsMember(const NodeId& node_id) const {
  return world_.Find(node_id) != nullptr;
}

// ---------------------------------------------------------------------------
// Decisions.

const char* const JobMaster::kAwaitingCheckReason =
    "joining a running job: this node waits for its pre-flight check, which runs while the job trains "
    "(--network-check)";

void JobMaster::Push(const NodeId& node_id, v1::Decision d) {
  // No line, no text: a round pushes one per node.
  const bool logged = spdlog::should_log(spdlog::level::info);
  const std::string what = logged ? DescribeDecision(d) : std::string();
  if (outboxes_.Push(node_id, std::move(d)) && logged) {
    spdlog::info("job={} node={} round={} decision={}", options_.job_id, node_id, round_, what);
  }
}

void JobMaster::PushWait(const NodeId& node_id, const std::string& reason) {
  v1::Decision d;
  d.mutable_wait()->set_reason(reason);
  Push(node_id, std::move(d));
}

std::string JobMaster::SurplusReason() const {
  return absl::StrCat("surplus node: the world is ", world_.num_nodes(), " nodes (--nnodes ",
                      NnodesText(), ", node unit ", options_.node_unit,
                      "); this node waits for the next round");
}

bool JobMaster::WaitingForStartingNodes(double now) const {
  return round_.none() && options_.expected_nodes > rdzv_.size() && rdzv_.size() >= options_.max_nodes &&
         now < rdzv_.last_join_time() + options_.last_call_s;
}

std::string JobMaster::RendezvousWaitReason(double now) const {
  std::string reason =
      absl::StrCat("waiting for nodes: ", rdzv_.size(), " joined (--nnodes ", NnodesText(),
                   ", node unit ", options_.node_unit, ")");
  if (WaitingForStartingNodes(now)) {
    absl::StrAppend(&reason, "; the round starts in ",
                    absl::SixDigits(rdzv_.last_join_time() + options_.last_call_s - now), " s unless the other ",
                    options_.expected_nodes - rdzv_.size(), " starting node(s) (spares) join first");
  } else if (auto s = rdzv_.SecondsUntilReady(now); s.has_value()) {
    if (*s <= 0) {
      absl::StrAppend(&reason, "; the round starts now");
    } else {
      absl::StrAppend(&reason, "; the round starts in ", absl::SixDigits(*s),
                      " s unless more nodes join");
    }
  }
  return reason;
}

void JobMaster::StartRound(const World& world, bool is_restart, const std::string& why) {
  FlushProgress(clock_->Now());  // the old round's last steps count first
  sdc_.NewRound();
  round_ = round_.Next();
  if (is_restart) ++restart_count_;
  state_ = JobState::kRunning;
  goodput_.RoundStarted(clock_->Now());
  below_min_since_.reset();
  below_min_context_.clear();
  done_.clear();
  world_ = world;
  message_ = absl::StrCat("round ", round_.value(), ": ", why);
  spdlog::info("job={} round={} starts: {} nodes, world_size {}, restart_count {} ({})",
               options_.job_id, round_, world.num_nodes(), world.world_size, restart_count_, why);
  events_.Append("round", round_.value(), "",
                 absl::StrCat(why, ": ", world.num_nodes(), " nodes, world size ", world.world_size,
                              is_restart ? absl::StrCat(", restart ", restart_count_) : ""));
  for (auto& [id, rec] : nodes_.mutable_alive()) {
    rec.state = NodeState::kWaiting;
    rec.group_rank = -1;
  }
  for (const auto& m : world.members) {
    if (NodeRecord* rec = nodes_.Find(m.node_id); rec != nullptr) {
      rec->state = NodeState::kTraining;
      rec->group_rank = m.group_rank;
    }
  }
  // On disk before any agent hears of it: a restarted master resumes this round.
  RecordRound();
  for (const auto& m : world.members) Push(m.node_id, MakeStartRound(m, world));
  for (const auto& id : world.surplus) {
    if (Admissible(id)) {
      PushWait(id, SurplusReason());
    } else if (!InRunningCheck(id)) {  // a Wait must not replace its RunCheck
      PushWait(id, kAwaitingCheckReason);
    }
  }
}

v1::Decision JobMaster::MakeStartRound(const MemberAssignment& m, const World& world) const {
  v1::Decision d;
  v1::StartRound* s = d.mutable_start_round();
  s->set_round(round_.value());
  s->set_group_rank(m.group_rank);
  s->set_group_world_size(world.num_nodes());
  s->set_rank_offset(m.rank_offset);
  s->set_world_size(world.world_size);
  s->set_restart_count(restart_count_);
  s->set_max_restarts(options_.max_restarts);
  s->set_run_id(options_.job_id);
  s->set_rollback_below(rollback_below_);
  if (!skip_data_.empty()) s->set_skip_data(skip_data_);  // empty is the default: no string to allocate
  if (!options_.send_round_members) return d;
  auto add = [&](const MemberAssignment& other) {
    v1::RoundMember* rm = s->add_members();
    rm->set_node_id(other.node_id.str());
    rm->set_group_rank(other.group_rank);
    rm->set_local_world_size(other.local_world_size);
    rm->set_rank_offset(other.rank_offset);
    rm->set_host(other.host);
  };
  const int n = world.num_nodes();
  if (m.group_rank == 0 || n <= kFullMemberListNodes) {
    for (const auto& other : world.members) add(other);
    return d;
  }
  // Group rank 0 and the next kRingNeighbors by group rank (members are in
  // group-rank order): what the agent needs besides its own assignment.
  add(world.members[0]);
  for (int k = 1; k <= std::min(kRingNeighbors, n - 1); ++k) {
    const MemberAssignment& other = world.members[(m.group_rank + k) % n];
    if (other.group_rank != 0) add(other);
  }
  return d;
}

void JobMaster::Evaluate(double now) {
  if (finished() || shutdown_) return;
  if (state_ == JobState::kRendezvous) {
    if (WaitingForStartingNodes(now)) return;
    if (PrecheckGate(now)) return;  // the pre-flight check holds the round back
    if (rdzv_.Ready(now)) {
      std::optional<World> world = rdzv_.Form();
      if (world.has_value()) {
        StartRound(*world, /*is_restart=*/false,
                   round_.none() ? "rendezvous complete" : "rendezvous complete after node loss");
      }
      return;
    }
    if (below_min_since_.has_value() && now - *below_min_since_ >= options_.wait_for_nodes_s &&
        rdzv_.UsableNodes() == 0) {
      Finish(false, absl::StrCat("job failed: it needs at least ", options_.min_nodes,
                                 " nodes but has ", rdzv_.size(), " ", below_min_context_,
                                 "; waited ", absl::SixDigits(options_.wait_for_nodes_s),
                                 " s for replacements (lower --nnodes MIN or start more agents)"));
    }
    return;
  }
  // Running: joiners are checked first (with the pre-flight check on); scale
  // up once admissible late joiners make a bigger valid world. Not once a
  // member finished: restarting the round would redo finished training.
  if (JoinerCheckGate(now)) return;
  // (A world at MAX cannot grow: skip counting admissible nodes each tick.)
  if (done_.empty() && world_.num_nodes() < options_.max_nodes && AdmissibleWorldNodes() > world_.num_nodes() &&
      rdzv_.Ready(now)) {
    std::optional<World> world = FormAdmissible();
    if (world.has_value()) {
      StartRound(*world, /*is_restart=*/false,
                 absl::StrCat("scale up from ", world_.num_nodes(), " to ", world->num_nodes(),
                              " nodes"));
    }
  }
}

void JobMaster::EnterBelowMin(const std::string& context, double now) {
  std::string reason = absl::StrCat("too few nodes ", context, ": ", rdzv_.size(),
                                    " left, the job needs ", options_.min_nodes);
  spdlog::warn("job={} round={} {}; stopping workers and waiting up to {} s for nodes",
               options_.job_id, round_, reason, options_.wait_for_nodes_s);
  FlushProgress(now);
  const World stopped = std::move(world_);
  state_ = JobState::kRendezvous;
  goodput_.Rendezvous(now);
  events_.Append("rendezvous", round_.value(), "", reason);
  below_min_since_ = now;
  below_min_context_ = context;
  world_ = World{};
  done_.clear();
  message_ = reason;
  RecordRound();  // before any agent stops its workers
  for (const auto& m : stopped.members) {
    if (!nodes_.IsAlive(m.node_id)) continue;
    v1::Decision d;
    d.mutable_stop_workers()->set_round(round_.value());
    d.mutable_stop_workers()->set_reason(reason);
    Push(m.node_id, std::move(d));
  }
  // The same text for every node (once, not a string per node).
  const std::string wait = absl::StrCat(reason, "; ", RendezvousWaitReason(now));
  for (auto& [id, rec] : nodes_.mutable_alive()) {
    rec.state = NodeState::kWaiting;
    rec.group_rank = -1;
    PushWait(id, wait);
  }
}

void JobMaster::LoseNodes(const std::vector<NodeId>& ids, NodeState how,
                          const std::string& reason, double now, LostList* lost) {
  FlushProgress(now);  // while the lost nodes still count in the world's step
  std::vector<NodeId> gone;
  std::vector<v1::FailureRecord> broke;  // the round's members it lost
  for (const auto& id : ids) {
    if (!nodes_.IsAlive(id)) continue;
    bool member = state_ == JobState::kRunning && IsMember(id);
    // A member whose workers already finished does not break the round: the
    // others finish without it.
    if (member && done_.count(id) == 0 && !finished()) {
      const NodeRecord* rec = nodes_.Find(id);
      v1::FailureRecord r;
      r.set_node_id(id.str());
      r.set_host(rec->spec.host);
      r.set_node_rank(world_.Find(id)->group_rank);
      r.set_global_rank(-1);
      r.set_cause(reason);
      r.set_kind(health::FailureKindName(health::FailureKind::kNodeLost));
      r.set_detection_s(std::max(0.0, now - rec->last_heartbeat));
      broke.push_back(std::move(r));
    }
    nodes_.Remove(id, how, reason);
    rdzv_.Remove(id);
    v1::JournalRecord gone_record;
    gone_record.mutable_node_gone()->set_node_id(id.str());
    gone_record.mutable_node_gone()->set_state(std::string(NodeStateName(how)));
    gone_record.mutable_node_gone()->set_reason(reason);
    Record(std::move(gone_record), /*sync=*/false);  // the round record that follows syncs it
    outboxes_.Remove(id, reason);
    spdlog::warn("job={} node={} round={} lost: {}{}", options_.job_id, id, round_, reason,
                 member ? " (a member of the round)" : "");
    events_.Append("node_lost", round_.value(), id.str(), reason);
    gone.push_back(id);
  }
  if (gone.empty() || finished()) return;
  for (const auto& id : gone) lost->emplace_back(id, reason);
  if (broke.empty()) {
    MaybeSucceed();
    return;
  }
  goodput_.Failure(now);
  std::optional<World> world = FormAdmissible();
  // Waiting nodes (hot spares, early replacements) the new world takes in.
  std::vector<NodeId> promoted;
  if (world.has_value()) {
    for (const auto& m : world->members) {
      if (!IsMember(m.node_id)) promoted.push_back(m.node_id);
    }
  }
  const std::string promoted_text =
      promoted.empty() ? ""
                       : absl::StrCat(promoted.size() == 1 ? "spare node " : "spare nodes ", JoinNodeIds(promoted, ", "),
                                      promoted.size() == 1 ? " takes" : " take", " the place of ",
                                      gone.size() == 1 ? "node " : "nodes ", JoinNodeIds(gone, ", "));
  for (auto& r : broke) {
    r.set_round(round_.value());
    r.set_at_s(now - start_time_);
    r.set_action(!world.has_value() ? "wait for nodes"
                 : promoted.empty()  ? "scale down"
                                     : absl::StrCat("spare ", JoinNodeIds(promoted, ", "), " promoted"));
    AddFailure(std::move(r));
  }
  std::string context =
      gone.size() == 1
          ? absl::StrCat("after node ", gone[0].str(), " was lost (", reason, ")")
          : absl::StrCat("after nodes ", JoinNodeIds(gone, ", "), " were lost (", reason, ")");
  // Recovery speed matters: no last call when the rest still makes a world.
  // The membership change does not use up a restart.
  if (world.has_value()) {
    const int before = world_.num_nodes();
    std::string why;
    if (promoted.empty()) {
      why = absl::StrCat("scale down to ", world->num_nodes(), " nodes ", context);
    } else {
      for (const auto& id : promoted) events_.Append("spare_promoted", round_.value() + 1, id.str(), promoted_text);
      spdlog::info("job={} round={} {} ({})", options_.job_id, round_, promoted_text, context);
      why = world->num_nodes() == before
                ? absl::StrCat(promoted_text, " (the world stays at ", before, " nodes) ", context)
                : absl::StrCat(promoted_text, "; ", world->num_nodes() < before ? "scale down" : "scale up", " to ",
                               world->num_nodes(), " nodes ", context);
    }
    StartRound(*world, /*is_restart=*/false, why);
    return;
  }
  EnterBelowMin(context, now);
}

void JobMaster::MaybeSucceed() {
  if (state_ != JobState::kRunning || world_.members.empty()) return;
  for (const auto& m : world_.members) {
    if (done_.count(m.node_id) == 0) return;
  }
  Finish(true, absl::StrCat("job succeeded: all ", world_.world_size, " workers on ",
                            world_.num_nodes(), " nodes of round ", round_.value(), " exited 0"));
}

void JobMaster::Finish(bool succeeded, const std::string& message) {
  FlushProgress(clock_->Now());
  state_ = succeeded ? JobState::kSucceeded : JobState::kFailed;
  goodput_.Finished(clock_->Now());
  message_ = message;
  outcome_ = JobOutcome{succeeded, message, restart_count_};
  events_.Append("finished", round_.value(), "", message);
  RecordRound();
  if (succeeded) {
    spdlog::info("job={} round={} {}", options_.job_id, round_, message);
  } else {
    spdlog::error("job={} round={} {}", options_.job_id, round_, message);
  }
  for (auto& [id, rec] : nodes_.mutable_alive()) {
    v1::Decision d;
    d.mutable_job_finished()->set_succeeded(succeeded);
    d.mutable_job_finished()->set_message(message);
    Push(id, std::move(d));
  }
  finished_cv_.SignalAll();
}

void JobMaster::Abort(const std::string& message) {
  JobLock lock(&mu_);
  if (finished()) return;
  Finish(false, absl::StartsWith(message, "job failed") ? message : absl::StrCat("job failed: ", message));
}

void JobMaster::Suspended() {
  JobLock lock(&mu_);
  if (finished()) return;
  goodput_.Suspended(clock_->Now());
}

void JobMaster::NotifyLost(const LostList& lost) {
  if (!options_.on_node_lost) return;
  for (const auto& [id, reason] : lost) options_.on_node_lost(id.str(), reason);
}

// ---------------------------------------------------------------------------
// RPCs.

absl::StatusOr<v1::JoinResponse> JobMaster::Join(const v1::JoinRequest& request) {
  const v1::NodeInfo& n = request.node();
  if (n.node_id().empty()) {
    spdlog::warn("job={} join refused: no node_id", options_.job_id);
    return absl::InvalidArgumentError("join without a node_id: the agent must send its node id");
  }
  if (n.node_id().size() > kMaxNameBytes || n.host().size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("join with a node id of ", n.node_id().size(), " bytes and a host of ",
                                                   n.host().size(), " bytes: each must be at most ", kMaxNameBytes));
  }
  if (n.local_world_size() < 1) {
    spdlog::warn("job={} node={} join refused: local_world_size {}", options_.job_id,
                 n.node_id(), n.local_world_size());
    return absl::InvalidArgumentError(
        absl::StrCat("node ", n.node_id(), " asked to run ", n.local_world_size(),
                     " workers: --nproc-per-node must be at least 1"));
  }
  if (absl::Status s = CheckSpec(request.spec()); !s.ok()) {
    spdlog::warn("job={} node={} join refused: {}", options_.job_id, n.node_id(),
                 std::string(s.message()));
    return s;
  }
  JobLock lock(&mu_);
  const NodeId id(n.node_id());
  // A known node re-joining a finished job (its master restarted after the
  // end) is let in to fetch its JobFinished.
  if (finished() && nodes_.IsAlive(id) && outboxes_.Contains(id)) return JoinAnswer();
  if (finished()) {
    spdlog::warn("job={} node={} join refused: job already finished", options_.job_id,
                 n.node_id());
    return absl::FailedPreconditionError(absl::StrCat(
        "job already finished (", JobStateName(state_), "): ", message_));
  }
  if (shutdown_) return absl::UnavailableError("the job master is shutting down");
  if (auto it = precheck_.excluded.find(id); it != precheck_.excluded.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", n.node_id(), " was excluded from the job: ", it->second));
  }
  if (auto it = scheduler_lost_.find(id); it != scheduler_lost_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", n.node_id(), " is gone from the job (", it->second,
                                                      "); a new node takes its place"));
  }
  // An agent started with --network-check turns the pre-flight check on.
  if (request.spec().precheck() && !precheck_.enabled) {
    precheck_.enabled = true;
    spdlog::info("job={} node={} asked for the pre-flight check: enabled", options_.job_id, n.node_id());
    // Members already training keep their places; nodes from now on are checked.
    if (state_ == JobState::kRunning) {
      for (const auto& m : world_.members) precheck_.passed.insert(m.node_id);
    }
  }
  if (request.spec().exclude_stragglers()) precheck_.exclude_stragglers = true;
  if (const NodeRecord* rec = nodes_.Find(id);
      rec != nullptr && IsMember(id) &&
      rec->spec.local_world_size != n.local_world_size()) {
    spdlog::warn("job={} node={} join refused: local_world_size changed {} -> {}",
                 options_.job_id, n.node_id(), rec->spec.local_world_size, n.local_world_size());
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", n.node_id(), " is in round ", round_.value(), " with ", rec->spec.local_world_size,
        " workers and cannot re-join with ", n.local_world_size(),
        "; use a new node id (restart the agent)"));
  }
  double now = clock_->Now();
  NodeSpec spec{id, n.node_rank_hint() >= 0 ? n.node_rank_hint() : -1,
                n.local_world_size(), n.host()};
  bool added = false;
  nodes_.Upsert(spec, n.pid(), &added);
  rdzv_.Join(spec, now);
  RecordNodeUp(spec, n.pid());
  if (!added) {
    // A reconnecting agent: it keeps its place (and its round, if it has one);
    // its next Watch delivers its current decision.
    spdlog::info("job={} node={} round={} re-joined (host {})", options_.job_id, n.node_id(),
                 round_, n.host());
  } else {
    outboxes_.Add(id);
    spdlog::info("job={} node={} round={} joined: host {} pid {} local_world_size {} "
                 "rank_hint {} ({} nodes alive)",
                 options_.job_id, n.node_id(), round_, n.host(), n.pid(), n.local_world_size(),
                 spec.node_rank_hint, rdzv_.size());
    events_.Append("node_joined", round_.value(), n.node_id(), absl::StrCat("host ", n.host(), ", ", n.local_world_size(), " workers"));
    if (state_ == JobState::kRendezvous) {
      PushWait(id, RendezvousWaitReason(now));
    } else if (!Admissible(id)) {
      PushWait(id, kAwaitingCheckReason);
    } else if (done_.empty() && world_.num_nodes() < options_.max_nodes &&
               AdmissibleWorldNodes() > world_.num_nodes()) {
      PushWait(id,
               absl::StrCat("joining: a new round with ", AdmissibleWorldNodes(),
                            " nodes starts after the last call (",
                            absl::SixDigits(options_.last_call_s), " s) unless more nodes join"));
    } else {
      PushWait(id, SurplusReason());
    }
    Evaluate(now);
  }
  return JoinAnswer();
}

v1::JoinResponse JobMaster::JoinAnswer() const {
  v1::JoinResponse resp;
  *resp.mutable_spec() = spec_;
  resp.set_heartbeat_interval_s(options_.heartbeat_interval_s);
  resp.set_heartbeat_timeout_s(options_.heartbeat_timeout_s);
  resp.set_job_id(options_.job_id);
  return resp;
}

absl::Status JobMaster::Leave(const v1::LeaveRequest& request) {
  LostList lost;
  {
    JobLock lock(&mu_);
    const NodeId id(request.node_id());
    std::string reason = request.lost()
                             ? (request.reason().empty() ? "its scheduler reports it gone" : request.reason())
                             : (request.reason().empty() ? "left" : absl::StrCat("left: ", request.reason()));
    TruncateFront(&reason);
    // A node the master lost already (its connection closed first) is gone
    // for good all the same: no re-join.
    if (request.lost() && nodes_.Find(id) != nullptr && scheduler_lost_.emplace(id, reason).second) {
      // Journaled: a master restarted from the journal still refuses its agent.
      v1::JournalRecord r;
      v1::JournalNodeGone* g = r.mutable_scheduler_lost();
      g->set_node_id(id.str());
      g->set_state("dead");
      g->set_reason(reason);
      Record(std::move(r), /*sync=*/true);
    }
    if (!nodes_.IsAlive(id)) return absl::OkStatus();  // idempotent
    LoseNodes({id}, request.lost() ? NodeState::kDead : NodeState::kLeft, reason, clock_->Now(), &lost);
  }
  NotifyLost(lost);
  return absl::OkStatus();
}

absl::Status JobMaster::Heartbeat(const v1::HeartbeatRequest& request) {
  JobLock lock(&mu_);
  return HeartbeatLocked(NodeId(request.node_id()));
}

absl::Status JobMaster::Heartbeats(const std::vector<NodeId>& node_ids) {
  JobLock lock(&mu_);
  absl::Status first;
  for (const NodeId& id : node_ids) first.Update(HeartbeatLocked(id));
  return first;
}

absl::Status JobMaster::HeartbeatLocked(const NodeId& node_id) {
  absl::Status s = nodes_.Heartbeat(node_id);
  if (!s.ok()) {
    spdlog::warn("job={} node={} heartbeat refused: {}", options_.job_id, node_id, std::string(s.message()));
  }
  return s;
}

absl::Status JobMaster::ReportFailure(const v1::FailureReport& received) {
  v1::FailureReport report = received;
  // Oversized text is cut (its end kept), not refused: the failure matters.
  TruncateFront(report.mutable_stderr_tail());
  TruncateFront(report.mutable_cause());
  TruncateFront(report.mutable_hang_top_frame());
  if (!report.kind().empty() && !health::ParseFailureKind(report.kind()).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("failure report of node ", report.node_id(),
                                                   ": unknown failure kind \"", report.kind(),
                                                   "\" (see src/health/failure_class.h for the kinds)"));
  }
  JobLock lock(&mu_);
  const NodeId id(report.node_id());
  const NodeRecord* rec = nodes_.Find(id);
  if (rec == nullptr) {
    spdlog::warn("job={} node={} failure report refused: unknown node", options_.job_id,
                 report.node_id());
    return absl::NotFoundError(absl::StrCat("unknown node ", report.node_id(), ": join again"));
  }
  std::string host = rec->spec.host;
  if (absl::Status s = CheckRound("failure report", Round(report.round())); !s.ok()) {
    spdlog::warn("job={} node={} round={} failure report refused: {} ({})", options_.job_id,
                 report.node_id(), report.round(), std::string(s.message()),
                 FaultPolicy::DescribeWorker(report, host));
    return s;
  }
  if (finished() || state_ != JobState::kRunning) {
    spdlog::info("job={} node={} round={} failure report ignored (job {}): {}", options_.job_id,
                 report.node_id(), report.round(), JobStateName(state_),
                 FaultPolicy::DescribeWorker(report, host));
    return absl::OkStatus();
  }
  if (!IsMember(id)) {
    spdlog::warn("job={} node={} round={} failure report refused: not a member",
                 options_.job_id, report.node_id(), report.round());
    return absl::FailedPreconditionError(
        absl::StrCat("node ", report.node_id(), " is not a member of round ", round_.value()));
  }
  const double settle_s = arbiter_.SettleSeconds(report, world_.members.size());
  const bool other_disconnected = DisconnectedMember(id).has_value();
  if ((settle_s > 0 || other_disconnected) && arbiter_.CanHold()) {
    spdlog::info("job={} node={} round={} failure report held for {:.2f} s{}: {}", options_.job_id,
                 report.node_id(), report.round(), settle_s,
                 other_disconnected ? " and until disconnected nodes are back or lost" : "",
                 FaultPolicy::DescribeWorker(report, host));
    arbiter_.Hold({report, host, clock_->Now()});
    // Held, not decided: a restarted master must still decide it.
    v1::JournalRecord held;
    *held.mutable_failure_held()->mutable_report() = report;
    held.mutable_failure_held()->set_host(host);
    Record(std::move(held), /*sync=*/true);
    return absl::OkStatus();
  }
  HandleFailure(report, host, FailureArbiter::DetectionSeconds(report, 0));
  return absl::OkStatus();
}

std::optional<NodeId> JobMaster::DisconnectedMember(const NodeId& except) const {
  if (!outboxes_.AnyDisconnected()) return std::nullopt;  // the usual case, without a pass over the members
  for (const auto& m : world_.members) {
    if (m.node_id == except) continue;
    if (outboxes_.Disconnected(m.node_id)) return m.node_id;
  }
  return std::nullopt;
}

void JobMaster::DecidePendingFailures(double now) {
  if (arbiter_.held().empty()) return;
  if (finished() || state_ != JobState::kRunning) {
    arbiter_.Clear();
    return;
  }
  for (const FailureArbiter::Held& h : arbiter_.DropStale(round_)) {
    spdlog::info("job={} node={} round={} held failure attributed to the world change (now round "
                 "{}); not counted as a restart",
                 options_.job_id, h.report.node_id(), h.report.round(), round_);
  }
  std::vector<FailureArbiter::Held> due = arbiter_.TakeDue(
      now, world_.members.size(), [this](const NodeId& except) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return DisconnectedMember(except).has_value();
      });
  if (const std::string blame = FailureArbiter::OrderForBlame(&due); !blame.empty()) {
    spdlog::warn("job={} round={} {}", options_.job_id, round_, blame);
  }
  // The policy acts on the first report of the round and logs the rest.
  for (const auto& h : due) {
    if (Round(h.report.round()) != round_ || finished()) break;
    HandleFailure(h.report, h.host, FailureArbiter::DetectionSeconds(h.report, now - h.reported_at));
  }
}

void JobMaster::ApplySdcVerdict(const SdcChecker::Verdict& v) {
  using Kind = SdcChecker::Verdict::Kind;
  if (v.kind == Kind::kPending || v.kind == Kind::kAgree || v.ranks.empty()) return;
  auto member_of = [this](int rank) -> const MemberAssignment* {
    for (const auto& m : world_.members) {
      if (rank >= m.rank_offset && rank < m.rank_offset + m.local_world_size) return &m;
    }
    return nullptr;
  };
  const MemberAssignment* first = member_of(v.ranks.front());
  if (first == nullptr) return;  // not this world's ranks (a stale report)
  std::vector<std::string> where;
  std::vector<NodeId> nodes;
  for (int r : v.ranks) {
    const MemberAssignment* m = member_of(r);
    if (m == nullptr) continue;
    where.push_back(absl::StrCat("rank ", r, " on node ", m->node_id.str(), " (node rank ", m->group_rank, ", host ",
                                 m->host, ")"));
    if (std::find(nodes.begin(), nodes.end(), m->node_id) == nodes.end()) nodes.push_back(m->node_id);
  }
  if (v.kind == Kind::kTieAgain) {
    const std::string msg = absl::StrCat(
        "job failed: silent data corruption that cannot be localized: at step ", v.step, " ", v.detail,
        ", again after recomputing from step ", v.last_agreed_step, "; ", absl::StrJoin(where, ", "),
        ". With two replicas the wrong one cannot be told: check these hosts (ballast run --network-check) or "
        "train with more replicas");
    events_.Append("sdc", round_.value(), first->node_id.str(), msg);
    Finish(false, msg);
    return;
  }
  v1::FailureReport r;
  r.set_node_id(first->node_id.str());
  r.set_round(round_.value());
  r.set_global_rank(v.ranks.front());
  r.set_local_rank(v.ranks.front() - first->rank_offset);
  r.set_kind(health::FailureKindName(health::FailureKind::kSilentCorruption));
  r.set_max_retries(-1);
  r.set_health_step(v.last_agreed_step + 1);
  r.set_cause(absl::StrCat("silent data corruption at step ", v.step, ": ", v.detail,
                           v.kind == Kind::kTie ? "; recomputing from the newest step all replicas agreed on"
                                                : absl::StrCat("; excluding ", absl::StrJoin(where, ", "))));
  spdlog::warn("job={} round={} {}", options_.job_id, round_, r.cause());
  HandleFailure(r, first->host, 0, v.kind == Kind::kBlame ? nodes : std::vector<NodeId>{});
}

void JobMaster::HandleFailure(const v1::FailureReport& report, const std::string& host, double detection_s,
                              const std::vector<NodeId>& exclude) {
  FailureVerdict verdict = policy_.OnFailure(report, host, restart_count_);
  if (verdict.action == FailureAction::kIgnore) {
    spdlog::info("job={} node={} round={} {}", options_.job_id, report.node_id(), report.round(),
                 verdict.message);
    return;
  }
  last_failure_.Clear();
  last_failure_.set_node_id(report.node_id());
  last_failure_.set_round(report.round());
  last_failure_.set_global_rank(report.global_rank());
  last_failure_.set_local_rank(report.local_rank());
  last_failure_.set_exit_code(report.exit_code());
  last_failure_.set_signal(report.signal());
  last_failure_.set_cause(FaultPolicy::DescribeCause(report));
  last_failure_.set_stderr_tail(report.stderr_tail());
  last_failure_.set_host(host);
  last_failure_.set_kind(report.kind());
  const double now = clock_->Now();
  FlushProgress(now);
  v1::FailureRecord rec;
  rec.set_round(report.round());
  rec.set_at_s(now - start_time_);
  rec.set_node_id(report.node_id());
  rec.set_host(host);
  const MemberAssignment* member = world_.Find(NodeId(report.node_id()));
  rec.set_node_rank(member != nullptr ? member->group_rank : -1);
  rec.set_global_rank(report.global_rank());
  rec.set_cause(last_failure_.cause());
  rec.set_kind(report.kind().empty() ? "unknown" : report.kind());
  rec.set_detection_s(detection_s);
  events_.Append("failure", report.round(), report.node_id(),
                 absl::StrCat("rank ", report.global_rank(), ": ", last_failure_.cause()));
  if (verdict.action == FailureAction::kFailJob) {
    rec.set_action("job failed");
    AddFailure(std::move(rec));
    Finish(false, verdict.message);
    return;
  }
  goodput_.Failure(now);
  spdlog::warn("job={} node={} round={} {}", options_.job_id, report.node_id(), report.round(),
               verdict.message);
  const bool rollback = verdict.action == FailureAction::kRollback;
  if (rollback) {
    // The next round drops every step from the bad one on, everywhere, and
    // its workers skip the bad step's samples.
    rollback_below_ = std::max<int64_t>(report.health_step(), 1);
    rollback_round_ = round_.Next();  // the next round, whenever it forms, is the rollback
    rolled_back_below_ = rollback_below_;
    ckpt_.Rewind(rollback_below_);
    if (policy_.health().skip_data && !report.health_data().empty()) {
      if (absl::StatusOr<health::SampleRange> r = health::ParseSampleRange(report.health_data()); r.ok()) {
        skip_data_ = health::AddSampleRange(skip_data_, *r);
      } else {
        spdlog::warn("job={} node={} bad loss report with unusable sample range: {}", options_.job_id,
                     report.node_id(), std::string(r.status().message()));
      }
    }
    const bool sdc = report.kind() == health::FailureKindName(health::FailureKind::kSilentCorruption);
    spdlog::warn("job={} rollback: every checkpoint step from {} on is dropped everywhere{}", options_.job_id,
                 rollback_below_,
                 sdc ? "; the same samples are trained again (the data was fine)"
                 : policy_.health().skip_data && !report.health_data().empty()
                     ? absl::StrCat("; samples ", report.health_data(), " are skipped")
                     : (policy_.health().skip_data ? "; the bad step's samples are unknown (no ElasticSampler)"
                                                   : "; the bad step's samples are trained again (--no-skip-data)"));
    events_.Append("rollback", report.round(), report.node_id(),
                   absl::StrCat("rank ", report.global_rank(), ": ", last_failure_.cause(),
                                "; every rank restarts from the newest checkpoint before step ", rollback_below_,
                                policy_.health().skip_data && !report.health_data().empty()
                                    ? absl::StrCat(", samples ", report.health_data(), " skipped")
                                    : ""));
  }
  const bool straggler = report.kind() == health::FailureKindName(health::FailureKind::kStraggler);
  for (const NodeId& id : exclude) {
    ExcludeNode(id, straggler ? last_failure_.cause()
                              : absl::StrCat("its parameters diverged from the other replicas' (silent data "
                                             "corruption): ",
                                             last_failure_.cause()));
  }
  // Same membership (less the excluded), unless waiting nodes make a bigger valid world.
  std::vector<NodeId> members;
  for (const auto& m : world_.members) {
    if (nodes_.IsAlive(m.node_id) && precheck_.excluded.count(m.node_id) == 0) members.push_back(m.node_id);
  }
  std::optional<World> world;
  if (AdmissibleWorldNodes() > rdzv_.RoundedNodes(static_cast<int>(members.size()))) {
    world = FormAdmissible();
  } else {
    world = rdzv_.FormFrom(members);
  }
  std::string action = rollback ? (exclude.empty() ? "rollback" : "exclude and roll back")
                                : (exclude.empty() ? "restart" : "exclude");
  if (!world.has_value()) action = rollback ? absl::StrCat(action, ", waiting for nodes") : "wait for nodes";
  rec.set_action(action);
  AddFailure(std::move(rec));
  if (world.has_value()) {
    StartRound(*world, /*is_restart=*/true, verdict.message);
  } else {
    // Only when members whose workers had finished were lost since: too few
    // are left to restart the round.
    EnterBelowMin("after a worker failure", now);
  }
}

absl::Status JobMaster::ReportWorkersDone(const v1::WorkersDoneRequest& request) {
  JobLock lock(&mu_);
  const NodeId id(request.node_id());
  NodeRecord* rec = nodes_.Find(id);
  if (rec == nullptr) {
    spdlog::warn("job={} node={} workers-done refused: unknown node", options_.job_id,
                 request.node_id());
    return absl::NotFoundError(absl::StrCat("unknown node ", request.node_id(), ": join again"));
  }
  if (absl::Status s = CheckRound("workers-done report", Round(request.round())); !s.ok()) {
    spdlog::warn("job={} node={} round={} workers-done refused: {}", options_.job_id,
                 request.node_id(), request.round(), std::string(s.message()));
    return s;
  }
  if (finished() || state_ != JobState::kRunning) {
    spdlog::info("job={} node={} round={} workers-done ignored (job {})", options_.job_id,
                 request.node_id(), request.round(), JobStateName(state_));
    return absl::OkStatus();
  }
  if (!IsMember(id)) {
    spdlog::warn("job={} node={} round={} workers-done refused: not a member", options_.job_id,
                 request.node_id(), request.round());
    return absl::FailedPreconditionError(
        absl::StrCat("node ", request.node_id(), " is not a member of round ", round_.value()));
  }
  done_.insert(id);
  rec->state = NodeState::kDone;
  v1::JournalRecord done;
  done.mutable_node_done()->set_node_id(request.node_id());
  done.mutable_node_done()->set_round(round_.value());
  Record(std::move(done), /*sync=*/true);
  spdlog::info("job={} node={} round={} workers done ({} of {} nodes)", options_.job_id,
               request.node_id(), round_, done_.size(), world_.num_nodes());
  MaybeSucceed();
  return absl::OkStatus();
}

absl::Status JobMaster::ReportProgress(const v1::ProgressReport& report, v1::ProgressResponse* response) {
  JobLock lock(&mu_);
  return ReportProgressLocked(NodeId(report.node_id()), report, response);
}

absl::Status JobMaster::ReportProgressFrom(const std::vector<NodeId>& node_ids, const v1::ProgressReport& report) {
  JobLock lock(&mu_);
  absl::Status first;
  for (const NodeId& id : node_ids) first.Update(ReportProgressLocked(id, report, nullptr));
  return first;
}

absl::Status JobMaster::ReportProgressLocked(const NodeId& node_id, const v1::ProgressReport& report,
                                             v1::ProgressResponse* response) {
  NodeRecord* rec = nodes_.Find(node_id);
  if (rec == nullptr) {
    spdlog::warn("job={} node={} progress report refused: unknown node", options_.job_id, node_id);
    return absl::NotFoundError(absl::StrCat("unknown node ", node_id.str(), ": join again"));
  }
  // What an agent heard from this job's master before (this one, or the one
  // before a restart): the fingerprint checker's newest agreed step.
  sdc_.NoteAgreed(report.sdc_agreed_step());
  // Answered whatever happens below: the workers' pinned rollback target
  // follows the newest agreed step (a verdict of this very report included).
  struct Answer {
    const SdcChecker& sdc;
    v1::ProgressResponse* response;
    ~Answer() {
      if (response != nullptr) response->set_sdc_agreed_step(sdc.last_agreed_step());
    }
  } answer{sdc_, response};
  if (report.has_timeline() && report.timeline().round() >= rec->timeline.round()) rec->timeline = report.timeline();
  for (const std::string& e : report.persist_errors()) {
    // The agent retries; the job trains on, its newest durable step older.
    ++persist_errors_total_;
    const MemberAssignment* m = world_.Find(rec->spec.node_id);
    last_persist_error_ = absl::StrCat("node ", node_id.str(), " (node rank ", m != nullptr ? m->group_rank : -1,
                                       ", host ", rec->spec.host, ") ", e);
    spdlog::warn("job={} checkpoint write failed on {} (the agent retries; steps the other ranks wrote wait for it "
                 "to commit)",
                 options_.job_id, last_persist_error_);
    events_.Append("persist_failed", report.round(), node_id.str(), e);
  }
  // Progress of an older round is stale but harmless: keep the newest only.
  if (Round(report.round()) == round_) {
    const double now = clock_->Now();
    // Each new save's stall (averaged over the saves since the last report).
    const bool same_round = rec->progress_round == Round(report.round());
    const int64_t new_saves = report.ckpt_saves() - (same_round ? rec->ckpt_saves : 0);
    const double new_stall = report.ckpt_stall_sum_s() - (same_round ? rec->ckpt_stall_sum_s : 0);
    if (new_saves > 0) {
      ckpt_save_.Observe(std::max(0.0, new_stall) / static_cast<double>(new_saves), static_cast<uint64_t>(new_saves));
    }
    rec->ckpt_saves = report.ckpt_saves();
    rec->ckpt_stall_max_s = report.ckpt_stall_max_s();
    rec->ckpt_stall_sum_s = report.ckpt_stall_sum_s();
    rec->last_step = report.step();
    if (rec->last_step_time_s != report.step_time_s() || rec->last_compute_time_s != report.compute_time_s() ||
        rec->progress_round != Round(report.round())) {
      ++straggler_inputs_;
    }
    rec->last_step_time_s = report.step_time_s();
    rec->last_compute_time_s = report.compute_time_s();
    rec->progress_round = Round(report.round());
    rec->step_reached_at = now - std::max(0.0, report.step_age_s());
    rec->first_step_known = report.first_step_known();
    rec->first_step = report.first_step();
    rec->first_step_at = now - std::max(0.0, report.first_step_age_s());
    for (const v1::Fingerprint& f : report.fingerprints()) {
      ApplySdcVerdict(sdc_.Add(f.rank(), f.step(), f.value(), f.group(), world_.world_size));
      if (Round(report.round()) != round_ || finished()) return absl::OkStatus();  // it rolled back
    }
    // Training resumed after a rollback: later rounds keep the new steps.
    if (rollback_below_ != 0 && report.first_step_known() && round_ >= rollback_round_) {
      rollback_below_ = 0;
      RecordRound();
    }
    // Folded into the world's step at the next tick or state change: a
    // report costs O(1), not a pass over every member (10,000 nodes report
    // each second).
    progress_dirty_ = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ShardDurableResponse> JobMaster::ReportShardDurable(
    const v1::ShardDurableReport& report) {
  if (report.dir().empty()) return absl::InvalidArgumentError("ReportShardDurable needs the checkpoint dir");
  if (report.world_size() < 1 || report.rank() < 0 || report.rank() >= report.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("ReportShardDurable: rank ", report.rank(),
                                                   " is outside world size ", report.world_size()));
  }
  JobLock lock(&mu_);
  if (report.round() < rollback_round_.value() && report.step() >= rolled_back_below_) {
    // Written before a rollback dropped it (a persist finishing late): the
    // agents deleted it or will; it must not become `latest`.
    spdlog::info("job={} node={} rank={} checkpoint step {} of round {} dropped: a rollback in round {} discarded "
                 "steps from {} on",
                 options_.job_id, report.node_id(), report.rank(), report.step(), report.round(),
                 rollback_round_.value(), rolled_back_below_);
    v1::ShardDurableResponse response;
    response.set_commit(false);
    return response;
  }
  const CkptCommitTracker::Result r = ckpt_.Report(report.dir(), report.step(), report.rank(), report.world_size());
  v1::ShardDurableResponse response;
  response.set_commit(r.commit);
  response.set_committed_step(r.committed_step);
  if (r.world_changed) {
    spdlog::warn("job={} checkpoint step {} in {}: world size changed to {}; recounting shards", options_.job_id,
                 report.step(), report.dir(), report.world_size());
  }
  if (report.step() <= r.committed_step && !r.commit) return response;  // already complete: nothing new
  // A commit is on disk before its reporter writes `latest`.
  v1::JournalRecord shard;
  *shard.mutable_shard() = report;
  Record(std::move(shard), /*sync=*/r.commit);
  if (r.commit) {
    spdlog::info("job={} checkpoint step {} durable on all {} ranks in {}; node={} rank={} commits it",
                 options_.job_id, report.step(), report.world_size(), report.dir(), report.node_id(), report.rank());
  } else {
    spdlog::debug("job={} node={} rank={} round={} checkpoint step {} durable", options_.job_id, report.node_id(),
                  report.rank(), report.round(), report.step());
  }
  return response;
}

absl::Status JobMaster::KvSet(const std::string& key, std::string value) {
  RETURN_IF_ERROR(KvStore::CheckEntry(key, value));
  KvStore::Answers woken;
  {
    JobLock lock(&mu_);
    spdlog::debug("job={} kv set {} ({} bytes)", options_.job_id, key, value.size());
    RETURN_IF_ERROR(kv_.CanSet(key));
    v1::JournalRecord r;
    r.mutable_kv()->set_key(key);
    r.mutable_kv()->set_value(value);
    // A round's endpoint is read by the other agents right after: keep it.
    Record(std::move(r), /*sync=*/absl::StartsWith(key, "round/"));
    RETURN_IF_ERROR(kv_.Set(key, std::move(value), &woken));
  }
  KvStore::RunAnswers(&woken);
  return absl::OkStatus();
}

uint64_t JobMaster::KvGetAsync(const std::string& key, double wait_s, KvCallback done) {
  absl::StatusOr<std::string> now_answer;
  {
    JobLock lock(&mu_);
    if (const std::string* v = kv_.Find(key); v != nullptr) {
      now_answer = *v;
    } else if (shutdown_) {
      now_answer = absl::UnavailableError("the job master is shutting down");
    } else if (wait_s <= 0) {
      now_answer = absl::NotFoundError(absl::StrCat("key ", key, " is not set"));
    } else {
      return kv_.AddWaiter(key, absl::Now() + absl::Seconds(wait_s), std::move(done));
    }
  }
  done(std::move(now_answer));
  return 0;
}

void JobMaster::CancelKvWait(uint64_t id) {
  KvCallback done;
  {
    JobLock lock(&mu_);
    done = kv_.TakeWaiter(id);
  }
  if (done) done(absl::CancelledError("KvGet cancelled"));
}

absl::StatusOr<std::string> JobMaster::KvGet(const std::string& key, double wait_s,
                                             const std::function<bool()>& cancelled) {
  // A blocking wrapper over KvGetAsync: one waiting mechanism for both.
  struct Answer {
    absl::Notification done;
    absl::StatusOr<std::string> value;
  };
  auto answer = std::make_shared<Answer>();
  const uint64_t id = KvGetAsync(key, wait_s, [answer](absl::StatusOr<std::string> v) {
    answer->value = std::move(v);
    answer->done.Notify();
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(std::max(wait_s, 0.0));
  bool timed_out = false;
  while (!answer->done.HasBeenNotified()) {
    timed_out = absl::Now() >= deadline;
    if (timed_out || (cancelled && cancelled())) {
      CancelKvWait(id);  // answers CANCELLED unless the value came first
      break;
    }
    // Short slices so a cancelled RPC is noticed without a signal.
    answer->done.WaitForNotificationWithTimeout(std::min(deadline - absl::Now(), absl::Milliseconds(100)));
  }
  answer->done.WaitForNotification();
  if (timed_out && absl::IsCancelled(answer->value.status())) {
    return absl::DeadlineExceededError(
        absl::StrCat("key ", key, " is not set after waiting ", absl::SixDigits(wait_s), " s"));
  }
  return std::move(answer->value);
}

// ---------------------------------------------------------------------------
// Watch streams.

absl::StatusOr<JobMaster::WatchHandle> JobMaster::OpenWatch(const std::string& node_id) {
  return OpenWatch(node_id, nullptr);
}

absl::StatusOr<JobMaster::WatchHandle> JobMaster::OpenWatch(const std::string& node_id,
                                                            std::shared_ptr<DecisionSink> sink) {
  JobLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("the job master is shutting down");
  const NodeId id(node_id);
  if (!outboxes_.Contains(id) || !nodes_.IsAlive(id)) {
    spdlog::warn("job={} node={} watch refused: unknown node", options_.job_id, node_id);
    return absl::NotFoundError(absl::StrCat("unknown node ", node_id, ": join again"));
  }
  bool replaced = false;
  absl::StatusOr<WatchHandle> handle = outboxes_.Open(id, std::move(sink), &replaced);
  if (handle.ok()) {
    spdlog::info("job={} node={} round={} watch stream opened{}", options_.job_id, node_id, round_,
                 replaced ? " (replaces the older stream)" : "");
  }
  return handle;
}

absl::StatusOr<std::optional<v1::Decision>> JobMaster::NextDecision(const WatchHandle& handle,
                                                                    double timeout_s) {
  JobLock lock(&mu_);
  return outboxes_.Next(handle, timeout_s, &mu_);
}

void JobMaster::MarkFinalSent(const WatchHandle& handle) {
  JobLock lock(&mu_);
  outboxes_.MarkFinalSent(handle);
}

void JobMaster::CloseWatch(const WatchHandle& handle) {
  JobLock lock(&mu_);
  if (!outboxes_.Close(handle, clock_->Now()) || shutdown_ || finished()) return;
  const NodeId& id = handle.node_id;
  if (!nodes_.IsAlive(id)) return;
  spdlog::info("job={} node={} round={} watch stream closed: the node is lost unless its agent reconnects within {} s",
               options_.job_id, id, round_, options_.disconnect_grace_s);
  if (options_.on_node_disconnected) options_.on_node_disconnected(id.str());
}

bool JobMaster::AllFinalDecisionsSent() const {
  JobLock lock(&mu_);
  return outboxes_.AllFinalSent();
}

// ---------------------------------------------------------------------------
// Time and lifecycle.

void JobMaster::Tick() {
  LostList lost;
  KvStore::Answers expired;  // answered after the lock, like the lost-node callbacks
  {
    JobLock lock(&mu_);
    kv_.TakeExpired(absl::Now(), &expired);
    if (!shutdown_ && !finished()) TickLocked(&lost);
  }
  KvStore::RunAnswers(&expired);
  NotifyLost(lost);
}

void JobMaster::TickLocked(LostList* lost) {
  double now = clock_->Now();
  FlushProgress(now);
  CheckStragglers(now);
  std::vector<NodeId> silent = nodes_.SilentNodes();
  if (!silent.empty()) LoseNodes(silent, NodeState::kDead, "heartbeat timeout", now, lost);
  if (options_.disconnect_grace_s > 0) {
    const std::vector<NodeId> gone = outboxes_.DisconnectedFor(now, options_.disconnect_grace_s);
    if (!gone.empty()) {
      LoseNodes(gone, NodeState::kDead,
                absl::StrCat("agent disconnected: its decision stream closed and it did not "
                             "reconnect within ",
                             options_.disconnect_grace_s, " s"),
                now, lost);
    }
  }
  DecidePendingFailures(now);
  Evaluate(now);
  MaybeRecordGoodput(now);
}

std::optional<JobOutcome> JobMaster::outcome() const {
  JobLock lock(&mu_);
  return outcome_;
}

std::optional<JobOutcome> JobMaster::WaitForFinish(double timeout_s) {
  JobLock lock(&mu_);
  absl::Time deadline =
      timeout_s < 0 ? absl::InfiniteFuture() : absl::Now() + absl::Seconds(timeout_s);
  while (!outcome_.has_value() && !shutdown_) {
    if (finished_cv_.WaitWithDeadline(&mu_, deadline)) break;  // timed out
  }
  return outcome_;
}

void JobMaster::Shutdown() {
  KvStore::Answers done;
  {
    JobLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    events_.Close();
    outboxes_.Shutdown();
    finished_cv_.SignalAll();
    kv_.TakeAll(absl::UnavailableError("the job master is shutting down"), &done);
  }
  KvStore::RunAnswers(&done);
}

}  // namespace ballast::master
