#include "operator/operator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/net.h"
#include "operator/kueue.h"
#include "scheduler/kubernetes/elastic_job.h"
#include "spdlog/spdlog.h"

namespace ballast::op {
namespace {

using kube::Json;
namespace k8s = scheduler::kubernetes;

std::string JobKey(const std::string& ns, const std::string& name) { return ns + "/" + name; }

bool Finished(const Json& job) {
  std::string phase = kube::Str(job, {"status", "phase"});
  return phase == "Succeeded" || phase == "Failed";
}


// How a master pod ended, for messages.
std::string HowEnded(const Json& pod) {
  std::string why = kube::Str(pod, {"status", "reason"});
  if (const Json* cs = kube::Find(pod, {"status", "containerStatuses"}); cs != nullptr && cs->is_array()) {
    for (const Json& c : *cs) {
      if (const Json* t = kube::Find(c, {"state", "terminated"}); t != nullptr) {
        why = absl::StrCat(why.empty() ? "" : why + ", ", "exit code ", kube::Int(*t, {"exitCode"}),
                           kube::Str(*t, {"reason"}).empty() ? "" : absl::StrCat(" (", kube::Str(*t, {"reason"}), ")"));
      }
    }
  }
  if (kube::Find(pod, {"metadata", "deletionTimestamp"}) != nullptr) why = why.empty() ? "deleted" : why + ", deleted";
  return why.empty() ? kube::Str(pod, {"status", "phase"}) : why;
}

// The master container's exit code, -1 when it has none (evicted, deleted, running).
int64_t MasterExitCode(const Json& pod) {
  if (const Json* cs = kube::Find(pod, {"status", "containerStatuses"}); cs != nullptr && cs->is_array()) {
    for (const Json& c : *cs) {
      if (const Json* t = kube::Find(c, {"state", "terminated"}); t != nullptr) return kube::Int(*t, {"exitCode"}, -1);
    }
  }
  return -1;
}

}  // namespace

Operator::Operator(kube::KubeClient* client, OperatorOptions options)
    : client_(client), options_(std::move(options)) {}

Operator::~Operator() {
  if (jobs_) jobs_->Stop();
  if (masters_) masters_->Stop();
  if (workloads_) workloads_->Stop();
}

bool Operator::Leading() const {
  if (!options_.leading || options_.leading()) return true;
  spdlog::error("operator: no longer the leader (its Lease was lost): stopping; another replica reconciles the "
                "jobs now");
  return false;
}

void Operator::Enqueue(const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.insert(key);
  }
  cv_.notify_all();
}

void Operator::EnqueueAfter(const std::string& key, double delay_s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto due = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                    std::chrono::duration<double>(delay_s));
  auto [it, inserted] = later_.emplace(key, due);
  if (!inserted && due < it->second) it->second = due;
}

