#include "operator/kueue.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::op::kueue {
namespace {

using ::testing::HasSubstr;
namespace k8s = scheduler::kubernetes;

Json Job() {
  return Json::parse(R"({
    "apiVersion": "ballast.dev/v1alpha1", "kind": "ElasticJob",
    "metadata": {"name": "train", "namespace": "ml", "uid": "u-1",
                 "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
    "spec": {
      "nodes": "2:4", "nprocPerNode": 2, "spares": 1,
      "template": {
        "spec": {
          "containers": [{"name": "trainer", "image": "img:1", "command": ["python3", "/w/train.py"],
                          "resources": {"requests": {"cpu": "2"}}}],
          "nodeSelector": {"zone": "a"}
        }
      }
    }
  })");
}

k8s::ElasticJobSpec Spec(const Json& job) {
  auto s = k8s::ParseElasticJob(job);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

// Applies an RFC 7386 merge patch (as the API server does for the job).
void MergePatch(Json* target, const Json& patch) {
  if (!patch.is_object()) {
    *target = patch;
    return;
  }
  if (!target->is_object()) *target = Json::object();
  for (const auto& [k, v] : patch.items()) {
    if (v.is_null()) {
      target->erase(k);
    } else {
      MergePatch(&(*target)[k], v);
    }
  }
}

TEST(Kueue, QueueNameIsTheLabel) {
  EXPECT_EQ(QueueName(Job()), "team-a");
  Json j = Job();
  j["metadata"]["labels"].erase(kQueueNameLabel);
  EXPECT_EQ(QueueName(j), "");
}

TEST(Kueue, WorkloadNameIsStablePerJobAndNewForANewJobOfTheSameName) {
  k8s::ElasticJobSpec a = Spec(Job());
  EXPECT_EQ(WorkloadName(a), WorkloadName(a));
  EXPECT_THAT(WorkloadName(a), ::testing::StartsWith("elasticjob-train-"));
  k8s::ElasticJobSpec b = a;
  b.uid = "u-2";
  EXPECT_NE(WorkloadName(a), WorkloadName(b));
  b.name = std::string(300, 'x');
  EXPECT_LE(WorkloadName(b).size(), 253u);
}

TEST(Kueue, WorkloadHasAMasterAndAWorkersPodSetOwnedByTheJob) {
  k8s::ElasticJobSpec spec = Spec(Job());
  k8s::MasterPodParams mp;
  mp.image = "ballast:1";
  Json wl = BuildWorkload(spec, k8s::BuildMasterPod(spec, mp), "team-a",
                          Priority{"high", "kueue.x-k8s.io", 1000});
  EXPECT_EQ(wl["apiVersion"], kApiVersion);
  EXPECT_EQ(wl["metadata"]["namespace"], "ml");
  EXPECT_EQ(wl["metadata"]["labels"][kJobUidLabel], "u-1");
  EXPECT_EQ(wl["metadata"]["labels"]["ballast.dev/job"], "train");
  EXPECT_EQ(wl["metadata"]["ownerReferences"][0]["uid"], "u-1");
  EXPECT_EQ(wl["metadata"]["ownerReferences"][0]["controller"], true);
  EXPECT_EQ(wl["spec"]["queueName"], "team-a");
  EXPECT_EQ(wl["spec"]["priority"], 1000);
  EXPECT_EQ(wl["spec"]["priorityClassRef"],
            Json::parse(R"({"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"})"));
  const Json& sets = wl["spec"]["podSets"];
  ASSERT_EQ(sets.size(), 2u);
  EXPECT_EQ(sets[0]["name"], kMasterPodSet);
  EXPECT_EQ(sets[0]["count"], 1);
  EXPECT_EQ(sets[0]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"], "100m");
  EXPECT_EQ(sets[1]["name"], kWorkerPodSet);
  EXPECT_EQ(sets[1]["count"], 5);  // MAX 4 + 1 spare
  EXPECT_EQ(sets[1]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"], "2");
  EXPECT_EQ(sets[1]["template"]["spec"]["restartPolicy"], "Never");
  EXPECT_EQ(sets[1]["minCount"], 2);  // nodes 2:4: Kueue may admit 2 to 5 worker pods
  Json fixed = Job();
  fixed["spec"]["nodes"] = "3";
  fixed["spec"].erase("spares");
  EXPECT_FALSE(BuildWorkload(Spec(fixed), Json::object(), "q", {})["spec"]["podSets"][1].contains("minCount"));
}

TEST(Kueue, APartialAdmissionCapsTheJobAtWhatWasAdmitted) {
  Json job = Job();  // nodes 2:4, 1 spare: asks for 5 worker pods
  job["spec"]["suspend"] = true;
  MergePatch(&job, AdmitPatch(job, Placement{}, Placement{}, 3, 5));
  EXPECT_EQ(job["metadata"]["annotations"][k8s::kAdmittedWorkersAnnotation], "3");
  k8s::ElasticJobSpec spec = Spec(job);
  EXPECT_EQ(spec.min_nodes, 2);
  EXPECT_EQ(spec.max_nodes, 3);
  EXPECT_EQ(spec.spares, 0);
  EXPECT_EQ(spec.requested_max_nodes + spec.requested_spares, 5);
  // The Workload a capped job would make still asks for what the spec says.
  EXPECT_EQ(BuildWorkload(spec, Json::object(), "q", {})["spec"]["podSets"][1]["count"], 5);
  MergePatch(&job, AdmitPatch(job, Placement{}, Placement{}, 5, 5));  // all of it: no cap
  EXPECT_FALSE(job["metadata"]["annotations"].contains(k8s::kAdmittedWorkersAnnotation));
  MergePatch(&job, AdmitPatch(job, Placement{}, Placement{}, 4, 5));
  EXPECT_EQ(Spec(job).max_nodes, 4);
  EXPECT_EQ(Spec(job).spares, 0);
  MergePatch(&job, SuspendPatch(job));
  EXPECT_EQ(Spec(job).max_nodes, 4);
  EXPECT_EQ(Spec(job).spares, 1);
  job["metadata"]["annotations"][k8s::kAdmittedWorkersAnnotation] = "1";  // below MIN
  EXPECT_THAT(k8s::ParseElasticJob(job).status().message(), HasSubstr(k8s::kAdmittedWorkersAnnotation));
}

Json Workload(const std::string& status_json) {
  Json wl = {{"metadata", {{"name", "w"}, {"generation", 2}}}};
  wl["status"] = Json::parse(status_json);
  return wl;
}

TEST(Kueue, ReadsPendingAdmittedEvictedAndFinished) {
  EXPECT_EQ(ReadWorkload(Workload("{}")).state, State::kPending);
  WorkloadView pending = ReadWorkload(Workload(R"({"conditions": [
      {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "couldn't assign flavors"}]})"));
  EXPECT_EQ(pending.state, State::kPending);
  EXPECT_EQ(pending.message, "couldn't assign flavors");
  EXPECT_FALSE(pending.quota_reserved);

  const std::string admission = R"("admission": {"clusterQueue": "cq", "podSetAssignments": [
      {"name": "master", "flavors": {"cpu": "default", "memory": "default"}, "count": 1},
      {"name": "workers", "flavors": {"cpu": "spot"}, "count": 3}]})";
  WorkloadView admitted = ReadWorkload(Workload("{" + admission + R"(, "conditions": [
      {"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"},
      {"type": "Evicted", "status": "False", "reason": "QuotaReserved"}]})"));
  EXPECT_EQ(admitted.state, State::kAdmitted);
  EXPECT_EQ(admitted.cluster_queue, "cq");
  ASSERT_NE(admitted.PodSet("master"), nullptr);
  EXPECT_EQ(admitted.PodSet("master")->flavors, std::vector<std::string>{"default"});
  EXPECT_EQ(admitted.PodSet("workers")->count, 3);
  EXPECT_EQ(admitted.PodSet("nope"), nullptr);

  // Quota reserved but not yet admitted (admission checks): not started.
  EXPECT_EQ(ReadWorkload(Workload("{" + admission + R"(, "conditions": [{"type": "QuotaReserved", "status": "True"}]})"))
                .state,
            State::kPending);

  WorkloadView evicted = ReadWorkload(Workload("{" + admission + R"(, "conditions": [
      {"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"},
      {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "Preempted to accommodate a higher priority Workload"}]})"));
  EXPECT_EQ(evicted.state, State::kEvicted);
  EXPECT_TRUE(evicted.quota_reserved);
  EXPECT_EQ(evicted.reason, "Preempted");

  EXPECT_EQ(ReadWorkload(Workload(R"({"conditions": [{"type": "Finished", "status": "True"}]})")).state,
            State::kFinished);
}

