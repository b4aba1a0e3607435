#include "operator/operator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/net.h"
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

void Operator::Reconcile(const std::string& key) {
  auto obj = jobs_->Get(key);
  if (!obj.has_value()) return;  // deleted: the garbage collector removes what it owned
  const Json& job = *obj;
  const std::string ns = kube::Str(job, {"metadata", "namespace"});
  const std::string name = kube::Str(job, {"metadata", "name"});
  const std::string phase = kube::Str(job, {"status", "phase"});
  if (Finished(job)) return;
  auto spec = k8s::ParseElasticJob(job);
  if (!spec.ok()) {
    if (kube::Str(job, {"status", "message"}) != spec.status().message() &&
        PatchStatus(job, {{"phase", "Failed"}, {"message", std::string(spec.status().message())}}).ok()) {
      Event(job, "InvalidSpec", std::string(spec.status().message()), true);
    }
    return;
  }
  auto delete_pods = [&](const std::string& selector, const std::string& why) {
    auto list = client_->Get(absl::StrCat(kube::CollectionPath("v1", "pods", ns), "?labelSelector=",
                                          kube::UrlEncode(selector)),
                             absl::StrCat("list pods of ElasticJob ", key));
    if (!list.ok()) return;
    for (const Json& pod : list->value("items", Json::array())) {
      if (kube::Find(pod, {"metadata", "deletionTimestamp"}) != nullptr) continue;
      const std::string pn = kube::Str(pod, {"metadata", "name"});
      auto r = client_->Delete(kube::ObjectPath("v1", "pods", ns, pn), Json{{"gracePeriodSeconds", 30}},
                               absl::StrCat("delete pod ", ns, "/", pn));
      if (r.ok()) spdlog::info("operator: deleted pod {}/{} ({})", ns, pn, why);
    }
  };
  if (spec->suspend) {
    if (phase != "Suspended") {
      if (!PatchStatus(job, {{"phase", "Suspended"}, {"message", "suspended (spec.suspend); set it to false to resume"}})
               .ok()) {
        return;
      }
      Event(job, "Suspended", "the job is suspended: its master and worker pods are deleted", false);
    }
    // Every time, not once: a master that was still replacing pods when it
    // was told to stop may have created one more.
    delete_pods(spec->MasterSelector(), "the job is suspended");
    delete_pods(spec->WorkerSelector(), "the job is suspended");
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
  if (generation == 0) {
    if (!PatchStatus(job, {{"phase", "Pending"}, {"message", "starting the master"}, {"masterRestarts", 0},
                           {"masterGeneration", next_generation}})
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
    if (phase == "Suspended" || stopped_suspended) {
      // Resuming: its master was deleted or stopped for the suspension, not
      // lost (the master never overwrites the phase Suspended: its status
      // writes are conditional on a read that shows the job not suspended).
      if (!PatchStatus(job, {{"phase", "Pending"}, {"message", "resuming: starting a new master"},
                             {"masterGeneration", next_generation}})
               .ok()) {
        return;
      }
      Event(job, "Resumed",
            phase == "Suspended"
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
  auto r = client_->Create(kube::CollectionPath("v1", "pods", ns), pod,
                           absl::StrCat("create pod ", ns, "/", kube::Str(pod, {"metadata", "name"})));
  if (!r.ok() && !absl::IsAlreadyExists(r.status())) {
    Event(job, "MasterCreateFailed", std::string(r.status().message()), true);
    return;
  }
  if (r.ok()) Event(job, "MasterCreated", absl::StrCat("created master pod ", kube::Str(pod, {"metadata", "name"})), false);
}

}  // namespace ballast::op
