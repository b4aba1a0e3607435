#include "scheduler/kubernetes/kubernetes_scheduler.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler::kubernetes {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string PodsPath(const ElasticJobSpec& job) { return kube::CollectionPath("v1", "pods", job.ns); }
std::string PodPath(const ElasticJobSpec& job, const std::string& name) {
  return kube::ObjectPath("v1", "pods", job.ns, name);
}

// Why a pod is not scheduled, from its PodScheduled condition.
std::string PendingReason(const kube::Json& pod) {
  if (const kube::Json* conds = kube::Find(pod, {"status", "conditions"}); conds != nullptr && conds->is_array()) {
    for (const kube::Json& c : *conds) {
      if (c.value("type", "") == "PodScheduled" && c.value("status", "") == "False") {
        return absl::StrCat(c.value("reason", "Unschedulable"), ": ", c.value("message", ""));
      }
    }
  }
  if (const kube::Json* cs = kube::Find(pod, {"status", "containerStatuses"}); cs != nullptr && cs->is_array()) {
    for (const kube::Json& c : *cs) {
      const kube::Json* waiting = kube::Find(c, {"state", "waiting"});
      if (waiting != nullptr) return absl::StrCat(waiting->value("reason", "Waiting"), ": ", waiting->value("message", ""));
    }
  }
  return "";
}

}  // namespace

KubernetesScheduler::KubernetesScheduler(KubernetesSchedulerOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<KubernetesScheduler>> KubernetesScheduler::Start(KubernetesSchedulerOptions options) {
  if (options.client == nullptr) return absl::InvalidArgumentError("KubernetesScheduler needs a client");
  std::unique_ptr<KubernetesScheduler> s(new KubernetesScheduler(std::move(options)));
  const ElasticJobSpec& job = s->options_.job;
  for (int i = 0; i < std::max(1, s->options_.api_threads); ++i) {
    s->threads_.emplace_back([p = s.get()] {
      while (true) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(p->pool_mu_);
          p->pool_cv_.wait(lock, [&] { return p->stopping_ || !p->tasks_.empty(); });
          if (p->tasks_.empty()) return;  // stopping, and the queue is drained
          task = std::move(p->tasks_.front());
          p->tasks_.pop_front();
        }
        task();
      }
    });
  }
  kube::InformerOptions io;
  io.path = PodsPath(job);
  io.label_selector = job.WorkerSelector();
  io.what = absl::StrCat("worker pods of ElasticJob ", job.Describe());
  s->informer_ = std::make_unique<kube::Informer>(
      s->options_.client, io, [p = s.get()](const std::string& type, const kube::Json& pod) { p->OnPod(type, pod); });
  s->informer_->Start();
  if (!s->informer_->WaitForSync(30)) {
    return absl::UnavailableError(absl::StrCat("cannot list the worker pods of ElasticJob ", job.Describe(), ": ",
                                               s->informer_->last_error()));
  }
  if (s->options_.adopt) {
    s->AdoptPods();
  } else {
    RETURN_IF_ERROR(s->DeleteStalePods());
    std::lock_guard<std::mutex> lock(s->mu_);
    s->started_ = true;  // from now on a pod nobody asked for is a stray
  }
  return s;
}

