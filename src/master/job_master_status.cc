// The JobMaster's view of itself (job_master.h): Status() assembled with
// StatusView (status_view.h), the world's progress folded from the members'
// reports (goodput, step history, recovery records), stragglers, and the
// metrics' histograms.
#include "master/job_master.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "health/failure_class.h"
#include "master/status_view.h"
#include "master/straggler.h"
#include "spdlog/spdlog.h"

namespace ballast::master {

void JobMaster::FlushProgress(double now) const {
  if (!progress_dirty_) return;
  progress_dirty_ = false;
  if (state_ == JobState::kRunning) WorldProgress(now);
}

JobMaster::RoundReports JobMaster::CurrentRoundReports() const {
  // Compared among the current round's members only (a time from an older
  // round or another world size says nothing about this one).
  RoundReports r;
  r.current.reserve(world_.members.size());
  r.compute = !world_.members.empty();
  for (const auto& m : world_.members) {
    const NodeRecord* rec = nodes_.Find(m.node_id);
    if (rec == nullptr || rec->progress_round != round_) {
      r.compute = false;
      continue;
    }
    r.current.emplace_back(&m.node_id, rec);
    if (rec->last_compute_time_s <= 0) r.compute = false;
  }
  return r;
}

JobMaster::StragglerTimes JobMaster::RoundStragglerTimes() const {
  // One pass to choose, then only the maps returned (this runs every second
  // and for each status: four maps per call were most of its cost).
  const auto [current, every_compute] = CurrentRoundReports();
  StragglerTimes out;
  out.compute = every_compute;
  for (const auto& [id, rec] : current) out.step_times.emplace(*id, rec->last_step_time_s);
  if (every_compute) {
    for (const auto& [id, rec] : current) out.times.emplace(*id, rec->last_compute_time_s);
  } else {
    out.times = out.step_times;
  }
  return out;
}

void JobMaster::CheckStragglers(double now) {
  if (now - stragglers_checked_at_ < kStragglerCheckIntervalS) return;
  stragglers_checked_at_ = now;
  const auto inputs = std::make_tuple(straggler_inputs_, nodes_.version(), round_.value(), world_.members.size());
  if (stragglers_none_at_ == inputs) return;  // the same times as a check that found none
  {
    // The usual case, no straggler, without a map: the slowest time against
    // FindStragglers' limit, then every compared node marked as no
    // straggler, as the full check would.
    const RoundReports reports = CurrentRoundReports();
    std::vector<double> times;
    times.reserve(reports.current.size());
    for (const auto& [id, rec] : reports.current) {
      times.push_back(reports.compute ? rec->last_compute_time_s : rec->last_step_time_s);
    }
    const double slowest = times.empty() ? 0 : *std::max_element(times.begin(), times.end());
    const std::optional<double> limit = StragglerLimit(std::move(times), options_.straggler_factor);
    if (!limit.has_value() || slowest <= *limit) {
      for (const auto& [id, rec] : reports.current) {
        NodeRecord* r = nodes_.Find(*id);
        r->straggler = false;
        r->straggler_checks = 0;
      }
      stragglers_none_at_ = inputs;
      return;
    }
  }
  const StragglerTimes t = RoundStragglerTimes();
  const std::set<NodeId> stragglers = FindStragglers(t.times, options_.straggler_factor);
  if (stragglers.empty()) {
    stragglers_none_at_ = inputs;
  } else {
    stragglers_none_at_.reset();
  }
  const char* what = t.compute ? "compute time per forward pass" : "step time";
  const NodeRecord* exclude = nullptr;
  std::string why;
  // Once per check, and the text only for a straggler: per node they made
  // each check O(nodes^2 log nodes) (seconds at 10,000 nodes).
  const double median = stragglers.empty() ? 0 : MedianStepTime(t.times);
  for (const auto& [id, time] : t.times) {
    NodeRecord* rec = nodes_.Find(id);
    const bool straggler = stragglers.count(id) > 0;
    const std::string how =
        straggler ? absl::StrFormat("%s %.4g s > %g x the median %.4g s", what, time, options_.straggler_factor, median)
                  : std::string();
    // Say so once when a node turns into a straggler (status shows it always).
    if (straggler && !rec->straggler) {
      spdlog::warn("job={} node={} round={} straggler: {}{}", options_.job_id, id, round_, how,
                   precheck_.exclude_stragglers ? "" : " (--exclude-stragglers would replace it)");
    }
    rec->straggler = straggler;
    rec->straggler_checks = straggler ? rec->straggler_checks + 1 : 0;
    // One node at a time, and never a majority (the median would be wrong).
    if (straggler && rec->straggler_checks >= kStragglerExcludeChecks && exclude == nullptr &&
        stragglers.size() * 2 < t.times.size()) {
      exclude = rec;
      why = absl::StrCat(how, " for ", rec->straggler_checks, " checks in a row");
    }
  }
  if (exclude == nullptr || !precheck_.exclude_stragglers || state_ != JobState::kRunning || finished() ||
      done_.count(exclude->spec.node_id) > 0) {
    return;
  }
  const MemberAssignment* m = world_.Find(exclude->spec.node_id);
  if (m == nullptr) return;
  v1::FailureReport r;
  r.set_node_id(exclude->spec.node_id.str());
  r.set_round(round_.value());
  r.set_global_rank(-1);
  r.set_local_rank(-1);
  r.set_kind(health::FailureKindName(health::FailureKind::kStraggler));
  r.set_max_retries(-1);
  r.set_cause(absl::StrCat("a straggler at runtime (--exclude-stragglers): ", why));
  for (auto& [id, rec] : nodes_.mutable_alive()) rec.straggler_checks = 0;
  HandleFailure(r, exclude->spec.host, kStragglerExcludeChecks * kStragglerCheckIntervalS,
                {exclude->spec.node_id});
}

v1::Goodput JobMaster::GoodputNow() const {
  JobLock lock(&mu_);
  const double now = clock_->Now();
  FlushProgress(now);
  v1::Goodput g;
  status_view::FillGoodput(goodput_.Get(now), &g);
  return g;
}

v1::JobStatus JobMaster::Status() const {
  JobLock lock(&mu_);
  const double now = clock_->Now();
  FlushProgress(now);
  v1::JobStatus st;
  st.set_job_id(options_.job_id);
  st.set_state(JobStateName(state_));
  st.set_round(round_.value());
  st.set_world_size(world_.world_size);
  st.set_restart_count(restart_count_);
  *st.mutable_spec() = spec_;
  const StragglerTimes straggler_times = RoundStragglerTimes();
  const std::map<NodeId, double>& step_times = straggler_times.step_times;
  const std::set<NodeId> stragglers = FindStragglers(straggler_times.times, options_.straggler_factor);
  auto add = [&](const NodeRecord& rec) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const NodeId& id = rec.spec.node_id;
    const bool spare = state_ == JobState::kRunning && rec.state == NodeState::kWaiting && !IsMember(id);
    auto step_time = step_times.find(id);
    auto excluded = precheck_.excluded.find(id);
    const bool is_excluded = excluded != precheck_.excluded.end();
    status_view::AddNode(rec, status_view::NodeStateText(rec.state, is_excluded, InRunningCheck(id), spare),
                         is_excluded ? excluded->second : rec.gone_reason, now,
                         step_time == step_times.end() ? 0 : step_time->second, stragglers.count(id) > 0,
                         rec.state != NodeState::kDead && outboxes_.Disconnected(id), &st);
  };
  // Members in rank order first, then the other alive nodes, then the gone.
  for (const auto& m : world_.members) {
    if (const NodeRecord* rec = nodes_.Find(m.node_id); rec != nullptr) add(*rec);
  }
  for (const auto& [id, rec] : nodes_.alive()) {
    if (!IsMember(id)) add(rec);
  }
  for (const auto& rec : nodes_.gone()) add(rec);
  if (!last_failure_.node_id().empty()) *st.mutable_last_failure() = last_failure_;
  st.set_message(message_);
  st.set_uptime_s(now - start_time_);
  st.set_master_instance(instance_);
  st.set_precheck(precheck_.verdict);
  st.set_persist_errors_total(persist_errors_total_);
  st.set_last_persist_error(last_persist_error_);
  status_view::AddReplicaLocations(kv_.entries(), &st);
  status_view::FillGoodput(goodput_.Get(now), st.mutable_goodput());
  for (const auto& r : failures_.records()) *st.add_failures() = r;
  st.set_failures_total(failures_.total());
  status_view::AddStepHistory(step_history_, &st);
  return st;
}

