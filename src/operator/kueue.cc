#include "operator/kueue.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ballast::op::kueue {
namespace {

namespace k8s = scheduler::kubernetes;

bool ConditionTrue(const Json& workload, const std::string& type, const Json** found = nullptr) {
  const Json* conds = kube::Find(workload, {"status", "conditions"});
  if (conds == nullptr || !conds->is_array()) return false;
  for (const Json& c : *conds) {
    if (c.value("type", "") != type) continue;
    if (found != nullptr) *found = &c;
    return c.value("status", "") == "True";
  }
  return false;
}

// conditions with `type` set (added or replaced; lastTransitionTime kept
// when the status did not change).
Json SetCondition(Json conditions, const std::string& type, const std::string& status, const std::string& reason,
                  const std::string& message, const std::string& now, int64_t generation) {
  if (!conditions.is_array()) conditions = Json::array();
  Json c = {{"type", type},       {"status", status}, {"reason", reason},
            {"message", message}, {"lastTransitionTime", now}, {"observedGeneration", generation}};
  for (Json& old : conditions) {
    if (old.value("type", "") != type) continue;
    if (old.value("status", "") == status && old.contains("lastTransitionTime")) {
      c["lastTransitionTime"] = old["lastTransitionTime"];
    }
    old = c;
    return conditions;
  }
  conditions.push_back(c);
  return conditions;
}

Json Conditions(const Json& workload) {
  const Json* c = kube::Find(workload, {"status", "conditions"});
  return c != nullptr && c->is_array() ? *c : Json::array();
}

// The template's own nodeSelector and tolerations.
Json OwnPlacement(const Json& job) {
  Json own = Json::object();
  const Json* spec = kube::Find(job, {"spec", "template", "spec"});
  own["nodeSelector"] = spec != nullptr && spec->contains("nodeSelector") ? (*spec)["nodeSelector"] : Json(nullptr);
  own["tolerations"] = spec != nullptr && spec->contains("tolerations") ? (*spec)["tolerations"] : Json(nullptr);
  return own;
}

}  // namespace

std::string QueueName(const Json& job) { return kube::Str(job, {"metadata", "labels", kQueueNameLabel}); }

std::string WorkloadName(const k8s::ElasticJobSpec& job) {
  // FNV-1a of the uid: stable, and distinct for a new job of the same name.
  uint32_t h = 2166136261u;
  for (unsigned char c : job.uid) h = (h ^ c) * 16777619u;
  std::string name = absl::StrCat("elasticjob-", job.name);
  if (name.size() > 240) name.resize(240);
  return absl::StrCat(name, "-", absl::StrFormat("%05x", h & 0xfffff));
}

Json BuildWorkload(const k8s::ElasticJobSpec& job, const Json& master_pod, const std::string& queue,
                   const Priority& priority) {
  Json wl = {{"apiVersion", kApiVersion}, {"kind", "Workload"}};
  wl["metadata"] = {{"name", WorkloadName(job)},
                    {"namespace", job.ns},
                    {"labels", {{kJobUidLabel, job.uid}, {k8s::kJobLabel, job.name}}},
                    {"ownerReferences", Json::array({k8s::OwnerReference(job)})}};
  Json master_template = {{"spec", master_pod.value("spec", Json::object())}};
  master_template["metadata"] = {{"labels", kube::Find(master_pod, {"metadata", "labels"}) != nullptr
                                                ? master_pod["metadata"]["labels"]
                                                : Json::object()}};
  Json worker_template = job.pod_template.is_object() ? job.pod_template : Json::object();
  if (!worker_template.contains("spec")) worker_template["spec"] = Json::object();
  // Kueue's defaulting would add these: a Workload made without its webhook
  // must carry them itself.
  if (!worker_template["spec"].contains("restartPolicy")) worker_template["spec"]["restartPolicy"] = "Never";
  wl["spec"] = {{"queueName", queue},
                {"active", true},
                {"podSets", Json::array({Json{{"name", kMasterPodSet}, {"count", 1}, {"template", master_template}},
                                         Json{{"name", kWorkerPodSet},
                                              {"count", job.requested_max_nodes + job.requested_spares},
                                              {"template", worker_template}}})}};
  if (job.min_nodes < job.requested_max_nodes + job.requested_spares) {
    // MIN:MAX: Kueue may admit fewer pods than asked (partial admission), never fewer than MIN.
    wl["spec"]["podSets"][1]["minCount"] = job.min_nodes;
  }
  wl["spec"]["priority"] = priority.value;
  if (!priority.class_name.empty()) {
    wl["spec"]["priorityClassRef"] = {
        {"group", priority.group},
        {"kind", priority.group == kGroup ? "WorkloadPriorityClass" : "PriorityClass"},
        {"name", priority.class_name}};
  }
  return wl;
}