absl::Status KubernetesScheduler::DeleteStalePods() {
  // Pods of an earlier master of this job: their agents lost it. Gone before
  // new ones start, so names never collide and no stale agent trains on.
  const ElasticJobSpec& job = options_.job;
  std::vector<kube::Json> stale = informer_->List();
  if (stale.empty()) return absl::OkStatus();
  spdlog::warn("kubernetes: deleting {} worker pod(s) of ElasticJob {} left by an earlier master", stale.size(),
               job.Describe());
  for (const kube::Json& pod : stale) {
    const std::string name = kube::Str(pod, {"metadata", "name"});
    if (Fenced("delete pod " + name)) return absl::FailedPreconditionError("this master no longer acts for the job");
    auto r = options_.client->Delete(PodPath(job, name), kube::Json{{"gracePeriodSeconds", 0}},
                                     absl::StrCat("delete pod ", job.ns, "/", name));
    if (!r.ok() && !absl::IsNotFound(r.status())) return r.status();
  }
  const double deadline = Now() + 30;
  while (!informer_->List().empty() && Now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return absl::OkStatus();
}

void KubernetesScheduler::AdoptPods() {
  // Every worker pod of the job becomes this scheduler's (ended ones too: a
  // replacement must not reuse their names), then each is run through OnPod
  // as the informer would: a pod that ended or is being deleted while no
  // master watched is reported by the first Poll and replaced.
  const std::vector<kube::Json> pods = informer_->List();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const kube::Json& pod : pods) {
      const std::string name = kube::Str(pod, {"metadata", "name"});
      const kube::Json* labels = kube::Find(pod, {"metadata", "labels"});
      int rank = -1;
      int incarnation = 0;
      if (labels != nullptr && labels->is_object()) {
        rank = std::atoi(labels->value(kRankLabel, "-1").c_str());
        incarnation = std::atoi(labels->value(kIncarnationLabel, "0").c_str());
      }
      if (rank < 0 || incarnation < 1) {
        spdlog::warn("kubernetes: pod {}/{} has no {} / {} labels; not taking it over", options_.job.ns, name,
                     kRankLabel, kIncarnationLabel);
        continue;
      }
      Pod& st = pods_[name];
      st.node_rank = rank;
      st.incarnation = incarnation;
      st.created_at = Now();
      st.created = true;
      st.host = kube::Str(pod, {"spec", "nodeName"});
      adopted_.push_back(AdoptedNode{name, rank, incarnation, st.host});
    }
    started_ = true;  // from now on a pod nobody asked for is a stray
  }
  for (const kube::Json& pod : informer_->List()) OnPod("MODIFIED", pod);
  if (!adopted_.empty()) {
    spdlog::info("kubernetes: took over {} worker pod(s) of ElasticJob {} from the previous master process",
                 adopted_.size(), options_.job.Describe());
  }
}

std::vector<AdoptedNode> KubernetesScheduler::AdoptedNodes() const { return adopted_; }

KubernetesScheduler::~KubernetesScheduler() {
  if (informer_) informer_->Stop();
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    stopping_ = true;
  }
  pool_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void KubernetesScheduler::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    tasks_.push_back(std::move(task));
  }
  pool_cv_.notify_one();
}

void KubernetesScheduler::PushLocked(NodeEvent::Kind kind, const std::string& name, const std::string& reason,
                                     ExitStatus status) {
  NodeEvent e;
  e.kind = kind;
  e.name = name;
  e.reason = reason;
  e.status = status;
  auto it = pods_.find(name);
  if (it != pods_.end()) e.host = it->second.host;
  events_.push_back(std::move(e));
}

absl::Status KubernetesScheduler::LaunchNode(const NodeRequest& request) {
  WorkerPodParams p;
  p.node_rank = request.node_rank;
  p.incarnation = request.incarnation;
  p.master_endpoint = options_.master_endpoint;
  p.avoid_hosts = request.avoid_hosts;
  p.ballast = options_.ballast;
  auto pod = BuildWorkerPod(options_.job, p);
  if (!pod.ok()) return pod.status();
  // The pod's name is the node's name (the agent's node id).
  const std::string name = kube::Str(*pod, {"metadata", "name"});
  if (name != request.name) {
    (*pod)["metadata"]["name"] = request.name;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pods_.count(request.name) != 0) return absl::AlreadyExistsError(absl::StrCat("pod ", request.name, " exists"));
    Pod& st = pods_[request.name];
    st.node_rank = request.node_rank;
    st.incarnation = request.incarnation;
    st.created_at = Now();
  }
  Submit([this, name = request.name, pod = *std::move(pod)]() mutable { Create(name, std::move(pod)); });
  return absl::OkStatus();
}

void KubernetesScheduler::Create(const std::string& name, kube::Json pod) {
  const std::string what = absl::StrCat("create pod ", options_.job.ns, "/", name);
  absl::Status last;
  const double deadline = Now() + 30;
  double backoff = 0.2;
  while (true) {
    if (Fenced(what)) return;
    auto r = options_.client->Create(PodsPath(options_.job), pod, what);
    if (r.ok()) {
      spdlog::info("kubernetes: created pod {}/{}", options_.job.ns, name);
      std::optional<double> then_delete;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Pod& st = pods_[name];
        st.created = true;
        then_delete = st.delete_after_create;
      }
      // Released while its create was on the wire: delete it now, or it
      // would outlive the release.
      if (then_delete.has_value()) Delete(name, *then_delete, "released while it was being created");
      return;
    }
    last = r.status();
    if (!absl::IsUnavailable(last) || Now() + backoff > deadline) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff));
    backoff = std::min(2.0, backoff * 2);
  }
  std::lock_guard<std::mutex> lock(mu_);
  Pod& st = pods_[name];
  st.created = true;
  st.ended = true;
  st.deleted = true;
  if (absl::IsInvalidArgument(last) || absl::IsPermissionDenied(last)) {
    // The template or the RBAC is wrong: every replacement would fail the same way.
    if (fatal_.ok()) {
      fatal_ = absl::Status(last.code(), absl::StrCat(last.message(),
                                                       absl::IsPermissionDenied(last)
                                                           ? " (does the master's ServiceAccount have the "
                                                             "ballast-master role? see deploy/02-rbac.yaml)"
                                                           : " (fix spec.template of the ElasticJob)"));
    }
    return;
  }
  PushLocked(NodeEvent::Kind::kLost, name, absl::StrCat("cannot create its pod: ", last.message()));
}

