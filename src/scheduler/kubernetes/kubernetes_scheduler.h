// Kubernetes backend of the scheduler seam: each node is a worker pod built
// from the ElasticJob's template (elastic_job.h), created and deleted through
// the API server and watched with an Informer on the job's worker pods.
//
// What it reports (Poll):
//   kStarted        the pod is Running (host: its Kubernetes node)
//   kExited         the pod ended (Succeeded/Failed) with its trainer
//                   container's exit code or signal; a Failed pod is deleted
//                   at once (never left in Error)
//   kLost           the pod was deleted or evicted by someone else (kubectl
//                   delete, the taint manager, a drain), or could not be created
//   kPendingTooLong the pod is still not running pending_timeout_s after it
//                   was created (reason: the scheduler's PodScheduled message)
// Released pods are deleted with the given grace period and force-deleted
// (grace 0) when they are still there force_delete_after_s later: a pod on a
// dead node stays Terminating until its kubelet comes back.
//
// Creation and deletion run on a small pool of threads, so replacing many
// pods at once is parallel (LaunchNode returns at once). A pod the API server
// refuses as invalid or forbidden makes fatal() non-OK: no replacement can fix
// that, and the job fails with the API server's message.
//
// Start() deletes worker pods of the job that an earlier master left behind
// (their agents lost that master) and waits until they are gone; a master
// that resumed its job from a journal (adopt) takes them over instead: their
// agents reconnect to it and keep training (AdoptedNodes). A worker pod that
// shows up later without this scheduler having asked for it (an earlier
// master's create that completed after that master died) is deleted.
//
// Threading: LaunchNode/ReleaseNode/Poll/StopAll from one thread; the
// informer thread and the pool threads share state under mu_.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kube/informer.h"
#include "kube/kube_client.h"
#include "scheduler/kubernetes/elastic_job.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler::kubernetes {

struct KubernetesSchedulerOptions {
  kube::KubeClient* client = nullptr;  // borrowed, must outlive the scheduler
  ElasticJobSpec job;
  std::string master_endpoint;          // what the agents dial
  std::string ballast = "ballast";      // the binary in the image
  double pending_timeout_s = 120;
  double force_delete_after_s = 5;      // after a released pod's grace period
  int api_threads = 8;
  // Take over the job's existing worker pods (the master resumed from its
  // journal) instead of deleting them.
  bool adopt = false;
  // Fencing: asked before every pod create or delete; false (this master
  // lost the job's Lease: another one acts for the job) skips the call.
  std::function<bool()> may_act;
};

class KubernetesScheduler : public SchedulerInterface {
 public:
  static absl::StatusOr<std::unique_ptr<KubernetesScheduler>> Start(KubernetesSchedulerOptions options);
  ~KubernetesScheduler() override;

  std::string Kind() const override { return "kubernetes"; }
  absl::Status LaunchNode(const NodeRequest& request) override;
  absl::Status ReleaseNode(const std::string& name, const std::string& reason, double grace_s) override;
  std::vector<NodeEvent> Poll() override;
  std::vector<std::string> RunningNodes() const override;
  // Deletes every pod of the job but those that Succeeded (kept for their
  // logs until the ElasticJob is deleted).
  void StopAll(double grace_s) override;
  std::vector<AdoptedNode> AdoptedNodes() const override;

  // Non-OK when the API server refused a pod in a way no retry fixes.
  absl::Status fatal() const;
  // Worker pods of this job in the API server now (terminating ones too),
  // and how many of them succeeded.
  int PodsInApi() const;
  int SucceededPods() const;

 private:
  explicit KubernetesScheduler(KubernetesSchedulerOptions options);
  struct Pod {
    int node_rank = 0;
    int incarnation = 0;
    double created_at = 0;     // steady seconds, when LaunchNode was called
    bool started = false;
    bool ended = false;        // ended, lost, or failed to create
    bool succeeded = false;
    bool released = false;
    bool deleted = false;      // gone from the API server
    bool pending_reported = false;
    bool force_deleted = false;
    double force_delete_at = 0;
    bool created = false;             // the create call returned (either way)
    std::optional<double> delete_after_create;  // a delete asked for while it was being created (grace)
    std::string host;
  };
  void OnPod(const std::string& type, const kube::Json& pod);  // informer thread
  // Start(): the worker pods an earlier master left, deleted or adopted.
  absl::Status DeleteStalePods();
  void AdoptPods();
  void Submit(std::function<void()> task);
  void Create(const std::string& name, kube::Json pod);
  // True (and says so) when options_.may_act refuses: the call is skipped.
  bool Fenced(const std::string& what) const;
  // Deletes the pod (with a grace period) from a pool thread; one still being
  // created is deleted when its create returns. DeleteLocked: mu_ is held.
  void Delete(const std::string& name, double grace_s, const std::string& why);
  void DeleteLocked(const std::string& name, double grace_s, const std::string& why);
  void PushLocked(NodeEvent::Kind kind, const std::string& name, const std::string& reason, ExitStatus status = {});

  const KubernetesSchedulerOptions options_;
  std::unique_ptr<kube::Informer> informer_;

  mutable std::mutex mu_;
  std::map<std::string, Pod> pods_;  // every pod this scheduler created, by name
  std::vector<NodeEvent> events_;
  absl::Status fatal_;
  std::vector<AdoptedNode> adopted_;  // set by Start(), then read-only
  std::set<std::string> stray_deleted_;  // pods of an earlier master deleted by OnPod
  bool started_ = false;  // Start() dealt with the pods it found

  // The API call pool.
  std::mutex pool_mu_;
  std::condition_variable pool_cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ballast::scheduler::kubernetes
