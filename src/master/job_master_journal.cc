// JobMaster's journal: what it records (Record*) and how it resumes a job
// from the recorded state (Restore). See journal.h for the format and
// job_master.h for what a restarted master promises.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "master/job_master.h"
#include "spdlog/spdlog.h"

namespace ballast::master {

absl::Status CheckJournalMatches(const JobMasterOptions& o, const v1::JournalJob& job) {
  const v1::JobSpec& spec = job.spec();
  std::vector<std::string> diffs;
  if (!o.job_id.empty() && o.job_id != job.job_id()) {
    diffs.push_back(absl::StrCat("job id ", o.job_id, " (the journal's is ", job.job_id(), ")"));
  }
  if (o.min_nodes != spec.min_nodes() || o.max_nodes != spec.max_nodes()) {
    diffs.push_back(absl::StrCat("--nnodes ", o.min_nodes, ":", o.max_nodes, " (the journal's is ", spec.min_nodes(),
                                 ":", spec.max_nodes(), ")"));
  }
  if (o.node_unit != spec.node_unit()) {
    diffs.push_back(absl::StrCat("--node-unit ", o.node_unit, " (the journal's is ", spec.node_unit(), ")"));
  }
  if (o.max_restarts != spec.max_restarts()) {
    diffs.push_back(absl::StrCat("--max-restarts ", o.max_restarts, " (the journal's is ", spec.max_restarts(), ")"));
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the journal holds job ", job.job_id(), " but this master was started with ", absl::StrJoin(diffs, ", "),
      ": restart it with the job's own settings to resume it, or give a new --journal directory for a new job"));
}

double JobMaster::UnixNow() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

double JobMaster::StartTime(const JobMasterOptions& o) {
  const double now = o.clock->Now();
  if (o.journal == nullptr || !o.journal->recovered()) return now;
  // The job's age by the wall clock.
  return FromUnix(now, o.journal->job().start_unix_s());
}

void JobMaster::Record(v1::JournalRecord record, bool sync) const {
  if (journal_ == nullptr || journal_failed_) return;
  absl::Status s = journal_->Append(std::move(record), sync);
  if (s.ok()) return;
  journal_failed_ = true;
  spdlog::error("job={} cannot write the journal in {}: {}; the job goes on, but a restarted master can no "
                "longer resume it (free the disk or fix the directory, then restart the job to be safe)",
                options_.job_id, journal_->dir(), s.ToString());
}

std::optional<v1::MasterSnapshot> JobMaster::JournalStateAfter(uint64_t seq) const {
  JobLock lock(&mu_);
  if (journal_ == nullptr || journal_failed_ || journal_->last_seq() <= seq) return std::nullopt;
  return journal_->state();
}

void JobMaster::RecordRound() {
  if (journal_ == nullptr) return;
  v1::JournalRecord r;
  v1::JournalRound* jr = r.mutable_round();
  jr->set_state(JobStateName(state_));
  jr->set_round(round_.value());
  jr->set_restart_count(restart_count_);
  for (const auto& m : world_.members) {
    v1::JournalMember* jm = jr->add_members();
    jm->set_node_id(m.node_id.str());
    jm->set_group_rank(m.group_rank);
    jm->set_local_world_size(m.local_world_size);
    jm->set_rank_offset(m.rank_offset);
    jm->set_host(m.host);
  }
  jr->set_world_size(world_.world_size);
  jr->set_message(message_);
  for (const auto& [kind, n] : policy_.restarts_by_kind()) (*jr->mutable_restarts_by_kind())[kind] = n;
  jr->set_decided_round(policy_.decided_round());
  *jr->mutable_last_failure() = last_failure_;
  jr->set_below_min(below_min_since_.has_value());
  jr->set_below_min_context(below_min_context_);
  jr->set_rollback_below(rollback_below_);
  // A new pair makes replay rewind the commit tracker here (ApplyJournalRecord),
  // as HandleFailure's ckpt_.Rewind did just before this record.
  jr->set_rollback_round(rollback_round_.value());
  jr->set_rolled_back_below(rolled_back_below_);
  jr->set_skip_data(skip_data_);
  Record(std::move(r), /*sync=*/true);
}

void JobMaster::RecordPort(int port) {
  JobLock lock(&mu_);
  if (journal_ == nullptr) return;
  v1::JournalRecord r;
  *r.mutable_job() = journal_->job();
  if (r.job().port() == port) return;
  r.mutable_job()->set_port(port);
  Record(std::move(r), /*sync=*/true);
}

void JobMaster::RecordNodeUp(const NodeSpec& spec, int64_t pid) {
  if (journal_ == nullptr) return;
  v1::JournalRecord r;
  v1::NodeInfo* n = r.mutable_node_up();
  n->set_node_id(spec.node_id.str());
  n->set_node_rank_hint(spec.node_rank_hint);
  n->set_local_world_size(spec.local_world_size);
  n->set_host(spec.host);
  n->set_pid(pid);
  Record(std::move(r), /*sync=*/false);
}