bool KubernetesScheduler::Fenced(const std::string& what) const {
  if (!options_.may_act || options_.may_act()) return false;
  spdlog::warn("kubernetes: not doing it ({}): this master no longer holds the job's Lease", what);
  return true;
}

void KubernetesScheduler::Delete(const std::string& name, double grace_s, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  DeleteLocked(name, grace_s, why);
}

void KubernetesScheduler::DeleteLocked(const std::string& name, double grace_s, const std::string& why) {
  auto it = pods_.find(name);
  if (it != pods_.end() && !it->second.created) {
    it->second.delete_after_create = grace_s;  // Create() deletes it when its call returns
    return;
  }
  Submit([this, name, grace_s, why] {
    if (Fenced(absl::StrCat("delete pod ", name))) return;
    kube::Json opts = {{"gracePeriodSeconds", static_cast<int64_t>(grace_s + 0.5)}, {"propagationPolicy", "Background"}};
    auto r = options_.client->Delete(PodPath(options_.job, name), opts,
                                     absl::StrCat("delete pod ", options_.job.ns, "/", name));
    if (!r.ok() && !absl::IsNotFound(r.status())) {
      spdlog::warn("kubernetes: {} ({})", std::string(r.status().message()), why);
    } else {
      spdlog::info("kubernetes: deleting pod {}/{} (grace {} s): {}", options_.job.ns, name,
                   static_cast<int64_t>(grace_s + 0.5), why);
    }
  });
}

void KubernetesScheduler::OnPod(const std::string& type, const kube::Json& pod) {
  const std::string name = kube::Str(pod, {"metadata", "name"});
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pods_.find(name);
  if (it == pods_.end()) {
    // A worker pod of this job that this scheduler neither created (LaunchNode
    // records a pod before asking for it) nor took over: an earlier master's
    // create that completed after that master died. Its agent would join as a
    // node nobody manages: delete it.
    if (started_ && type != "DELETED" && kube::Find(pod, {"metadata", "deletionTimestamp"}) == nullptr &&
        stray_deleted_.insert(name).second) {
      DeleteLocked(name, 0, "created by an earlier master process, which died: no node of this master");
    }
    return;
  }
  Pod& st = it->second;
  if (std::string node = kube::Str(pod, {"spec", "nodeName"}); !node.empty()) st.host = node;
  if (type == "DELETED") {
    st.deleted = true;
    if (!st.ended && !st.released) {
      st.ended = true;
      PushLocked(NodeEvent::Kind::kLost, name, "its pod was deleted");
    }
    return;
  }
  const std::string phase = kube::Str(pod, {"status", "phase"});
  if (phase == "Running" && !st.started) {
    st.started = true;
    PushLocked(NodeEvent::Kind::kStarted, name, "");
  }
  if (st.ended || st.released) return;
  if (kube::Find(pod, {"metadata", "deletionTimestamp"}) != nullptr) {
    st.ended = true;
    PushLocked(NodeEvent::Kind::kLost, name, "its pod is being deleted (kubectl delete, eviction or a drain)");
    return;
  }
  if (phase != "Succeeded" && phase != "Failed") return;
  st.ended = true;
  st.succeeded = phase == "Succeeded";
  const std::string reason = kube::Str(pod, {"status", "reason"});
  if (!st.succeeded) {
    // Never left in Error: the failure is in the master's report and events.
    DeleteLocked(name, 0, "its pod failed");
  }
  if (reason == "Evicted" || reason == "NodeLost" || reason == "Shutdown" || reason == "Terminated") {
    PushLocked(NodeEvent::Kind::kLost, name, absl::StrCat("its pod was ", reason, ": ", kube::Str(pod, {"status", "message"})));
    return;
  }
  ExitStatus status;
  bool found = false;
  if (const kube::Json* cs = kube::Find(pod, {"status", "containerStatuses"}); cs != nullptr && cs->is_array()) {
    std::string first;  // the trainer: the template's first container
    if (const kube::Json* spec_cs = kube::Find(pod, {"spec", "containers"});
        spec_cs != nullptr && spec_cs->is_array() && !spec_cs->empty()) {
      first = (*spec_cs)[0].value("name", "");
    }
    for (const kube::Json& c : *cs) {
      if (!first.empty() && c.value("name", "") != first) continue;
      if (const kube::Json* t = kube::Find(c, {"state", "terminated"}); t != nullptr) {
        status.signal = static_cast<int>(kube::Int(*t, {"signal"}));
        status.exit_code = static_cast<int>(kube::Int(*t, {"exitCode"}));
        if (status.signal == 0 && status.exit_code > 128 && status.exit_code < 160) {
          status.signal = status.exit_code - 128;  // the container runtime reports 128+N
          status.exit_code = 0;
        }
        found = true;
      }
      break;
    }
  }
  if (!found && !st.succeeded) {
    PushLocked(NodeEvent::Kind::kLost, name,
               absl::StrCat("its pod failed: ", reason.empty() ? "no container status" : reason, " ",
                            kube::Str(pod, {"status", "message"})));
    return;
  }
  PushLocked(NodeEvent::Kind::kExited, name, "", status);
}

