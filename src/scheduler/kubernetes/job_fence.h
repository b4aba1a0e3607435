// A suspended ElasticJob fences its master the way SIGTERM and losing the
// job's Lease do: once spec.suspend is true (or the job is deleted, or
// replaced by a new job of the same name) the master creates, deletes and
// replaces no pod and writes no status and no event. The operator deletes the
// pods and owns the status (phase Suspended); resuming starts a new master.
//
// The master learns of a suspension from two streams that are not ordered
// with each other: a watch on its ElasticJob, and its worker pods vanishing
// (the operator deletes them right after it marks the job Suspended; their
// agents leave). Acting on the pods before the job watch arrives would
// replace the pods the suspension deleted. What orders them: the operator
// deletes pods only after spec.suspend was written, so a read of the job from
// the API server (not a cache) made after a pod vanished sees the suspension.
//  - JobFence::Confirm is that read; FencedScheduler makes every
//    replacement wait for it (a pod that ended or vanished, a node the master
//    lost or excluded is handed to the NodeManager only once a read made
//    after it said the job is not suspended);
//  - JobFence::ApplyStatus writes the status only if the job, read just
//    before, is not suspended, and conditional on that read's
//    resourceVersion: a suspension written in between makes the write a
//    Conflict, read again and dropped. So the phase Suspended the operator
//    wrote is never overwritten by a master that had not seen it yet.
//
// The fence is sticky: a master that stopped for a suspended job does not act
// again when the job is resumed (the operator starts a new master then; a
// master that stopped for a suspension exits kMasterExitSuspended, which the
// operator counts as a resume, not a master restart).
//
// Threading: JobFence is thread-safe. FencedScheduler follows
// SchedulerInterface (one thread), except OnNodeLost / OnNodeExcluded, which
// may be called from any thread (they only queue).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kube/informer.h"
#include "kube/kube_client.h"
#include "scheduler/kubernetes/elastic_job.h"
#include "scheduler/node_manager.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler::kubernetes {

class JobFence {
 public:
  JobFence(kube::KubeClient* client, const ElasticJobSpec& job);
  ~JobFence();  // Stop()

  // Watches the job (an informer on it alone): fenced() turns true within a
  // watch event of the suspension.
  void Start();
  void Stop();

  // True once the job was seen suspended, deleted or replaced.
  bool fenced() const { return fenced_.load(); }
  // Why ("the ElasticJob ns/name is suspended (spec.suspend)"); "" while not fenced.
  std::string why() const;

  // What a read of the job says (an object from a watch, a list or a GET).
  void Observe(const kube::Json& job);

  // Reads the job from the API server: true when it is suspended, deleted or
  // replaced (fenced from then on). An error when it could not be read (the
  // fence does not know; what waits for it waits).
  absl::StatusOr<bool> Confirm();

  // Server-side apply of the job's .status (body: apiVersion, kind, metadata
  // name/namespace and status) as field_manager, only if the job read just
  // before is not suspended, conditional on that read's resourceVersion
  // (a Conflict: read again and retry). kFailedPrecondition when fenced
  // (nothing written).
  absl::Status ApplyStatus(kube::Json body, const std::string& field_manager);

 private:
  void Fence(const std::string& why);
  absl::StatusOr<kube::Json> Read();

  kube::KubeClient* const client_;
  const ElasticJobSpec job_;
  std::unique_ptr<kube::Informer> informer_;
  std::atomic<bool> fenced_{false};
  mutable std::mutex mu_;
  std::string why_;
};

// The scheduler under the master's NodeManager, with every replacement held
// until the job is confirmed not suspended (see the file comment). Events that
// decide nothing (a pod started, pending too long) pass at once; a pod that
// ended or vanished, and a node the master lost or excluded, pass once a
// JobFence::Confirm made after it said the job goes on. While the job cannot
// be read they wait (retried at most every retry_s); once it is fenced nothing
// passes any more (the master's loop stops).
class FencedScheduler : public SchedulerInterface {
 public:
  // inner and fence are borrowed; forward: where confirmed notices go (the
  // NodeManager's OnNodeLost / OnNodeExcluded, e.g. ForwardTo(&manager)).
  FencedScheduler(SchedulerInterface* inner, JobFence* fence, NodeCallbacks forward, double retry_s = 1.0);

  // The master's node callbacks (MasterOptions::on_node_lost,
  // on_node_excluded) come here instead of to the NodeManager.
  void OnNodeLost(const std::string& node_id, const std::string& reason);
  void OnNodeExcluded(const std::string& node_id, const std::string& reason);

  // The rest is the inner scheduler's (its pod calls ask may_act, which
  // includes the fence).
  std::string Kind() const override { return inner_->Kind(); }
  absl::Status LaunchNode(const NodeRequest& request) override { return inner_->LaunchNode(request); }
  absl::Status ReleaseNode(const std::string& name, const std::string& reason, double grace_s) override {
    return inner_->ReleaseNode(name, reason, grace_s);
  }
  // Called by NodeManager::Poll before it takes the master's notices: the
  // notices confirmed here are forwarded first, so they are acted on in the
  // same Poll; those that arrive later wait for the next one.
  std::vector<NodeEvent> Poll() override;
  std::vector<std::string> RunningNodes() const override { return inner_->RunningNodes(); }
  void StopAll(double grace_s) override { inner_->StopAll(grace_s); }
  std::vector<AdoptedNode> AdoptedNodes() const override { return inner_->AdoptedNodes(); }

  // Events and notices held back now (for tests and messages).
  size_t held() const;

 private:
  struct Notice {
    std::string node_id;
    std::string reason;
    bool excluded = false;
  };

  SchedulerInterface* const inner_;
  JobFence* const fence_;
  const NodeCallbacks forward_;
  const double retry_s_;
  std::vector<NodeEvent> events_;  // from inner_, not yet handed out
  std::chrono::steady_clock::time_point next_read_{};
  bool warned_ = false;
  mutable std::mutex mu_;          // guards notices_
  std::vector<Notice> notices_;
};

}  // namespace ballast::scheduler::kubernetes
