// StatusView: how the job looks to people and tools (`ballast status`,
// GET /api/v1/job, the dashboard, the ElasticJob's .status): the parts of a
// v1::JobStatus rendered from the master's components, read-only. One
// component of the JobMaster, whose Status() (job_master_status.cc) gathers
// the inputs under the job lock and calls these.
//
// Threading: stateless functions; the caller holds whatever guards the inputs.
#pragma once

#include <map>
#include <string>

#include "ballast/v1/master.pb.h"
#include "master/goodput.h"
#include "master/node_table.h"

namespace ballast::master::status_view {

// A node's state as status shows it: the node table's state, unless the
// node was excluded, is in a running pre-flight check, or is a hot spare (a
// node waiting outside a running world: it takes the next lost node's place).
std::string NodeStateText(NodeState table_state, bool excluded, bool checking, bool spare);

// One node's entry; step_time_s 0: unknown; reason: why it is gone or
// excluded ("" for a node in the job).
void AddNode(const NodeRecord& rec, const std::string& state, const std::string& reason, double now,
             double step_time_s, bool straggler, bool disconnected, v1::JobStatus* st);

// The goodput breakdown, or why it is unknown (no step reported yet).
void FillGoodput(const GoodputAccountant::Breakdown& b, v1::Goodput* g);

// Where each rank's flash-checkpoint replicas are: the replica records the
// agents keep in the KV store (common/replica_record.h), by rank and copy.
// Entries that are not replica records are skipped.
void AddReplicaLocations(const std::map<std::string, std::string>& kv, v1::JobStatus* st);

// The job's step over time (the dashboard's step-rate chart).
void AddStepHistory(const StepHistory& history, v1::JobStatus* st);

}  // namespace ballast::master::status_view