TEST(Kueue, PlacementComesFromTheFlavorsNodeLabelsAndTolerations) {
  std::map<std::string, Json> flavors = {
      {"spot", Json::parse(R"({"spec": {"nodeLabels": {"pool": "spot"},
                                       "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}})")},
      {"default", Json::parse(R"({"spec": {}})")},
      {"other", Json::parse(R"({"spec": {"nodeLabels": {"pool": "other"}}})")}};
  auto p = PlacementOf(PodSetAssignment{"workers", {"spot", "default"}, 2}, flavors);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->node_selector, Json::parse(R"({"pool": "spot"})"));
  EXPECT_EQ(p->tolerations.size(), 1u);
  auto unknown = PlacementOf(PodSetAssignment{"workers", {"gone"}, 2}, flavors);
  EXPECT_THAT(unknown.status().message(), HasSubstr("ResourceFlavor gone"));
  auto clash = PlacementOf(PodSetAssignment{"workers", {"spot", "other"}, 2}, flavors);
  EXPECT_THAT(clash.status().message(), HasSubstr("node label pool"));

  Json pod_spec = Json::parse(R"({"nodeSelector": {"zone": "a"}, "tolerations": [{"key": "x", "operator": "Exists"}]})");
  ApplyPlacement(*p, &pod_spec);
  ApplyPlacement(*p, &pod_spec);  // twice: nothing doubled
  EXPECT_EQ(pod_spec["nodeSelector"], Json::parse(R"({"zone": "a", "pool": "spot"})"));
  EXPECT_EQ(pod_spec["tolerations"].size(), 2u);
}