int Operator::Run(const std::atomic<int>* signal) {
  kube::InformerOptions jo;
  jo.path = kube::CollectionPath(k8s::kApiVersion, k8s::kPlural, options_.ns);
  jo.what = options_.ns.empty() ? "ElasticJobs" : absl::StrCat("ElasticJobs in ", options_.ns);
  jobs_ = std::make_unique<kube::Informer>(client_, jo, [this](const std::string& type, const Json& obj) {
    if (type != "DELETED") Enqueue(kube::Informer::KeyOf(obj));
  });
  kube::InformerOptions mo;
  mo.path = kube::CollectionPath("v1", "pods", options_.ns);
  mo.label_selector = absl::StrCat(k8s::kRoleLabel, "=master");
  mo.what = "master pods";
  masters_ = std::make_unique<kube::Informer>(client_, mo, [this](const std::string&, const Json& pod) {
    std::string job = kube::Str(pod, {"metadata", "labels", k8s::kJobLabel});
    if (!job.empty()) Enqueue(JobKey(kube::Str(pod, {"metadata", "namespace"}), job));
  });
  jobs_->Start();
  masters_->Start();
  // Until both caches are filled (the CRD may be installed after us): keep
  // trying, say why once a while, and stop on a signal.
  auto waiting_since = std::chrono::steady_clock::now();
  while (!(jobs_->synced() && masters_->synced())) {
    if (signal->load() != 0) return 0;
    jobs_->WaitForSync(0.5);
    masters_->WaitForSync(0.1);
    if (std::chrono::steady_clock::now() - waiting_since > std::chrono::seconds(30)) {
      spdlog::error("operator: cannot list {} yet: {} (is the CRD installed? kubectl apply -f deploy/)", jo.what,
                    jobs_->last_error());
      waiting_since = std::chrono::steady_clock::now();
    }
  }
  spdlog::info("operator: watching {} (master address: {}, master image: {})", jo.what, options_.master_address,
               options_.image.empty() ? "the job's worker image" : options_.image);
  auto next_resync = std::chrono::steady_clock::now();
  while (signal->load() == 0) {
    if (std::chrono::steady_clock::now() >= next_resync) {
      for (const Json& j : jobs_->List()) Enqueue(kube::Informer::KeyOf(j));
      next_resync = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                           std::chrono::duration<double>(options_.resync_s));
    }
    std::set<std::string> keys;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return !queue_.empty(); });
      keys.swap(queue_);
      const auto now = std::chrono::steady_clock::now();
      for (auto it = later_.begin(); it != later_.end();) {
        if (it->second <= now) {
          keys.insert(it->first);
          it = later_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const std::string& k : keys) {
      if (!Leading()) return 1;
      Reconcile(k);
    }
    if (!Leading()) return 1;  // also when idle: it restarts as a standby at once
  }
  spdlog::info("operator: stopping (signal {}); jobs keep running under their masters", signal->load());
  return 0;
}

absl::Status Operator::EnsureObject(const std::string& api_version, const std::string& plural, const std::string& ns,
                                    const Json& object) {
  const std::string name = kube::Str(object, {"metadata", "name"});
  const std::string what = absl::StrCat("create ", object.value("kind", plural), " ", ns, "/", name);
  auto r = client_->Create(kube::CollectionPath(api_version, plural, ns), object, what);
  if (r.ok() || absl::IsAlreadyExists(r.status())) return absl::OkStatus();
  return r.status();
}

absl::Status Operator::PatchStatus(const Json& job, const Json& fields) {
  const std::string ns = kube::Str(job, {"metadata", "namespace"});
  const std::string name = kube::Str(job, {"metadata", "name"});
  Json body = {{"metadata", {{"resourceVersion", kube::Str(job, {"metadata", "resourceVersion"})}}}, {"status", fields}};
  auto r = client_->Patch(kube::ObjectPath(k8s::kApiVersion, k8s::kPlural, ns, name) + "/status", body,
                          absl::StrCat("update the status of ElasticJob ", ns, "/", name));
  if (r.ok()) return absl::OkStatus();
  if (absl::IsAborted(r.status())) {
    spdlog::debug("operator: ElasticJob {}/{} changed meanwhile; deciding again", ns, name);
    Enqueue(JobKey(ns, name));
  } else {
    spdlog::warn("operator: {}", std::string(r.status().message()));
  }
  return r.status();
}

void Operator::Event(const Json& job, const std::string& reason, const std::string& message, bool warning) {
  const Json& meta = job["metadata"];
  const std::string ns = kube::Str(meta, {"namespace"});
  const std::string name = kube::Str(meta, {"name"});
  auto r = client_->Create(kube::CollectionPath("v1", "events", ns),
                           k8s::BuildJobEvent(meta, reason, message, warning, "ballast-operator"),
                           absl::StrCat("create an event for ElasticJob ", ns, "/", name));
  if (!r.ok()) spdlog::warn("operator: {}", std::string(r.status().message()));
  if (warning) {
    spdlog::warn("operator: ElasticJob {}/{}: {}: {}", ns, name, reason, message);
  } else {
    spdlog::info("operator: ElasticJob {}/{}: {}: {}", ns, name, reason, message);
  }
}