void JobMaster::AddFailure(v1::FailureRecord r) {
  v1::JournalRecord jr;
  *jr.mutable_failure() = r;
  Record(std::move(jr), /*sync=*/false);  // the round record that follows syncs it
  failures_.Add(std::move(r));
}

void JobMaster::MaybeRecordGoodput(double now) {
  if (journal_ == nullptr || now - goodput_marked_at_ < kGoodputMarkIntervalS) return;
  goodput_marked_at_ = now;
  const GoodputAccountant::Breakdown b = goodput_.Get(now);
  v1::JournalRecord r;
  v1::JournalGoodput* g = r.mutable_goodput();
  g->set_at_unix_s(UnixNow());
  g->set_wall_s(b.wall_s);
  for (double sec : b.seconds) g->add_seconds(sec);
  g->set_steps_seen(b.steps_seen);
  g->set_high_water_step(b.high_water_step);
  g->set_recomputed_steps(b.recomputed_steps);
  g->set_training(goodput_.training());
  g->set_round_stall_s(goodput_.round_stall_s());
  Record(std::move(r), /*sync=*/false);
}

void JobMaster::Restore(const v1::MasterSnapshot& st) {
  const double now = clock_->Now();
  RestoreRound(st, now);
  RestoreNodes(st, now);
  KvStore::Answers none;  // no waiters yet
  for (const auto& [k, v] : st.kv()) (void)kv_.Set(k, v, &none);
  ckpt_.FromProto(st.ckpt_dirs());
  failures_.Restore(st.failures(), st.failures_total());
  for (const auto& h : st.held()) {
    if (Round(h.report().round()) == round_ && state_ == JobState::kRunning) arbiter_.Hold({h.report(), h.host(), now});
  }
  RestoreGoodput(st, now);
  RestoreDecisions(now);
  if (finished()) outcome_ = JobOutcome{state_ == JobState::kSucceeded, message_, restart_count_};
  const std::string note =
      absl::StrCat("the job master restarted and resumed the job from its journal (", journal_->recovery_note(), "): ",
                   JobStateName(state_), ", round ", round_.value(), ", ", world_.num_nodes(), " members, ", st.nodes_size(),
                   " nodes known, restart count ", restart_count_, "; waiting up to ",
                   absl::SixDigits(2 * options_.heartbeat_timeout_s), " s for their agents to reconnect");
  spdlog::warn("job={} {}", options_.job_id, note);
  events_.Append("master_restarted", round_.value(), "", note);
}

void JobMaster::RestoreRound(const v1::MasterSnapshot& st, double now) {
  const v1::JournalRound& jr = st.round();
  round_ = Round(jr.round());
  restart_count_ = jr.restart_count();
  state_ = jr.state() == "running"     ? JobState::kRunning
           : jr.state() == "succeeded" ? JobState::kSucceeded
           : jr.state() == "failed"    ? JobState::kFailed
                                       : JobState::kRendezvous;
  message_ = jr.message().empty() ? message_ : jr.message();
  last_failure_ = jr.last_failure();
  if (jr.below_min()) below_min_since_ = now;  // the wait for nodes starts again
  below_min_context_ = jr.below_min_context();
  rollback_below_ = jr.rollback_below();
  if (jr.rolled_back_below() > 0) {
    // The last rollback, also once its round trained on: a persist of an
    // older round that finishes after the restart is still refused.
    rollback_round_ = Round(jr.rollback_round());
    rolled_back_below_ = jr.rolled_back_below();
  } else if (rollback_below_ != 0) {
    // A journal written before the record kept the pair.
    rollback_round_ = round_;
    rolled_back_below_ = rollback_below_;
  }
  skip_data_ = jr.skip_data();
  policy_.Restore(jr.decided_round(), {jr.restarts_by_kind().begin(), jr.restarts_by_kind().end()});
  world_ = World{};
  world_.world_size = jr.world_size();
  for (const auto& m : jr.members()) {
    world_.members.push_back(MemberAssignment{NodeId(m.node_id()), m.group_rank(), m.local_world_size(), m.rank_offset(), m.host()});
  }
  for (const auto& [id, why] : st.excluded()) precheck_.excluded[NodeId(id)] = why;
  for (const auto& [id, why] : st.scheduler_lost()) scheduler_lost_[NodeId(id)] = why;
  for (const auto& [id, t] : st.passed()) {
    precheck_.passed.insert(NodeId(id));
    if (t > 0) precheck_.best_times[NodeId(id)] = t;
  }
  if (!st.passed().empty() || !st.excluded().empty()) precheck_.enabled = true;
}

