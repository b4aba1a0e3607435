// Kueue integration of the ElasticJob kind, the way Kueue's external-framework
// integrations work (Kueue's Configuration lists "ElasticJob.v1alpha1.ballast.dev"
// under integrations.externalFrameworks; deploy/kueue/ has the snippet):
//
//  - an ElasticJob labelled kueue.x-k8s.io/queue-name=Q is a queued job: the
//    operator suspends it (spec.suspend) and keeps one Kueue Workload for it,
//    owned by the job: pod set "master" (1 pod: the master pod's requests)
//    and pod set "workers" (spec.nodes' MAX + spec.spares pods of the job's
//    template; minCount MIN when that is fewer: Kueue's partial admission
//    may admit fewer, and the job then runs with what was admitted). No
//    master or worker pod exists until Kueue admits it;
//  - admitted (status.admission, QuotaReserved and Admitted true): the
//    operator writes each pod set's placement (the node labels and
//    tolerations of the ResourceFlavors Kueue assigned) into the job's
//    template (workers) and an annotation (the master pod), and lifts
//    spec.suspend: the master starts, or resumes from the job's checkpoints;
//  - evicted (condition Evicted true: preempted, its LocalQueue or
//    ClusterQueue stopped, deactivated): the operator suspends the job (its
//    agents persist their newest flash checkpoint to disk as they stop; the
//    master commits it before it exits), and once no pod of the job is left
//    it restores the template and gives the quota back (QuotaReserved false,
//    no admission): Kueue queues the Workload again;
//  - finished (Succeeded or Failed): condition Finished on the Workload, so
//    Kueue frees its quota.
//
// The functions here are pure (JSON in, JSON out): the operator does the I/O.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kube/kube_client.h"
#include "scheduler/kubernetes/elastic_job.h"

namespace ballast::op::kueue {

using kube::Json;

inline constexpr char kQueueNameLabel[] = "kueue.x-k8s.io/queue-name";
inline constexpr char kPriorityClassLabel[] = "kueue.x-k8s.io/priority-class";  // a WorkloadPriorityClass
inline constexpr char kJobUidLabel[] = "kueue.x-k8s.io/job-uid";
inline constexpr char kGroup[] = "kueue.x-k8s.io";
inline constexpr char kApiVersion[] = "kueue.x-k8s.io/v1beta2";  // Kueue v0.17's storage version
inline constexpr char kMasterPodSet[] = "master";
inline constexpr char kWorkerPodSet[] = "workers";
// On the job: the master pod set's placement (JSON {"nodeSelector", "tolerations"})
// while the job is admitted.
inline constexpr char kMasterPlacementAnnotation[] = "ballast.dev/kueue-master-placement";
// On the job: the workers' template nodeSelector and tolerations before the
// admission added to them (JSON), restored when the job is suspended again.
inline constexpr char kOriginalPlacementAnnotation[] = "ballast.dev/kueue-original-placement";

// The LocalQueue an ElasticJob is queued in ("" when it does not use Kueue).
std::string QueueName(const Json& job);

// The job's Workload: "elasticjob-<job>-<5 hex of the job's uid>" (a name the
// job owns for its lifetime; a new job of the same name gets a new one).
std::string WorkloadName(const scheduler::kubernetes::ElasticJobSpec& job);

struct Priority {
  std::string class_name;  // "" = none
  std::string group;       // "kueue.x-k8s.io" (a WorkloadPriorityClass) or "scheduling.k8s.io" (a PriorityClass)
  int value = 0;
};

// The Workload for the job: queue, priority, owner reference, and the two pod
// sets (master_pod: BuildMasterPod's object; its spec is the master pod set's
// template).
Json BuildWorkload(const scheduler::kubernetes::ElasticJobSpec& job, const Json& master_pod, const std::string& queue,
                   const Priority& priority);

enum class State {
  kPending,   // no quota reserved (queued, or waiting for the pods of an eviction to go)
  kAdmitted,  // quota reserved and admitted, not evicted
  kEvicted,   // condition Evicted true: the job must stop
  kFinished,  // condition Finished true
};
const char* StateName(State s);

struct PodSetAssignment {
  std::string name;
  std::vector<std::string> flavors;  // the ResourceFlavors of its resources, deduplicated, in order
  int count = -1;  // -1: not stated (the pod set's count)
};

struct WorkloadView {
  State state = State::kPending;
  std::string cluster_queue;       // of the admission ("" when none)
  bool quota_reserved = false;     // status.admission is set (also while evicted)
  std::string reason, message;     // the Evicted condition's (kEvicted), else QuotaReserved's when false
  std::vector<PodSetAssignment> podsets;
  const PodSetAssignment* PodSet(const std::string& name) const;
};
WorkloadView ReadWorkload(const Json& workload);

// How long the Workload has waited for this admission: from its Requeued
// condition's last transition (an eviction), else from its creation, to now
// (0 when neither time can be read).
double QueuedSeconds(const Json& workload, absl::Time now);

// Where a pod set's pods must run: the node labels and tolerations of its
// flavors (ResourceFlavor spec.nodeLabels, spec.tolerations; flavors maps a
// flavor's name to its object). kFailedPrecondition naming the flavor when
// one is unknown, or two flavors want different values of one label.
struct Placement {
  Json node_selector = Json::object();
  Json tolerations = Json::array();
  Json ToJson() const { return Json{{"nodeSelector", node_selector}, {"tolerations", tolerations}}; }
  static Placement FromJson(const Json& j);
};
absl::StatusOr<Placement> PlacementOf(const PodSetAssignment& assignment, const std::map<std::string, Json>& flavors);

// Adds a placement to a pod spec: its node selector's labels (over the
// spec's own of the same key), its tolerations not already there.
void ApplyPlacement(const Placement& placement, Json* pod_spec);

// The merge patch of the job that starts it under its admission: spec.suspend
// false, the workers' placement in spec.template.spec, the master's in an
// annotation, the template's own placement kept in another (restored by
// SuspendPatch), and, when Kueue admitted fewer worker pods than asked
// (partial admission), that count (k8s::kAdmittedWorkersAnnotation).
Json AdmitPatch(const Json& job, const Placement& master, const Placement& workers, int admitted_workers = -1,
                int requested_workers = 0);
// The merge patch that suspends the job and undoes AdmitPatch's template
// change (nothing when the job carries no admission).
Json SuspendPatch(const Json& job);

// The Workload status merge patch that gives its quota back after an
// eviction, once the job's pods are gone (what Kueue's own job integrations
// do): no admission, QuotaReserved and Admitted false, and Requeued true
// when the eviction was a preemption or node failures (else false).
// reason/message: the Evicted condition's. now: RFC 3339.
Json UnsetQuotaPatch(const Json& workload, const std::string& reason, const std::string& message,
                     const std::string& now);
// The Workload status merge patch that marks it finished (Kueue frees the quota).
Json FinishedPatch(const Json& workload, bool succeeded, const std::string& message, const std::string& now);

}  // namespace ballast::op::kueue