void Operator::WatchWorkloads() {
  if (workloads_) return;
  kube::InformerOptions wo;
  wo.path = kube::CollectionPath(kueue::kApiVersion, "workloads", options_.ns);
  wo.label_selector = k8s::kJobLabel;
  wo.what = "Kueue Workloads of ElasticJobs";
  workloads_ = std::make_unique<kube::Informer>(client_, wo, [this](const std::string&, const Json& wl) {
    std::string job = kube::Str(wl, {"metadata", "labels", k8s::kJobLabel});
    if (!job.empty()) Enqueue(JobKey(kube::Str(wl, {"metadata", "namespace"}), job));
  });
  workloads_->Start();
}

void Operator::FinishWorkload(const Json& job) {
  auto spec = k8s::ParseElasticJob(job);
  if (!spec.ok()) return;
  const std::string ns = spec->ns;
  const std::string wname = kueue::WorkloadName(*spec);
  WatchWorkloads();
  std::optional<Json> wl = workloads_->synced() ? workloads_->Get(JobKey(ns, wname)) : std::nullopt;
  if (!workloads_->synced()) {
    auto r = client_->Get(kube::ObjectPath(kueue::kApiVersion, "workloads", ns, wname),
                          absl::StrCat("get Workload ", ns, "/", wname));
    if (r.ok()) wl = *std::move(r);
  }
  if (!wl.has_value() || kueue::ReadWorkload(*wl).state == kueue::State::kFinished) return;
  const bool ok = kube::Str(job, {"status", "phase"}) == "Succeeded";
  auto r = client_->Patch(kube::ObjectPath(kueue::kApiVersion, "workloads", ns, wname) + "/status",
                          kueue::FinishedPatch(*wl, ok, kube::Str(job, {"status", "message"}), k8s::Rfc3339Now()),
                          absl::StrCat("mark Workload ", ns, "/", wname, " finished"));
  if (!r.ok()) spdlog::warn("operator: {}", std::string(r.status().message()));
}