const char* StateName(State s) {
  switch (s) {
    case State::kPending:
      return "pending";
    case State::kAdmitted:
      return "admitted";
    case State::kEvicted:
      return "evicted";
    case State::kFinished:
      return "finished";
  }
  return "?";
}

const PodSetAssignment* WorkloadView::PodSet(const std::string& name) const {
  for (const PodSetAssignment& p : podsets) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

WorkloadView ReadWorkload(const Json& wl) {
  WorkloadView v;
  const Json* admission = kube::Find(wl, {"status", "admission"});
  v.quota_reserved = admission != nullptr && admission->is_object() && ConditionTrue(wl, "QuotaReserved");
  if (admission != nullptr && admission->is_object()) {
    v.cluster_queue = admission->value("clusterQueue", "");
    if (const Json* psa = kube::Find(*admission, {"podSetAssignments"}); psa != nullptr && psa->is_array()) {
      for (const Json& a : *psa) {
        PodSetAssignment p;
        p.name = a.value("name", "");
        p.count = a.contains("count") && a["count"].is_number_integer() ? a["count"].get<int>() : -1;
        if (const Json* fl = kube::Find(a, {"flavors"}); fl != nullptr && fl->is_object()) {
          for (const auto& [resource, flavor] : fl->items()) {
            if (flavor.is_string() &&
                std::find(p.flavors.begin(), p.flavors.end(), flavor.get<std::string>()) == p.flavors.end()) {
              p.flavors.push_back(flavor.get<std::string>());
            }
          }
        }
        v.podsets.push_back(std::move(p));
      }
    }
  }
  const Json* cond = nullptr;
  if (ConditionTrue(wl, "Finished", &cond)) {
    v.state = State::kFinished;
  } else if (ConditionTrue(wl, "Evicted", &cond)) {
    v.state = State::kEvicted;
    v.reason = cond->value("reason", "");
    v.message = cond->value("message", "");
  } else if (v.quota_reserved && ConditionTrue(wl, "Admitted")) {
    v.state = State::kAdmitted;
  } else {
    v.state = State::kPending;
    if (ConditionTrue(wl, "QuotaReserved", &cond) || cond != nullptr) {
      v.reason = cond->value("reason", "");
      v.message = cond->value("message", "");
    }
  }
  return v;
}

double QueuedSeconds(const Json& wl, absl::Time now) {
  std::string since = kube::Str(wl, {"metadata", "creationTimestamp"});
  const Json* requeued = nullptr;
  ConditionTrue(wl, "Requeued", &requeued);
  if (requeued != nullptr && requeued->value("status", "") == "True" && requeued->contains("lastTransitionTime")) {
    since = requeued->value("lastTransitionTime", since);
  }
  const std::optional<absl::Time> t = k8s::ParseRfc3339(since);
  return t.has_value() ? std::max(0.0, absl::ToDoubleSeconds(now - *t)) : 0;
}

Placement Placement::FromJson(const Json& j) {
  Placement p;
  if (const Json* ns = kube::Find(j, {"nodeSelector"}); ns != nullptr && ns->is_object()) p.node_selector = *ns;
  if (const Json* t = kube::Find(j, {"tolerations"}); t != nullptr && t->is_array()) p.tolerations = *t;
  return p;
}

absl::StatusOr<Placement> PlacementOf(const PodSetAssignment& a, const std::map<std::string, Json>& flavors) {
  Placement p;
  for (const std::string& name : a.flavors) {
    auto it = flavors.find(name);
    if (it == flavors.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("pod set ", a.name, " was admitted on ResourceFlavor ", name, ", which cannot be read"));
    }
    if (const Json* labels = kube::Find(it->second, {"spec", "nodeLabels"}); labels != nullptr && labels->is_object()) {
      for (const auto& [k, val] : labels->items()) {
        if (p.node_selector.contains(k) && p.node_selector[k] != val) {
          return absl::FailedPreconditionError(absl::StrCat("pod set ", a.name, ": its flavors want node label ", k,
                                                            " to be both ", p.node_selector[k].dump(), " and ",
                                                            val.dump()));
        }
        p.node_selector[k] = val;
      }
    }
    if (const Json* t = kube::Find(it->second, {"spec", "tolerations"}); t != nullptr && t->is_array()) {
      for (const Json& tol : *t) {
        if (std::find(p.tolerations.begin(), p.tolerations.end(), tol) == p.tolerations.end()) {
          p.tolerations.push_back(tol);
        }
      }
    }
  }
  return p;
}