Histogram JobMaster::RecoveryHistogram() const {
  JobLock lock(&mu_);
  return failures_.recovery();
}

uint64_t JobMaster::decisions_pushed() const {
  JobLock lock(&mu_);
  return outboxes_.pushed();
}

Histogram JobMaster::CkptSaveHistogram() const {
  JobLock lock(&mu_);
  return ckpt_save_;
}

std::map<std::string, int> JobMaster::RecoveriesByKind() const {
  JobLock lock(&mu_);
  return failures_.recovered_by_kind();
}

void JobMaster::WorldProgress(double now) const {
  // The world's step: the lowest of the members' (reached when the last of
  // them reached it), once each reported in this round; its first step: the
  // lowest first step, made when the last node had made its first.
  GoodputAccountant::WorldStep w;
  bool first_known = true;
  for (const auto& m : world_.members) {
    const NodeRecord* r = nodes_.Find(m.node_id);
    if (r == nullptr || r->progress_round != round_) return;
    if (w.step < 0 || r->last_step < w.step) {
      w.step = r->last_step;
      w.reached_at = r->step_reached_at;
    } else if (r->last_step == w.step) {
      w.reached_at = std::max(w.reached_at, r->step_reached_at);
    }
    first_known = first_known && r->first_step_known;
    w.ckpt_stall_s = std::max(w.ckpt_stall_s, r->ckpt_stall_max_s);
    w.first_step = w.first_step < 0 ? r->first_step : std::min(w.first_step, r->first_step);
    w.first_at = std::max(w.first_at, r->first_step_at);
  }
  if (w.step < 0) return;
  if (!first_known) w.first_step = -1;
  if (first_known) {
    std::vector<v1::FailureRecord> completed;
    failures_.Resumed(round_.value(), w.first_at - start_time_, w.first_step, goodput_.high_water_step(), &completed);
    for (auto& rec : completed) {
      v1::JournalRecord r;
      *r.mutable_failure() = std::move(rec);
      Record(std::move(r), /*sync=*/false);
    }
  }
  goodput_.Progress(now, w);
  // A sample once the world made its round's first step: before that a new
  // job's high-water step is 0, not a step reached, and the step-rate chart
  // would draw a burst from 0 to a restored checkpoint's step.
  if (goodput_.training()) step_history_.Add(now - start_time_, goodput_.high_water_step());
}

}  // namespace ballast::master