bool Operator::ReconcileKueue(const Json& job, const k8s::ElasticJobSpec& spec, const std::string& queue,
                              std::function<void()>* when_pods_gone) {
  const std::string ns = spec.ns;
  const std::string wname = kueue::WorkloadName(spec);
  const std::string wpath = kube::ObjectPath(kueue::kApiVersion, "workloads", ns, wname);
  const std::string jpath = kube::ObjectPath(k8s::kApiVersion, k8s::kPlural, ns, spec.name);
  const std::string phase = kube::Str(job, {"status", "phase"});
  WatchWorkloads();
  auto patch_job = [&](const Json& patch, const std::string& what) {
    auto r = client_->Patch(jpath, patch, absl::StrCat(what, " ElasticJob ", ns, "/", spec.name));
    if (!r.ok()) spdlog::warn("operator: {}", std::string(r.status().message()));
    return r.ok();
  };
  auto wl = client_->Get(wpath, absl::StrCat("get Workload ", ns, "/", wname));
  if (!wl.ok()) {
    if (!absl::IsNotFound(wl.status())) {
      spdlog::warn("operator: {}", std::string(wl.status().message()));
      return false;
    }
    // No Workload yet: the job waits suspended (nothing of it runs before
    // Kueue admits it), and gets one.
    if (!spec.suspend) {
      patch_job(Json{{"spec", {{"suspend", true}}}}, "suspend (queued in Kueue)");
      return false;
    }
    // Says why the Workload cannot be made yet, once (status message, event); retried at the resync.
    auto cannot = [&](const std::string& msg) {
      if (kube::Str(job, {"status", "message"}) != msg && PatchStatus(job, {{"message", msg}}).ok()) {
        Event(job, "WorkloadNotCreated", msg, true);
      }
      return false;
    };
    // The priority: a WorkloadPriorityClass named by the label, else the
    // template's PriorityClass.
    kueue::Priority priority;
    if (std::string wpc = kube::Str(job, {"metadata", "labels", kueue::kPriorityClassLabel}); !wpc.empty()) {
      priority = {wpc, kueue::kGroup, 0};
    } else if (std::string pcn = kube::Str(spec.pod_template, {"spec", "priorityClassName"}); !pcn.empty()) {
      priority = {pcn, "scheduling.k8s.io", 0};
    }
    if (!priority.class_name.empty()) {
      const bool workload_class = priority.group == kueue::kGroup;
      const std::string what = absl::StrCat(workload_class ? "WorkloadPriorityClass " : "PriorityClass ",
                                            priority.class_name);
      auto pc = client_->Get(workload_class ? kube::ObjectPath(kueue::kApiVersion, "workloadpriorityclasses", "",
                                                               priority.class_name)
                                            : kube::ObjectPath("scheduling.k8s.io/v1", "priorityclasses", "",
                                                               priority.class_name),
                             absl::StrCat("get ", what));
      if (!pc.ok()) {
        return cannot(absl::StrCat("cannot read ", what,
                                   workload_class ? absl::StrCat(" (label ", kueue::kPriorityClassLabel, ")")
                                                  : " (the template's priorityClassName)",
                                   ": ", pc.status().message()));
      }
      priority.value = static_cast<int>(kube::Int(*pc, {"value"}));
    }
    k8s::MasterPodParams mp;
    mp.image = !spec.master_image.empty() ? spec.master_image : options_.image;
    mp.ballast = options_.ballast;
    mp.journal_dir = options_.master_journal;
    Json workload = kueue::BuildWorkload(spec, k8s::BuildMasterPod(spec, mp), queue, priority);
    auto r = client_->Create(kube::CollectionPath(kueue::kApiVersion, "workloads", ns), workload,
                             absl::StrCat("create Workload ", ns, "/", wname));
    if (!r.ok() && !absl::IsAlreadyExists(r.status())) {
      return cannot(absl::StrCat("cannot create its Kueue Workload: ", r.status().message(),
                                 absl::IsNotFound(r.status()) ? " (is Kueue installed? the job waits until it can)"
                                                              : ""));
    }
    if (r.ok()) {
      Event(job, "Queued",
            absl::StrCat("queued in LocalQueue ", queue, " as Kueue Workload ", wname, " (master 1 pod, workers ",
                         spec.requested_max_nodes + spec.requested_spares, " pods", priority.class_name.empty() ? "" : ", priority ",
                         priority.class_name.empty() ? "" : absl::StrCat(priority.class_name, "=", priority.value),
                         ")"),
            false);
    }
    return true;  // the suspended path: phase Queued
  }
  const kueue::WorkloadView view = kueue::ReadWorkload(*wl);
  switch (view.state) {
    case kueue::State::kFinished:
      return false;
    case kueue::State::kAdmitted: {
      if (!spec.suspend) return true;  // running under its admission
      std::map<std::string, Json> flavors;
      for (const kueue::PodSetAssignment& p : view.podsets) {
        for (const std::string& f : p.flavors) {
          if (flavors.count(f) != 0) continue;
          auto rf = client_->Get(kube::ObjectPath(kueue::kApiVersion, "resourceflavors", "", f),
                                 absl::StrCat("get ResourceFlavor ", f));
          if (rf.ok()) flavors[f] = *std::move(rf);
        }
      }
      kueue::Placement placement[2];
      const char* sets[2] = {kueue::kMasterPodSet, kueue::kWorkerPodSet};
      for (int i = 0; i < 2; ++i) {
        const kueue::PodSetAssignment* a = view.PodSet(sets[i]);
        if (a == nullptr) continue;
        auto p = kueue::PlacementOf(*a, flavors);
        if (!p.ok()) {
          spdlog::warn("operator: ElasticJob {}: {}", spec.Describe(), std::string(p.status().message()));
          return false;  // retried at the next resync
        }
        placement[i] = *std::move(p);
      }
      const kueue::PodSetAssignment* w = view.PodSet(kueue::kWorkerPodSet);
      std::string flavor_names;
      for (const kueue::PodSetAssignment& p : view.podsets) {
        absl::StrAppend(&flavor_names, flavor_names.empty() ? "" : "; ", p.name, ": ",
                        p.flavors.empty() ? "no flavor" : absl::StrJoin(p.flavors, ","));
      }
      // Time queued (first admission, or after a preemption): the job's, not the master's.
      const Json* before = kube::Find(job, {"status", "queuedSeconds"});
      const double queued_s = (before != nullptr && before->is_number() ? before->get<double>() : 0.0) +
                              kueue::QueuedSeconds(*wl, absl::Now());
      if (PatchStatus(job, {{"phase", "Admitted"},
                            {"message", absl::StrCat("admitted by Kueue to ClusterQueue ", view.cluster_queue,
                                                     ": starting the master")},
                            {"queue", queue},
                            {"clusterQueue", view.cluster_queue},
                            {"queuedSeconds", std::round(queued_s * 10) / 10}})
              .ok() &&
          patch_job(kueue::AdmitPatch(job, placement[0], placement[1], w != nullptr && w->count >= 0 ? w->count : -1,
                                      spec.requested_max_nodes + spec.requested_spares),
                    "start (admitted by Kueue)")) {
        Event(job, "Admitted",
              absl::StrCat("admitted by Kueue to ClusterQueue ", view.cluster_queue, " (", flavor_names,
                           w != nullptr ? absl::StrCat("; ", w->count, " worker pods") : "", ")"),
              false);
      }
      return false;
    }
    case kueue::State::kEvicted:
    case kueue::State::kPending:
      break;
  }
  if (!spec.suspend) {
    // Evicted (or queued again): stop. The agents persist their newest
    // flash checkpoint as their pods stop; the job resumes from it.
    const bool evicted = view.state == kueue::State::kEvicted;
    const std::string msg =
        evicted ? absl::StrCat("evicted by Kueue (", view.reason, ": ", view.message,
                               "); its pods stop after persisting the newest checkpoint, and it resumes from it "
                               "when admitted again")
                : absl::StrCat("queued in LocalQueue ", queue, ": waiting for Kueue to admit its Workload ", wname);
    if (!PatchStatus(job, {{"phase", evicted ? "Preempted" : "Queued"}, {"message", msg}, {"queue", queue}}).ok()) {
      return false;
    }
    if (evicted) Event(job, "Preempted", msg, true);
    patch_job(kueue::SuspendPatch(job), "suspend (evicted by Kueue)");
    return false;
  }
  if (view.state == kueue::State::kEvicted && view.quota_reserved) {
    // Suspended with quota still held: an eviction whose pods are going.
    // The quota goes back once the suspended path, which deletes them,
    // finds none left (Kueue then queues the Workload again).
    *when_pods_gone = [this, job, wl = *std::move(wl), view, wpath, ns, wname, queue] {
      auto r = client_->Patch(wpath + "/status",
                              kueue::UnsetQuotaPatch(wl, view.reason,
                                                     view.message.empty() ? "The job was stopped" : view.message,
                                                     k8s::Rfc3339Now()),
                              absl::StrCat("give back the quota of Workload ", ns, "/", wname));
      if (!r.ok()) {
        spdlog::warn("operator: {}", std::string(r.status().message()));
        return;
      }
      Event(job, "Requeued",
            absl::StrCat("its pods are gone: gave the quota of ClusterQueue ", view.cluster_queue,
                         " back; queued again in LocalQueue ", queue),
            false);
    };
  }
  return true;  // the suspended path deletes what is left of its pods
}