void ApplyPlacement(const Placement& p, Json* pod_spec) {
  if (!p.node_selector.empty()) {
    if (!pod_spec->contains("nodeSelector") || !(*pod_spec)["nodeSelector"].is_object()) {
      (*pod_spec)["nodeSelector"] = Json::object();
    }
    for (const auto& [k, v] : p.node_selector.items()) (*pod_spec)["nodeSelector"][k] = v;
  }
  if (!p.tolerations.empty()) {
    if (!pod_spec->contains("tolerations") || !(*pod_spec)["tolerations"].is_array()) {
      (*pod_spec)["tolerations"] = Json::array();
    }
    for (const Json& t : p.tolerations) {
      Json& have = (*pod_spec)["tolerations"];
      if (std::find(have.begin(), have.end(), t) == have.end()) have.push_back(t);
    }
  }
}

Json AdmitPatch(const Json& job, const Placement& master, const Placement& workers, int admitted_workers,
                int requested_workers) {
  Json patch = {{"spec", {{"suspend", false}}}};
  const std::string* original = nullptr;
  if (const Json* a = kube::Find(job, {"metadata", "annotations", kOriginalPlacementAnnotation});
      a != nullptr && a->is_string()) {
    original = a->get_ptr<const std::string*>();
  }
  // The template as the user wrote it: the one saved by an earlier admission
  // that was not undone (SuspendPatch restores it), else the current one.
  Json own = original != nullptr ? Json::parse(*original, nullptr, false) : OwnPlacement(job);
  if (own.is_discarded()) own = OwnPlacement(job);
  Json spec = Json::object();
  if (own["nodeSelector"].is_object()) spec["nodeSelector"] = own["nodeSelector"];
  if (own["tolerations"].is_array()) spec["tolerations"] = own["tolerations"];
  ApplyPlacement(workers, &spec);
  patch["spec"]["template"] = {{"spec",
                                {{"nodeSelector", spec.contains("nodeSelector") ? spec["nodeSelector"] : Json(nullptr)},
                                 {"tolerations", spec.contains("tolerations") ? spec["tolerations"] : Json(nullptr)}}}};
  patch["metadata"] = {{"annotations",
                        {{kMasterPlacementAnnotation, master.ToJson().dump()},
                         {kOriginalPlacementAnnotation, own.dump()},
                         {k8s::kAdmittedWorkersAnnotation,
                          admitted_workers >= 0 && admitted_workers < requested_workers
                              ? Json(std::to_string(admitted_workers))
                              : Json(nullptr)}}}};
  return patch;
}

Json SuspendPatch(const Json& job) {
  Json patch = {{"spec", {{"suspend", true}}}};
  const Json* a = kube::Find(job, {"metadata", "annotations", kOriginalPlacementAnnotation});
  if (a == nullptr || !a->is_string()) return patch;
  Json own = Json::parse(a->get<std::string>(), nullptr, false);
  if (own.is_discarded() || !own.is_object()) own = Json::object();
  // A merge patch: null deletes what the admission added where the user had nothing.
  Json ns = own.contains("nodeSelector") && own["nodeSelector"].is_object() ? own["nodeSelector"] : Json(nullptr);
  if (ns.is_object()) {
    // Keys the admission added and the user's template did not have are dropped.
    if (const Json* cur = kube::Find(job, {"spec", "template", "spec", "nodeSelector"}); cur != nullptr && cur->is_object()) {
      for (const auto& [k, v] : cur->items()) {
        if (!ns.contains(k)) ns[k] = nullptr;
      }
    }
  }
  patch["spec"]["template"] = {
      {"spec", {{"nodeSelector", ns}, {"tolerations", own.contains("tolerations") ? own["tolerations"] : Json(nullptr)}}}};
  patch["metadata"] = {{"annotations",
                        {{kMasterPlacementAnnotation, nullptr},
                         {kOriginalPlacementAnnotation, nullptr},
                         {k8s::kAdmittedWorkersAnnotation, nullptr}}}};
  return patch;
}

Json UnsetQuotaPatch(const Json& wl, const std::string& reason, const std::string& message, const std::string& now) {
  const int64_t gen = kube::Int(wl, {"metadata", "generation"}, 1);
  Json conds = Conditions(wl);
  const bool requeued = reason == "Preempted" || reason == "NodeFailures";
  conds = SetCondition(conds, "Requeued", requeued ? "True" : "False", reason, message, now, gen);
  conds = SetCondition(conds, "QuotaReserved", "False", "Pending", message, now, gen);
  if (ConditionTrue(wl, "Admitted")) {
    conds = SetCondition(conds, "Admitted", "False", "NoReservation", "The workload has no reservation", now, gen);
  }
  return Json{{"status", {{"admission", nullptr}, {"conditions", conds}}}};
}

Json FinishedPatch(const Json& wl, bool succeeded, const std::string& message, const std::string& now) {
  const int64_t gen = kube::Int(wl, {"metadata", "generation"}, 1);
  Json conds = SetCondition(Conditions(wl), "Finished", "True", succeeded ? "Succeeded" : "Failed", message, now, gen);
  return Json{{"status", {{"conditions", conds}}}};
}

}  // namespace ballast::op::kueue