void JobMaster::RestoreNodes(const v1::MasterSnapshot& st, double now) {
  const v1::JournalRound& jr = st.round();
  // Nodes: the round's members first (in rank order, so a re-formed world
  // keeps their order), then the others. Each gets two heartbeat timeouts
  // to reconnect. A member whose loss was recorded but not the round that
  // followed (a crash between the two) comes back from its member entry: its
  // agent reconnects, or it times out and is lost again, as it should be.
  std::vector<v1::NodeInfo> from_members;
  from_members.reserve(jr.members_size());
  std::vector<const v1::NodeInfo*> order;
  for (const auto& m : jr.members()) {
    if (auto it = st.nodes().find(m.node_id()); it != st.nodes().end()) {
      order.push_back(&it->second);
      continue;
    }
    v1::NodeInfo& n = from_members.emplace_back();
    n.set_node_id(m.node_id());
    n.set_node_rank_hint(-1);
    n.set_local_world_size(m.local_world_size());
    n.set_host(m.host());
    order.push_back(&n);
  }
  std::vector<const v1::NodeInfo*> others;
  for (const auto& [id, n] : st.nodes()) {
    if (world_.Find(NodeId(id)) == nullptr) others.push_back(&n);
  }
  // In the order they joined (not the map's): the rendezvous keeps it, and
  // the longest-waiting spare is still the first to take a lost node's place.
  auto joined = [&st](const v1::NodeInfo* n) {
    auto it = st.joined_seq().find(n->node_id());
    return std::make_pair(it != st.joined_seq().end() ? it->second : 0, n->node_id());
  };
  std::sort(others.begin(), others.end(),
            [&](const v1::NodeInfo* a, const v1::NodeInfo* b) { return joined(a) < joined(b); });
  order.insert(order.end(), others.begin(), others.end());
  std::set<NodeId> done;
  for (const auto& d : st.done()) done.insert(NodeId(d.node_id()));
  for (const v1::NodeInfo* n : order) {
    const NodeId id(n->node_id());
    NodeSpec spec{id, n->node_rank_hint(), n->local_world_size(), n->host()};
    NodeRecord& rec = nodes_.Upsert(spec, n->pid());
    // Its agent retries every <= 2 s on a channel that itself backs off
    // <= 2 s: two heartbeat timeouts to come back.
    (void)nodes_.Heartbeat(id, now + options_.heartbeat_timeout_s);
    if (const MemberAssignment* m = world_.Find(id); m != nullptr && state_ == JobState::kRunning) {
      rec.state = done.count(id) > 0 ? NodeState::kDone : NodeState::kTraining;
      rec.group_rank = m->group_rank;
      if (rec.state == NodeState::kDone) done_.insert(id);
    }
    if (precheck_.excluded.count(id) == 0) rdzv_.Join(spec, now);
    outboxes_.Add(id);
  }
  for (const auto& [id, n] : st.nodes()) {
    if (world_.Find(NodeId(id)) == nullptr) world_.surplus.push_back(NodeId(id));
  }
}

void JobMaster::RestoreGoodput(const v1::MasterSnapshot& st, double now) {
  // Goodput carries on from the last mark.
  // A journal of an older release has fewer parts (new ones are appended).
  if (st.goodput().seconds_size() > 0 && st.goodput().seconds_size() <= GoodputAccountant::kNumParts) {
    const v1::JournalGoodput& g = st.goodput();
    GoodputAccountant::Breakdown b;
    for (int p = 0; p < g.seconds_size(); ++p) b.seconds[p] = g.seconds(p);
    b.steps_seen = g.steps_seen();
    b.high_water_step = g.high_water_step();
    b.recomputed_steps = g.recomputed_steps();
    const double mark = FromUnix(now, g.at_unix_s());
    goodput_.Resume(start_time_, std::max(mark, start_time_), b, state_ == JobState::kRunning, g.training(),
                    g.round_stall_s());
  } else if (state_ == JobState::kRunning) {
    goodput_.RoundStarted(start_time_);
  }
}

void JobMaster::RestoreDecisions(double now) {
  // Each node's current decision, re-sent when its agent reconnects: the
  // same StartRound it runs (agents ignore a round they already run), a Wait,
  // or the job's end.
  for (const NodeId& id : outboxes_.Nodes()) {
    v1::Decision d;
    if (finished()) {
      d.mutable_job_finished()->set_succeeded(state_ == JobState::kSucceeded);
      d.mutable_job_finished()->set_message(message_);
    } else if (const MemberAssignment* m = world_.Find(id); m != nullptr && state_ == JobState::kRunning) {
      d = MakeStartRound(*m, world_);
    } else if (precheck_.excluded.count(id) > 0) {
      d.mutable_excluded()->set_reason(precheck_.excluded[id]);
      d.mutable_excluded()->set_rollback_below(rollback_below_);  // as ExcludeNode sent it
    } else {
      d.mutable_wait()->set_reason(state_ == JobState::kRunning ? SurplusReason() : RendezvousWaitReason(now));
    }
    outboxes_.Restore(id, std::move(d));
  }
}

}  // namespace ballast::master