void Operator::Reconcile(const std::string& key) {
  auto obj = jobs_->Get(key);
  if (!obj.has_value()) return;  // deleted: the garbage collector removes what it owned
  const Json& job = *obj;
  const std::string ns = kube::Str(job, {"metadata", "namespace"});
  const std::string name = kube::Str(job, {"metadata", "name"});
  const std::string phase = kube::Str(job, {"status", "phase"});
  const std::string queue = kueue::QueueName(job);
  if (Finished(job)) {
    if (!queue.empty()) FinishWorkload(job);
    return;
  }
  auto spec = k8s::ParseElasticJob(job);
  if (!spec.ok()) {
    if (kube::Str(job, {"status", "message"}) != spec.status().message() &&
        PatchStatus(job, {{"phase", "Failed"}, {"message", std::string(spec.status().message())}}).ok()) {
      Event(job, "InvalidSpec", std::string(spec.status().message()), true);
    }
    return;
  }
  // Deletes the selected pods; returns how many exist (deleting ones
  // included), -1 when they cannot be listed.
  auto delete_pods = [&](const std::string& selector, const std::string& why) {
    auto list = client_->Get(absl::StrCat(kube::CollectionPath("v1", "pods", ns), "?labelSelector=",
                                          kube::UrlEncode(selector)),
                             absl::StrCat("list pods of ElasticJob ", key));
    if (!list.ok()) return -1;
    int exist = 0;
    for (const Json& pod : list->value("items", Json::array())) {
      ++exist;
      if (kube::Find(pod, {"metadata", "deletionTimestamp"}) != nullptr) continue;
      const std::string pn = kube::Str(pod, {"metadata", "name"});
      auto r = client_->Delete(kube::ObjectPath("v1", "pods", ns, pn), Json{{"gracePeriodSeconds", 30}},
                               absl::StrCat("delete pod ", ns, "/", pn));
      if (r.ok()) spdlog::info("operator: deleted pod {}/{} ({})", ns, pn, why);
    }
    return exist;
  };
  std::function<void()> when_pods_gone;  // Kueue: give the quota back
  if (!queue.empty() && !ReconcileKueue(job, *spec, queue, &when_pods_gone)) return;
  if (spec->suspend) {
    // Under Kueue the suspension is Kueue's: queued (not admitted yet) or
    // preempted (evicted after it ran).
    const bool preempted = phase == "Preempted";
    const std::string suspended_phase = queue.empty() ? "Suspended" : preempted ? "Preempted" : "Queued";
    if (phase != suspended_phase) {
      const std::string msg = queue.empty() ? "suspended (spec.suspend); set it to false to resume"
                                            : absl::StrCat("queued in LocalQueue ", queue,
                                                           ": waiting for Kueue to admit its Workload ",
                                                           kueue::WorkloadName(*spec));
      if (!PatchStatus(job, {{"phase", suspended_phase}, {"message", msg}, {"queue", queue.empty() ? Json(nullptr) : Json(queue)}})
               .ok()) {
        return;
      }
      if (queue.empty()) Event(job, "Suspended", "the job is suspended: its master and worker pods are deleted", false);
    }
    // Every time, not once: a master that was still replacing pods when it
    // was told to stop may have created one more. The workers first: as
    // their agents stop they persist their newest flash checkpoint and
    // report it to the master, which commits it; the master (fenced: it
    // replaces no pod) exits once they have left, and its pod is deleted
    // when no worker pod is left.
    const int workers_left = delete_pods(spec->WorkerSelector(), "the job is suspended");
    const int masters_left = workers_left == 0 ? delete_pods(spec->MasterSelector(), "the job is suspended") : 1;
    // Until they are gone: the next step (the master pod's deletion; under
    // Kueue, giving the quota back) follows them within a second.
    if (workers_left != 0 || masters_left != 0) {
      EnqueueAfter(key, 1.0);
    } else if (when_pods_gone) {
      when_pods_gone();
    }
    // Its workers are gone: the next master starts the job anew (from its
    // checkpoints), not from the state of a round no pod runs any more.
    const std::string state = spec->name + "-master-state";
    auto r = client_->Delete(kube::ObjectPath("v1", "configmaps", ns, state), Json{},
                             absl::StrCat("delete ConfigMap ", ns, "/", state));
    if (!r.ok() && !absl::IsNotFound(r.status())) spdlog::warn("operator: {}", std::string(r.status().message()));
    return;
  }
  for (auto [api, plural, object] :
       {std::tuple<const char*, const char*, Json>{"v1", "secrets", k8s::BuildTokenSecret(*spec, RandomHex(16))},
        {"v1", "serviceaccounts", k8s::BuildMasterServiceAccount(*spec)},
        {"rbac.authorization.k8s.io/v1", "rolebindings", k8s::BuildMasterRoleBinding(*spec)},
        {"v1", "services", k8s::BuildMasterService(*spec)}}) {
    if (absl::Status s = EnsureObject(api, plural, ns, object); !s.ok()) {
      spdlog::warn("operator: ElasticJob {}: {}", key, std::string(s.message()));
      return;  // retried at the next resync
    }
  }
  // Lets the agents read the job's Lease (where a master that replaced a lost
  // one serves). Without it the job still runs; a lost master restarts it.
  if (absl::Status s = EnsureObject("rbac.authorization.k8s.io/v1", "rolebindings", ns,
                                    k8s::BuildWorkerRoleBinding(*spec));
      !s.ok()) {
    spdlog::warn("operator: ElasticJob {}: {} (the agents cannot find a master pod that replaced a lost one: apply "
                 "deploy/02-rbac.yaml)",
                 key, std::string(s.message()));
  }
  // The master pod is <job>-master-<status.masterGeneration>, read from the
  // API server, not the cache: a cache that has not seen the newest master
  // yet must not make a second one. Every decision below is written to the
  // status (resourceVersion-conditional) before it is carried out, so one
  // made from a stale view of the job is refused and retried, never doubled.
  const int restarts = static_cast<int>(kube::Int(job, {"status", "masterRestarts"}));
  const int generation = static_cast<int>(kube::Int(job, {"status", "masterGeneration"}));
  int next_generation = generation + 1;
  // Under Kueue the phase stays Admitted (with the admission's message)
  // until the master says Pending or Running.
  const bool admitted = phase == "Admitted";
  if (generation == 0) {
    if (!PatchStatus(job, {{"phase", admitted ? "Admitted" : "Pending"},
                           {"message", admitted ? kube::Str(job, {"status", "message"}) : "starting the master"},
                           {"masterRestarts", 0},
                           {"masterGeneration", next_generation},
                           {"admittedAt", k8s::Rfc3339Precise(absl::Now())}})
             .ok()) {
      return;
    }
  } else {
    const std::string current_name = absl::StrCat(spec->MasterName(), "-", generation);
    auto current = client_->Get(kube::ObjectPath("v1", "pods", ns, current_name),
                                absl::StrCat("get pod ", ns, "/", current_name));
    if (!current.ok() && !absl::IsNotFound(current.status())) {
      spdlog::warn("operator: {}", std::string(current.status().message()));
      return;  // retried at the next resync
    }
    std::string how = "its pod is gone";
    bool deleting = true;
    // A master that saw its job suspended stops and exits so, touching
    // nothing: the suspension, not a failure, ended it (even when this
    // operator never saw the job suspended: suspend and resume within a
    // moment).
    bool stopped_suspended = false;
    if (current.ok()) {
      const std::string mphase = kube::Str(*current, {"status", "phase"});
      deleting = kube::Find(*current, {"metadata", "deletionTimestamp"}) != nullptr;
      if (!deleting && mphase != "Succeeded" && mphase != "Failed") return;  // running (or starting)
      how = HowEnded(*current);
      // A master that exited by itself decided the job: 0 succeeded, 1
      // failed, 2 invalid job (it writes the final status before it exits;
      // this covers a status write that did not get through). Only a master
      // that was killed (a signal, the OOM killer), evicted or deleted is
      // replaced.
      const int64_t code = MasterExitCode(*current);
      stopped_suspended = code == k8s::kMasterExitSuspended;
      if (!deleting && (code == 0 || code == 1 || code == 2)) {
        const std::string msg = code == 0 ? "job succeeded (its master exited 0)"
                                          : absl::StrCat("job failed: its master exited ", code, " (", how,
                                                         "); see the master pod's log");
        if (PatchStatus(job, {{"phase", code == 0 ? "Succeeded" : "Failed"},
                              {"message", msg},
                              {"completionTime", k8s::Rfc3339Now()}})
                .ok()) {
          Event(job, code == 0 ? "Succeeded" : "Failed", msg, code != 0);
        }
        return;
      }
    }
    if (phase == "Suspended" || phase == "Preempted" || phase == "Queued" || admitted || stopped_suspended) {
      // Resuming: its master was deleted or stopped for the suspension, not
      // lost (the master never overwrites the phase Suspended: its status
      // writes are conditional on a read that shows the job not suspended).
      if (!PatchStatus(job, {{"phase", admitted ? "Admitted" : "Pending"},
                             {"message", admitted ? kube::Str(job, {"status", "message"})
                                                  : "resuming: starting a new master"},
                             {"masterGeneration", next_generation},
                             {"admittedAt", k8s::Rfc3339Precise(absl::Now())}})
               .ok()) {
        return;
      }
      Event(job, "Resumed",
            phase == "Preempted" || admitted
                ? "admitted again by Kueue: starting a new master (the job resumes from the checkpoint it persisted "
                  "when it was preempted)"
            : phase == "Suspended"
                ? "spec.suspend is false: starting a new master (the job resumes from its checkpoints)"
                : absl::StrCat("master pod ", current_name, " stopped for a suspension that was lifted before its "
                               "pods were deleted; starting master ", next_generation,
                               ", which takes the job over"),
            false);
    } else if (restarts >= options_.max_master_restarts) {
      // The master ended, but the job did not finish: it crashed, was evicted or deleted.
      const std::string msg = absl::StrCat("job failed: its master pod ended ", restarts + 1, " times (last: ",
                                           current_name, " ", how, ")");
      if (!PatchStatus(job, {{"phase", "Failed"}, {"message", msg}, {"completionTime", k8s::Rfc3339Now()}}).ok()) {
        return;
      }
      Event(job, "Failed", msg, true);
      delete_pods(spec->WorkerSelector(), "the job failed");
      return;
    } else {
      if (!PatchStatus(job, {{"masterRestarts", restarts + 1}, {"masterGeneration", next_generation}}).ok()) return;
      Event(job, "MasterRestarted",
            absl::StrCat("master pod ", current_name, " ended (", how, ") before the job finished; starting master ",
                         next_generation, " (", restarts + 1, "/", options_.max_master_restarts,
                         " master restarts)"),
            true);
    }
    if (current.ok() && !deleting) {
      // It ended: its pod object only holds its logs.
      auto r = client_->Delete(kube::ObjectPath("v1", "pods", ns, current_name), Json{{"gracePeriodSeconds", 0}},
                               absl::StrCat("delete pod ", ns, "/", current_name));
      if (!r.ok() && !absl::IsNotFound(r.status())) spdlog::warn("operator: {}", std::string(r.status().message()));
    }
  }
  k8s::MasterPodParams mp;
  mp.generation = next_generation;
  mp.image = !spec->master_image.empty() ? spec->master_image : options_.image;
  if (mp.image.empty()) {
    // The workers' image carries ballast too (it is built FROM the ballast image).
    mp.image = spec->pod_template["spec"]["containers"][0].value("image", "");
  }
  mp.advertise = options_.master_address;
  mp.ballast = options_.ballast;
  mp.journal_dir = options_.master_journal;
  Json pod = k8s::BuildMasterPod(*spec, mp);
  if (const Json* a = kube::Find(job, {"metadata", "annotations", kueue::kMasterPlacementAnnotation});
      !queue.empty() && a != nullptr && a->is_string()) {
    // Where Kueue admitted the master pod set.
    Json placement = Json::parse(a->get<std::string>(), nullptr, false);
    if (!placement.is_discarded()) kueue::ApplyPlacement(kueue::Placement::FromJson(placement), &pod["spec"]);
  }
  auto r = client_->Create(kube::CollectionPath("v1", "pods", ns), pod,
                           absl::StrCat("create pod ", ns, "/", kube::Str(pod, {"metadata", "name"})));
  if (!r.ok() && !absl::IsAlreadyExists(r.status())) {
    Event(job, "MasterCreateFailed", std::string(r.status().message()), true);
    return;
  }
  if (r.ok()) Event(job, "MasterCreated", absl::StrCat("created master pod ", kube::Str(pod, {"metadata", "name"})), false);
}

}  // namespace ballast::op