TEST(Kueue, AdmissionAddsThePlacementAndSuspensionRestoresTheTemplate) {
  Json job = Job();
  job["spec"]["suspend"] = true;
  Placement workers;
  workers.node_selector = {{"pool", "spot"}};
  workers.tolerations = Json::array({Json{{"key", "spot"}, {"operator", "Exists"}}});
  Placement master;
  master.node_selector = {{"pool", "cpu"}};
  MergePatch(&job, AdmitPatch(job, master, workers));
  EXPECT_EQ(job["spec"]["suspend"], false);
  EXPECT_EQ(job["spec"]["template"]["spec"]["nodeSelector"], Json::parse(R"({"zone": "a", "pool": "spot"})"));
  EXPECT_EQ(job["spec"]["template"]["spec"]["tolerations"].size(), 1u);
  EXPECT_EQ(Placement::FromJson(Json::parse(job["metadata"]["annotations"][kMasterPlacementAnnotation].get<std::string>()))
                .node_selector,
            master.node_selector);
  EXPECT_EQ(job["spec"]["template"]["spec"]["containers"][0]["image"], "img:1");  // the rest untouched

  MergePatch(&job, SuspendPatch(job));
  EXPECT_EQ(job["spec"]["suspend"], true);
  EXPECT_EQ(job["spec"]["template"]["spec"]["nodeSelector"], Json::parse(R"({"zone": "a"})"));
  EXPECT_FALSE(job["spec"]["template"]["spec"].contains("tolerations"));
  EXPECT_FALSE(job["metadata"]["annotations"].contains(kMasterPlacementAnnotation));
  EXPECT_FALSE(job["metadata"]["annotations"].contains(kOriginalPlacementAnnotation));

  // Admitted again elsewhere: the placement of the new admission only.
  workers.node_selector = {{"pool", "on-demand"}};
  workers.tolerations = Json::array();
  MergePatch(&job, AdmitPatch(job, master, workers));
  EXPECT_EQ(job["spec"]["template"]["spec"]["nodeSelector"], Json::parse(R"({"zone": "a", "pool": "on-demand"})"));
}

TEST(Kueue, SuspendingAJobNeverAdmittedOnlySuspendsIt) {
  Json patch = SuspendPatch(Job());
  EXPECT_EQ(patch, Json::parse(R"({"spec": {"suspend": true}})"));
}

TEST(Kueue, GivingTheQuotaBackClearsTheAdmission) {
  Json wl = Workload(R"({"admission": {"clusterQueue": "cq"}, "conditions": [
      {"type": "QuotaReserved", "status": "True", "lastTransitionTime": "t0"},
      {"type": "Admitted", "status": "True", "lastTransitionTime": "t0"},
      {"type": "Evicted", "status": "True", "reason": "Preempted", "lastTransitionTime": "t1"}]})");
  Json patch = UnsetQuotaPatch(wl, "Preempted", "Preempted to accommodate a higher priority Workload", "t2");
  EXPECT_TRUE(patch["status"]["admission"].is_null());
  MergePatch(&wl, patch);
  EXPECT_FALSE(wl["status"].contains("admission"));
  WorkloadView v = ReadWorkload(wl);
  EXPECT_EQ(v.state, State::kEvicted);  // until Kueue admits it again
  EXPECT_FALSE(v.quota_reserved);
  for (const Json& c : wl["status"]["conditions"]) {
    if (c["type"] == "QuotaReserved" || c["type"] == "Admitted") {
      EXPECT_EQ(c["status"], "False") << c.dump();
      EXPECT_EQ(c["lastTransitionTime"], "t2");
      EXPECT_EQ(c["observedGeneration"], 2);
    }
    if (c["type"] == "Requeued") {
      EXPECT_EQ(c["status"], "True");
    }
    if (c["type"] == "Evicted") {
      EXPECT_EQ(c["lastTransitionTime"], "t1");  // untouched
    }
  }
  Json fin = FinishedPatch(wl, true, "job succeeded", "t3");
  MergePatch(&wl, fin);
  EXPECT_EQ(ReadWorkload(wl).state, State::kFinished);
}

TEST(Kueue, QueuedTimeCountsFromCreationOrTheLastRequeue) {
  absl::Time now;
  std::string err;
  ASSERT_TRUE(absl::ParseTime(absl::RFC3339_full, "2026-12-04T10:00:30Z", &now, &err));
  Json wl = {{"metadata", {{"creationTimestamp", "2026-12-04T10:00:00Z"}}}};
  EXPECT_DOUBLE_EQ(QueuedSeconds(wl, now), 30);
  wl["status"]["conditions"] = Json::parse(R"([{"type": "Requeued", "status": "True",
                                                "lastTransitionTime": "2026-12-04T10:00:25Z"}])");
  EXPECT_DOUBLE_EQ(QueuedSeconds(wl, now), 5);
  EXPECT_EQ(QueuedSeconds(Json::object(), now), 0);
}

}  // namespace
}  // namespace ballast::op::kueue
