// `ballast operator`: the ElasticJob controller. For each ElasticJob it keeps
// the job's master running, and nothing more: the master (`ballast master
// --kubernetes-job`, in the master pod) creates and replaces the worker pods
// and writes the job's status while it runs.
//
// Reconciling one job (level-triggered: on every change of the job or its
// master pod, and every resync_s):
//  - invalid spec (what the schema cannot catch): status Failed with the
//    message, nothing created;
//  - finished (status Succeeded/Failed): nothing (the pods that succeeded stay
//    for their logs; deleting the job deletes everything);
//  - spec.suspend: the master and worker pods are deleted, status Suspended;
//    resuming starts a new master (the job resumes from its checkpoints),
//    event Resumed. The master fences itself on the suspension
//    (scheduler/kubernetes/job_fence.h: it replaces no pod and never writes
//    over the phase Suspended), so whichever of the two sees it first, the
//    pods stay deleted; a master that exited kMasterExitSuspended is followed
//    by the next one as a resume, never as a master restart;
//  - else: the job token Secret, the master's ServiceAccount and RoleBinding
//    (to ClusterRole ballast-master), the master Service, and a master pod
//    <job>-master-<generation>. A master that exited by itself decided the
//    job (0 succeeded, 1 failed, 2 invalid: the status says so even when its
//    last write was lost); one that was killed, evicted or deleted before the
//    job finished is replaced by the next generation, up to
//    max_master_restarts; then the job fails saying why.
// Everything created has an owner reference to the job, so deleting the job
// deletes all of it (the garbage collector).
//
// Threading: informer threads only queue job keys; Run() reconciles them one
// at a time on the calling thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "kube/informer.h"
#include "kube/kube_client.h"
#include "scheduler/kubernetes/elastic_job.h"

namespace ballast::op {

struct OperatorOptions {
  std::string ns;                        // "" = every namespace
  std::string image;                     // master pod image unless spec.masterImage (BALLAST_IMAGE)
  std::string master_address = "service";  // "service" (its DNS name) or "pod-ip" (clusters without DNS)
  std::string ballast = "ballast";       // the binary in the image
  std::string master_journal = "/var/lib/ballast/journal";  // in the master pods; "" none (BALLAST_MASTER_JOURNAL)
  double resync_s = 10;
  int max_master_restarts = 5;
  // Leader election (several replicas): asked before every reconcile; once
  // false (the leader Lease is lost) Run returns 1 without acting again.
  std::function<bool()> leading;
};

class Operator {
 public:
  Operator(kube::KubeClient* client, OperatorOptions options);
  ~Operator();
  // Runs until *signal is set (returns 0) or options.leading turns false (1).
  int Run(const std::atomic<int>* signal);
  // One reconcile of ns/name (exposed for tests).
  void Reconcile(const std::string& key);

 private:
  void Enqueue(const std::string& key);
  // Reconciles the key again after delay_s (while a suspension's pods go:
  // the operator does not watch worker pods).
  void EnqueueAfter(const std::string& key, double delay_s);
  // False (and says so) once options_.leading turned false.
  bool Leading() const;
  absl::Status EnsureObject(const std::string& api_version, const std::string& plural, const std::string& ns,
                            const kube::Json& object);
  // Merge-patches the job's .status, conditional on the resourceVersion the
  // decision was made from (optimistic concurrency): kAborted when the job
  // changed meanwhile (the key is queued again, to decide afresh).
  absl::Status PatchStatus(const kube::Json& job, const kube::Json& fields);
  void Event(const kube::Json& job, const std::string& reason, const std::string& message, bool warning);
  // Kueue (operator/kueue.h), for a job with a queue-name label: keeps its
  // Workload and follows it (suspends the job until admitted, starts it on
  // admission, stops it on eviction and gives the quota back once its pods
  // are gone: *when_pods_gone, set for an evicted job, is run by the
  // suspended path once it finds no pod of the job left). False when the
  // reconcile ends here this time.
  bool ReconcileKueue(const kube::Json& job, const scheduler::kubernetes::ElasticJobSpec& spec,
                      const std::string& queue, std::function<void()>* when_pods_gone);
  // A queued job finished: condition Finished on its Workload (frees the quota).
  void FinishWorkload(const kube::Json& job);
  // Starts the Workload informer (a change of a job's Workload reconciles the
  // job at once) the first time a queued job is seen.
  void WatchWorkloads();

  kube::KubeClient* const client_;
  const OperatorOptions options_;
  std::unique_ptr<kube::Informer> jobs_;
  std::unique_ptr<kube::Informer> masters_;
  std::unique_ptr<kube::Informer> workloads_;  // only once a job uses Kueue
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<std::string> queue_;  // job keys to reconcile
  std::map<std::string, std::chrono::steady_clock::time_point> later_;  // EnqueueAfter's keys, when due
};

}  // namespace ballast::op
