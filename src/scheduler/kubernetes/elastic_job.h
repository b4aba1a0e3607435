// The ElasticJob custom resource (ballast.dev/v1alpha1, deploy/01-crd.yaml)
// as the master and the operator read it, and the objects built from it: the
// worker pods (one per node rank and incarnation), the master pod, its
// Service, Secret, ServiceAccount and RoleBinding. Pure functions over JSON:
// no I/O, so every rule here is unit-tested.
//
// Names and labels (what `kubectl get pods -l ...` selects on):
//   <job>-worker-<rank>-<incarnation>   ballast.dev/job=<job> ballast.dev/role=worker
//                                       ballast.dev/node-rank=<rank> ballast.dev/incarnation=<n>
//   <job>-master-<generation>           ballast.dev/job=<job> ballast.dev/role=master
//   <job>-master (Service, ServiceAccount, RoleBinding), <job>-token (Secret, key "token")
// Every object has an owner reference to the ElasticJob: deleting the job
// deletes them (the garbage collector).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "health/health_policy.h"
#include "kube/kube_client.h"

namespace ballast::scheduler::kubernetes {

using kube::Json;

inline constexpr char kApiGroup[] = "ballast.dev";
inline constexpr char kApiVersion[] = "ballast.dev/v1alpha1";
inline constexpr char kKind[] = "ElasticJob";
inline constexpr char kPlural[] = "elasticjobs";
inline constexpr char kJobLabel[] = "ballast.dev/job";
inline constexpr char kRoleLabel[] = "ballast.dev/role";
inline constexpr char kRankLabel[] = "ballast.dev/node-rank";
inline constexpr char kIncarnationLabel[] = "ballast.dev/incarnation";
inline constexpr char kMasterJournalDir[] = "/var/lib/ballast/journal";
inline constexpr char kTokenKey[] = "token";
inline constexpr int kMasterPort = 29400;
inline constexpr int kMasterHttpPort = 29401;  // dashboard, /api/v1/*, /metrics
// On the job's master Lease (<job>-master, coordination.k8s.io): host:port
// where the master holding it serves. Agents read it when they lose their
// master (BALLAST_MASTER_LEASE = ns/name in the worker pods).
inline constexpr char kMasterEndpointAnnotation[] = "ballast.dev/master-endpoint";
inline constexpr char kMasterLeaseEnv[] = "BALLAST_MASTER_LEASE";
// How long agents wait for a lost master (Tunables reconnect_timeout_s).
inline constexpr char kReconnectTimeoutEnv[] = "BALLAST_RECONNECT_TIMEOUT_S";
// The exit code of a job master that stopped because its job was suspended
// (or deleted): it touched nothing after it saw that. The operator starts the
// next master when the job is resumed, as a resume (event Resumed), never as
// a master restart. (3: it lost the job's Lease to another master.)
inline constexpr int kMasterExitSuspended = 4;
// Set by the operator while Kueue admits fewer worker pods than MAX + spares
// (partial admission): the job runs with at most that many (its spares give
// way first, then MAX).
inline constexpr char kAdmittedWorkersAnnotation[] = "ballast.dev/kueue-admitted-workers";

struct ElasticJobSpec {
  std::string ns, name, uid;
  int min_nodes = 1, max_nodes = 1;
  int nproc_per_node = 1;
  int node_unit = 1;
  int spares = 0;
  int max_restarts = 3;
  int max_replacements = 3;
  bool network_check = false;
  bool exclude_stragglers = false;
  double hang_timeout_s = 0;
  // spec.onNan, maxRollbacks, lossSpike, skipData (health/health_policy.h).
  health::HealthPolicy health;
  std::string warm_modules;  // spec.warmModules: --warm-modules of the agents
  std::string save_every;    // spec.saveEvery: --save-every ("N", "auto", "auto:MAX"; "" = every save copies)
  std::string mtbf;          // spec.mtbf: --mtbf (a duration: "90m", "6h"; "" = the default prior)
  double ckpt_copy_share = 0;  // spec.ckptCopyShare: --ckpt-copy-share (0 < F <= 1; 0 = the agents' default)
  std::string checkpoint_dir;
  int pending_timeout_s = 120;
  bool cordon_bad_nodes = false;
  bool suspend = false;
  // The MAX and spares of spec.nodes / spec.spares as written, before a
  // partial admission lowered max_nodes and spares (kAdmittedWorkersAnnotation).
  int requested_max_nodes = 1, requested_spares = 0;
  std::string master_image;
  Json pod_template;  // spec.template

