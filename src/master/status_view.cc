#include "master/status_view.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "common/replica_record.h"

namespace ballast::master::status_view {

std::string NodeStateText(master::NodeState table_state, bool excluded, bool checking, bool spare) {
  if (excluded) return "excluded";
  if (checking) return "checking";
  if (spare) return "spare";
  return std::string(NodeStateName(table_state));
}

void AddNode(const NodeRecord& rec, const std::string& state, const std::string& reason, double now,
             double step_time_s, bool straggler, bool disconnected, v1::JobStatus* st) {
  v1::NodeStatus* ns = st->add_nodes();
  ns->set_node_id(rec.spec.node_id.str());
  ns->set_host(rec.spec.host);
  ns->set_state(state);
  ns->set_reason(reason);
  ns->set_group_rank(rec.group_rank);
  ns->set_local_world_size(rec.spec.local_world_size);
  ns->set_last_heartbeat_age_s(std::max(0.0, now - rec.last_heartbeat));  // restored nodes: ahead
  ns->set_last_step(rec.last_step);
  if (step_time_s > 0) ns->set_step_time_s(step_time_s);
  if (rec.last_compute_time_s > 0) ns->set_compute_time_s(rec.last_compute_time_s);
  ns->set_straggler(straggler);
  ns->set_disconnected(disconnected);
  if (rec.timeline.round() > 0) *ns->mutable_timeline() = rec.timeline;
}

void FillGoodput(const GoodputAccountant::Breakdown& b, v1::Goodput* g) {
  g->set_wall_s(b.wall_s);
  g->set_known(b.steps_seen);
  g->set_goodput(b.steps_seen ? b.goodput() : 0);
  g->set_high_water_step(b.high_water_step);
  g->set_recomputed_steps(b.recomputed_steps);
  for (int p = 0; p < GoodputAccountant::kNumParts; ++p) {
    v1::GoodputPart* part = g->add_parts();
    part->set_part(std::string(GoodputAccountant::PartName(static_cast<GoodputAccountant::Part>(p))));
    part->set_seconds(b.seconds[p]);
  }
  if (!b.steps_seen) {
    g->set_note("goodput unknown: no step reported yet (the training script must call ballast.step() each step)");
  }
}

void AddReplicaLocations(const std::map<std::string, std::string>& kv, v1::JobStatus* st) {
  std::vector<v1::ReplicaLocation> out;
  for (auto it = kv.lower_bound(std::string(kReplicaKeyPrefix));
       it != kv.end() && absl::StartsWith(it->first, kReplicaKeyPrefix); ++it) {
    int rank = 0, copy = 0;
    absl::StatusOr<ReplicaRecord> rec = ReplicaRecord::FromKvValue(it->second);
    if (!ParseReplicaKey(it->first, &rank, &copy) || !rec.ok()) continue;  // not an agent's record
    v1::ReplicaLocation& loc = out.emplace_back();
    loc.set_rank(rank);
    loc.set_copy(copy);
    loc.set_holder(rec->holder);
    loc.set_step(static_cast<int64_t>(rec->step));
    loc.set_world_size(rec->world);
  }
  std::sort(out.begin(), out.end(), [](const v1::ReplicaLocation& a, const v1::ReplicaLocation& b) {
    return std::make_pair(a.rank(), a.copy()) < std::make_pair(b.rank(), b.copy());
  });
  for (v1::ReplicaLocation& loc : out) *st->add_replicas() = std::move(loc);
}

void AddStepHistory(const StepHistory& history, v1::JobStatus* st) {
  for (const auto& p : history.points()) {
    v1::StepSample* s = st->add_step_history();
    s->set_at_s(p.at_s);
    s->set_step(p.step);
  }
}

}  // namespace ballast::master::status_view