absl::Status KubernetesScheduler::ReleaseNode(const std::string& name, const std::string& reason, double grace_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pods_.find(name);
    if (it == pods_.end()) return absl::NotFoundError(absl::StrCat("no pod ", name));
    Pod& st = it->second;
    if (st.released || st.deleted) return absl::OkStatus();
    st.released = true;
    st.force_delete_at = Now() + grace_s + options_.force_delete_after_s;
  }
  Delete(name, grace_s, reason);
  return absl::OkStatus();
}

std::vector<NodeEvent> KubernetesScheduler::Poll() {
  const double now = Now();
  std::vector<std::string> force;
  std::vector<NodeEvent> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, st] : pods_) {
      if (st.released && !st.deleted && !st.force_deleted && now >= st.force_delete_at) {
        st.force_deleted = true;
        force.push_back(name);
      }
      if (!st.started && !st.ended && !st.released && !st.pending_reported &&
          now - st.created_at >= options_.pending_timeout_s) {
        st.pending_reported = true;
        std::string why;
        if (auto pod = informer_->Get(absl::StrCat(options_.job.ns, "/", name)); pod.has_value()) {
          why = PendingReason(*pod);
        }
        PushLocked(NodeEvent::Kind::kPendingTooLong, name,
                   absl::StrCat("its pod is still Pending after ", static_cast<int>(options_.pending_timeout_s),
                                " s (spec.pendingTimeoutSeconds)", why.empty() ? "" : absl::StrCat(": ", why)));
      }
    }
    out.swap(events_);
  }
  // Still there after the grace period: its kubelet is gone (a dead node).
  for (const std::string& name : force) {
    spdlog::warn("kubernetes: pod {}/{} is still there after its grace period (its node is down?); force-deleting it",
                 options_.job.ns, name);
    Delete(name, 0, "force delete after the grace period");
  }
  return out;
}

std::vector<std::string> KubernetesScheduler::RunningNodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (const auto& [name, st] : pods_) {
    if (!st.ended && !st.released && !st.deleted) names.push_back(name);
  }
  return names;
}

void KubernetesScheduler::StopAll(double grace_s) {
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, st] : pods_) {
      if (st.deleted || st.released || st.succeeded) continue;
      st.released = true;
      st.force_delete_at = Now() + grace_s + options_.force_delete_after_s;
      names.push_back(name);
    }
  }
  for (const std::string& n : names) Delete(n, grace_s, "the job is over");
}

absl::Status KubernetesScheduler::fatal() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

int KubernetesScheduler::PodsInApi() const { return static_cast<int>(informer_->List().size()); }

int KubernetesScheduler::SucceededPods() const {
  int n = 0;
  for (const kube::Json& pod : informer_->List()) n += kube::Str(pod, {"status", "phase"}) == "Succeeded" ? 1 : 0;
  return n;
}

}  // namespace ballast::scheduler::kubernetes