  std::string TokenSecret() const { return name + "-token"; }
  std::string MasterName() const { return name + "-master"; }  // Service, ServiceAccount, RoleBinding
  std::string WorkerPodName(int node_rank, int incarnation) const;
  std::string WorkerSelector() const;  // "ballast.dev/job=<job>,ballast.dev/role=worker"
  std::string MasterSelector() const;
  std::string Describe() const { return ns + "/" + name; }
};

// Reads an ElasticJob object. kInvalidArgument naming the field
// ("spec.nodes: ...") for what the schema cannot catch (or when it was not
// installed).
absl::StatusOr<ElasticJobSpec> ParseElasticJob(const Json& object);

// The user's training command (container command + args) as the tail of a
// `ballast run` command line: [--python PY] [--module] SCRIPT ARGS... for
// `python[3[.x]] [-u] script.py ...` and `python -m pkg.mod ...`, else
// `--no-python PROGRAM ARGS...` (run as it is).
std::vector<std::string> WrapTrainingCommand(const std::vector<std::string>& command);

struct WorkerPodParams {
  int node_rank = 0;
  int incarnation = 1;
  std::string master_endpoint;             // host:port the agents reach the master at
  std::vector<std::string> avoid_hosts;    // node names (kubernetes.io/hostname) not to run on
  std::string ballast = "ballast";         // the binary in the image
};

// The worker pod: the template's pod with restartPolicy Never, labels, owner
// reference, and its first container's command wrapped in `ballast run`
// (rendezvous endpoint, node range, rank, its pod IP as --local-addr) with
// BALLAST_TOKEN from the job's Secret, BALLAST_NODE_ID = the pod name,
// BALLAST_POD_IP, BALLAST_CKPT_DIR, BALLAST_CHAOS_INCARNATION = the
// incarnation, BALLAST_MASTER_LEASE = ns/<job>-master (where a moved master
// is found), BALLAST_RECONNECT_TIMEOUT_S = 900 unless the template sets it; avoid_hosts become required node
// anti-affinity. kInvalidArgument naming the template field when the
// template has no container or no command.
absl::StatusOr<Json> BuildWorkerPod(const ElasticJobSpec& job, const WorkerPodParams& params);

// The owner reference to the job, for everything created for it.
Json OwnerReference(const ElasticJobSpec& job);

// --- what the operator creates ---
struct MasterPodParams {
  int generation = 1;                 // <job>-master-<generation>
  std::string image;                  // job.master_image or the operator's image
  std::string advertise = "service";  // "service": the Service's DNS name; "pod-ip": its own pod IP
  std::string ballast = "ballast";
  // Where the master keeps its journal (an emptyDir volume mounted there; the
  // master writes under a folder named after its pod's uid): a master process
  // that dies is restarted in its pod and resumes the job, its worker pods
  // training on. "": no journal.
  std::string journal_dir = kMasterJournalDir;
};
Json BuildMasterPod(const ElasticJobSpec& job, const MasterPodParams& params);
Json BuildMasterService(const ElasticJobSpec& job);
Json BuildTokenSecret(const ElasticJobSpec& job, const std::string& token);
Json BuildMasterServiceAccount(const ElasticJobSpec& job);
Json BuildMasterRoleBinding(const ElasticJobSpec& job);
// <job>-worker: ClusterRole ballast-worker (get leases) for the service
// account the worker pods run as (the template's, else "default"), so an
// agent that lost its master finds the next one in the job's Lease.
Json BuildWorkerRoleBinding(const ElasticJobSpec& job);

// RFC 3339 UTC time ("2026-12-01T10:00:00Z") for status and events.
std::string Rfc3339Now();
// With microseconds (status fields that time is measured from), e.g.
// "2027-01-15T08:00:00.250000Z".
std::string Rfc3339Precise(absl::Time t);
// An RFC 3339 time as the API server writes it (fractional seconds
// optional); nullopt when empty or malformed.
std::optional<absl::Time> ParseRfc3339(const std::string& text);

// A core/v1 Event about the ElasticJob `job` (its metadata: namespace, name,
// uid): what `kubectl describe elasticjob` lists. The message is cut to 1000
// characters.
Json BuildJobEvent(const Json& job_metadata, const std::string& reason, const std::string& message, bool warning,
                   const std::string& component);

}  // namespace ballast::scheduler::kubernetes
