// The master of one ElasticJob on Kubernetes (`ballast master
// --kubernetes-job NAME`, run by the operator in the job's master pod): reads
// the job, serves the rendezvous, creates and replaces the worker pods
// (KubernetesScheduler under NodeManager: the same replacement policy as
// every backend), and keeps the ElasticJob's .status and events current
// (phase, round, world, restarts, replacements, conditions; pod replaced,
// node excluded, scaled down/up, restarted, failed with reason).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "ballast/v1/master.pb.h"
#include "kube/kube_client.h"
#include "master/master_server.h"
#include "scheduler/kubernetes/elastic_job.h"
#include "scheduler/kubernetes/job_fence.h"

namespace ballast::scheduler::kubernetes {

struct KubernetesJobOptions {
  std::string job_name;
  std::string ns;              // "" = the kube config's namespace (the pod's own in-cluster)
  std::string kubeconfig;      // "" = KubeConfig::Load's order
  std::string bind_host = "0.0.0.0";
  int port = kMasterPort;
  std::string advertise_host;  // what agents dial; "" = the bind host
  std::string token;           // required (the job's Secret, via BALLAST_TOKEN)
  std::string ballast = "ballast";
  std::string pod_name;        // this master's pod, for .status.masterPod
  // The master's journal (`ballast master --journal`): "" none. When it holds
  // the job (an earlier master process in this pod died), the master resumes
  // it and takes over the worker pods instead of starting new ones.
  std::string journal_dir;
  // The dashboard, /api/v1/job, /api/v1/events and /metrics (the job token,
  // unless metrics_public): -1 off.
  int http_port = kMasterHttpPort;
  bool metrics_public = false;
};

// Runs the job to its end. Returns the exit code: 0 succeeded, 1 failed (or
// could not start), 2 the ElasticJob is invalid, 128+N when *signal became N.
int RunKubernetesJob(const KubernetesJobOptions& options, const std::atomic<int>* signal);

// status.time: the job's wall time by part, as the master's goodput splits
// it ({"at": RFC 3339, "wallSeconds", "parts": {"productive": s, ...},
// "stepsSeen", "highWaterStep", "recomputedSteps"}). A master that starts
// the job anew (after a preemption or suspension, or without the state of
// the last master) carries on from it: GoodputBeforeFrom.
kube::Json StatusTime(const v1::Goodput& goodput, absl::Time at);
// What came before a fresh master, from the job's .status: time
// (StatusTime), queuedSeconds, admittedAt.
master::GoodputBefore GoodputBeforeFrom(const kube::Json& status);

// Writes an ElasticJob's .status and posts core/v1 Events about it, on a
// thread of its own so the caller never waits for the API server. Status goes
// through server-side apply on the status subresource (field manager
// "ballast-master"), only when it changed, always with every field this
// master set so far (an applied field left out would be removed). The
// operator writes its own fields (masterRestarts) with optimistic
// concurrency; the two never overwrite each other's.
class JobStatusWriter {
 public:
  JobStatusWriter(kube::KubeClient* client, const ElasticJobSpec& job, std::string pod_name);
  ~JobStatusWriter();  // sends what is queued, then stops

  // From the master's status: phase, round, world, restarts, conditions;
  // round changes become events (Started, Restarted, ScaledDown, ScaledUp).
  void Update(const v1::JobStatus& status, int replacements);
  // Final: Succeeded or Failed, with the message and an event.
  void Finish(bool succeeded, const std::string& message, int restarts, int replacements,
              const v1::Goodput& goodput = v1::Goodput());
  void Event(const std::string& reason, const std::string& message, bool warning);
  // Sets .status fields (merged into what this master applied before), e.g.
  // {"phase": "Failed", "message": ...}, and applies the whole.
  void Patch(const kube::Json& fields);
  // A master that resumed the job: carries on from the .status an earlier
  // master process wrote (its fields stay applied; no second Started event).
  void Resume(const kube::Json& status);
  // Fencing: asked before each write; false (this master lost the job's
  // Lease) drops it.
  void SetGate(std::function<bool()> may_write);
  // A suspended job (job_fence.h): status is written through
  // JobFence::ApplyStatus (never over the operator's phase Suspended), and an
  // event only after a read of the job says it is not suspended. Borrowed;
  // set before the first write.
  void SetFence(JobFence* fence);

 private:
  void Enqueue(std::function<void()> task);
  void SetCondition(kube::Json* status, const std::string& type, const std::string& reason,
                    const std::string& message);

  kube::KubeClient* const client_;
  const ElasticJobSpec job_;
  const std::string pod_name_;
  std::function<bool()> may_write_;  // set before the first write
  JobFence* fence_ = nullptr;        // likewise
  kube::Json last_;          // the last status compared (the loop thread's copy)
  kube::Json applied_ = kube::Json::object();  // every status field this master owns
  kube::Json conditions_ = kube::Json::array();
  int64_t last_round_ = 0;
  int last_restarts_ = 0;
  int last_nodes_ = 0;
  bool started_ = false;
  // Goodput moves on its own: a change of it alone is written at most this often.
  std::chrono::steady_clock::time_point goodput_written_{};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ballast::scheduler::kubernetes
