#include "scheduler/kubernetes/elastic_job.h"

#include "absl/time/time.h"
#include "scheduler/kubernetes/kubernetes_job.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::scheduler::kubernetes {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Json Job(Json spec_overrides = Json::object()) {
  Json job = Json::parse(R"({
    "apiVersion": "ballast.dev/v1alpha1", "kind": "ElasticJob",
    "metadata": {"name": "train", "namespace": "ml", "uid": "u-1"},
    "spec": {
      "nodes": "2:4", "nprocPerNode": 2,
      "template": {
        "metadata": {"labels": {"team": "nlp"}},
        "spec": {
          "containers": [{"name": "trainer", "image": "img:1",
                          "command": ["python3", "-u", "/w/train.py"], "args": ["--epochs", "3"],
                          "env": [{"name": "A", "value": "1"}]}],
          "nodeSelector": {"gpu": "a100"}
        }
      }
    }
  })");
  for (auto& [k, v] : spec_overrides.items()) job["spec"][k] = v;
  return job;
}

TEST(ParseElasticJob, ReadsTheSpecWithDefaults) {
  auto j = ParseElasticJob(Job());
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->ns, "ml");
  EXPECT_EQ(j->name, "train");
  EXPECT_EQ(j->min_nodes, 2);
  EXPECT_EQ(j->max_nodes, 4);
  EXPECT_EQ(j->nproc_per_node, 2);
  EXPECT_EQ(j->node_unit, 1);
  EXPECT_EQ(j->max_restarts, 3);
  EXPECT_EQ(j->max_replacements, 3);
  EXPECT_EQ(j->pending_timeout_s, 120);
  EXPECT_FALSE(j->network_check);
  EXPECT_EQ(j->health.on_nan, health::OnNan::kRollback);
  EXPECT_EQ(j->health.max_rollbacks, 3);
  EXPECT_EQ(j->health.replica_check_every, 100);
  EXPECT_TRUE(j->health.skip_data);
  auto h = ParseElasticJob(Job({{"onNan", "fail"}, {"maxRollbacks", 1}, {"lossSpike", 6}, {"skipData", false},
                                {"replicaCheckEvery", 20}}));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(health::Describe(h->health),
            "--on-nan fail --max-rollbacks 1 --loss-spike 6 --no-skip-data --replica-check-every 20");
  EXPECT_EQ(j->WorkerPodName(3, 2), "train-worker-3-2");
  EXPECT_EQ(j->WorkerSelector(), "ballast.dev/job=train,ballast.dev/role=worker");
}

TEST(ParseElasticJob, BadFieldsAreNamed) {
  struct Case {
    Json overrides;
    std::string field;
  } cases[] = {
      {{{"nodes", "4:2"}}, "spec.nodes"},
      {{{"nodes", "two"}}, "spec.nodes"},
      {{{"nprocPerNode", 0}}, "spec.nprocPerNode"},
      {{{"maxRestarts", -1}}, "spec.maxRestarts"},
      {{{"networkCheck", "yes"}}, "spec.networkCheck"},
      {{{"excludeStragglers", true}}, "spec.excludeStragglers"},
      {{{"template", Json::object()}}, "spec.template.spec.containers"},
      {{{"warmModules", "numpy,not a module"}}, "spec.warmModules"},
      {{{"onNan", "retry"}}, "spec.onNan"},
      {{{"maxRollbacks", -1}}, "spec.maxRollbacks"},
      {{{"lossSpike", 0.5}}, "spec.lossSpike"},
      {{{"skipData", "no"}}, "spec.skipData"},
      {{{"replicaCheckEvery", -5}}, "spec.replicaCheckEvery"},
      {{{"saveEvery", 0}}, "spec.saveEvery"},
      {{{"saveEvery", "sometimes"}}, "spec.saveEvery"},
      {{{"saveEvery", true}}, "spec.saveEvery"},
      {{{"mtbf", "soon"}}, "spec.mtbf"},
      {{{"ckptCopyShare", 0}}, "spec.ckptCopyShare"},
      {{{"ckptCopyShare", 1.5}}, "spec.ckptCopyShare"},
      {{{"ckptCopyShare", "half"}}, "spec.ckptCopyShare"},
  };
  for (const Case& c : cases) {
    auto j = ParseElasticJob(Job(c.overrides));
    EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument) << c.overrides.dump();
    EXPECT_THAT(std::string(j.status().message()), HasSubstr(c.field)) << c.overrides.dump();
  }
  Json no_cmd = Job();
  no_cmd["spec"]["template"]["spec"]["containers"][0].erase("command");
  EXPECT_THAT(std::string(ParseElasticJob(no_cmd).status().message()),
              HasSubstr("spec.template.spec.containers[0].command: required"));
}

TEST(WrapTrainingCommand, PythonScriptsModulesAndPrograms) {
  EXPECT_THAT(WrapTrainingCommand({"python3", "-u", "train.py", "--lr", "1"}),
              ElementsAre("--python", "python3", "train.py", "--lr", "1"));
  EXPECT_THAT(WrapTrainingCommand({"/usr/bin/python3.11", "-m", "pkg.train", "-x"}),
              ElementsAre("--python", "/usr/bin/python3.11", "--module", "pkg.train", "-x"));
  EXPECT_THAT(WrapTrainingCommand({"python", "-O", "train.py"}), ElementsAre("--no-python", "python", "-O", "train.py"));
  EXPECT_THAT(WrapTrainingCommand({"/opt/train.sh", "a"}), ElementsAre("--no-python", "/opt/train.sh", "a"));
}

TEST(ParseElasticJob, SaveEveryTakesAStepCountAsAnIntegerOrAString) {
  auto n = ParseElasticJob(Job({{"saveEvery", 10}}));
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->save_every, "10");
  auto a = ParseElasticJob(Job({{"saveEvery", "auto"}}));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->save_every, "auto");
  auto none = ParseElasticJob(Job({}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->save_every, "");
  EXPECT_EQ(none->mtbf, "");
  EXPECT_EQ(none->ckpt_copy_share, 0);
}

TEST(BuildWorkerPod, WrapsTheCommandAndKeepsTheTemplate) {
  auto job = ParseElasticJob(Job({{"networkCheck", true},
                                  {"hangTimeoutSeconds", 60},
                                  {"checkpointDir", "/ckpt"},
                                  {"warmModules", "transformers,numpy"},
                                  {"saveEvery", "auto:50"},
                                  {"mtbf", "6h"},
                                  {"ckptCopyShare", 0.1}}));
  ASSERT_TRUE(job.ok());
  WorkerPodParams p;
  p.node_rank = 1;
  p.incarnation = 2;
  p.master_endpoint = "train-master.ml.svc:29400";
  auto pod = BuildWorkerPod(*job, p);
  ASSERT_TRUE(pod.ok()) << pod.status();
  const Json& m = (*pod)["metadata"];
  EXPECT_EQ(m["name"], "train-worker-1-2");
  EXPECT_EQ(m["labels"]["ballast.dev/job"], "train");
  EXPECT_EQ(m["labels"]["ballast.dev/role"], "worker");
  EXPECT_EQ(m["labels"]["ballast.dev/node-rank"], "1");
  EXPECT_EQ(m["labels"]["ballast.dev/incarnation"], "2");
  EXPECT_EQ(m["labels"]["team"], "nlp");
  EXPECT_EQ(m["ownerReferences"][0]["kind"], "ElasticJob");
  EXPECT_EQ(m["ownerReferences"][0]["uid"], "u-1");
  const Json& spec = (*pod)["spec"];
  EXPECT_EQ(spec["restartPolicy"], "Never");
  EXPECT_EQ(spec["nodeSelector"]["gpu"], "a100");
  const Json& c = spec["containers"][0];
  EXPECT_FALSE(c.contains("args"));
  std::vector<std::string> cmd = c["command"];
  EXPECT_THAT(cmd, ElementsAre("ballast", "run", "--rdzv-endpoint", "train-master.ml.svc:29400", "--rdzv-id", "train",
                               "--nnodes", "2:4", "--nproc-per-node", "2", "--node-rank", "1", "--max-restarts", "3",
                               "--node-unit", "1", "--local-addr", "$(BALLAST_POD_IP)", "--network-check",
                               "--hang-timeout", "60", "--warm-modules", "transformers,numpy", "--save-every",
                               "auto:50", "--mtbf", "6h", "--ckpt-copy-share", "0.1", "--python", "python3",
                               "/w/train.py", "--epochs", "3"));
  std::map<std::string, Json> env;
  for (const Json& e : c["env"]) env[e["name"]] = e;
  EXPECT_EQ(env["A"]["value"], "1");
  EXPECT_EQ(env["BALLAST_TOKEN"]["valueFrom"]["secretKeyRef"]["name"], "train-token");
  EXPECT_EQ(env["BALLAST_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
  EXPECT_EQ(env["BALLAST_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
  EXPECT_EQ(env["BALLAST_CKPT_DIR"]["value"], "/ckpt");
  EXPECT_EQ(env["BALLAST_CHAOS_INCARNATION"]["value"], "2");
  // Where a master that replaced a lost one serves, and how long to wait for it.
  EXPECT_EQ(env["BALLAST_MASTER_LEASE"]["value"], "ml/train-master");
  EXPECT_EQ(env["BALLAST_RECONNECT_TIMEOUT_S"]["value"], "900");
  EXPECT_FALSE(spec.contains("affinity"));
  // The template's own reconnect timeout stays.
  Json j = Job();
  j["spec"]["template"]["spec"]["containers"][0]["env"].push_back({{"name", "BALLAST_RECONNECT_TIMEOUT_S"},
                                                                   {"value", "60"}});
  auto own = BuildWorkerPod(*ParseElasticJob(j), p);
  ASSERT_TRUE(own.ok());
  std::map<std::string, Json> own_env;
  for (const Json& e : (*own)["spec"]["containers"][0]["env"]) own_env[e["name"]] = e;
  EXPECT_EQ(own_env["BALLAST_RECONNECT_TIMEOUT_S"]["value"], "60");
}

TEST(BuildWorkerPod, AvoidedHostsBecomeAntiAffinityInEveryTerm) {
  Json j = Job();
  j["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
   ["nodeSelectorTerms"] = Json::parse(R"([{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                                           {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}])");
  auto job = ParseElasticJob(j);
  ASSERT_TRUE(job.ok());
  WorkerPodParams p;
  p.master_endpoint = "m:1";
  p.avoid_hosts = {"bad-node"};
  auto pod = BuildWorkerPod(*job, p);
  ASSERT_TRUE(pod.ok());
  const Json& terms = (*pod)["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                                ["nodeSelectorTerms"];
  ASSERT_EQ(terms.size(), 2u);
  for (const Json& t : terms) {
    ASSERT_EQ(t["matchExpressions"].size(), 2u);
    EXPECT_EQ(t["matchExpressions"][1],
              Json::parse(R"({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["bad-node"]})"));
  }
}

TEST(MasterObjects, PodServiceAndBindingNameTheJob) {
  auto job = ParseElasticJob(Job());
  ASSERT_TRUE(job.ok());
  Json pod = BuildMasterPod(*job, MasterPodParams{3, "ballast:0.1.0", "pod-ip", "ballast", ""});
  EXPECT_EQ(pod["metadata"]["name"], "train-master-3");
  EXPECT_EQ(pod["metadata"]["labels"]["ballast.dev/role"], "master");
  EXPECT_EQ(pod["spec"]["serviceAccountName"], "train-master");
  std::vector<std::string> cmd = pod["spec"]["containers"][0]["command"];
  EXPECT_THAT(cmd, ElementsAre("ballast", "master", "--kubernetes-job", "train", "--namespace", "ml", "--host",
                               "$(BALLAST_POD_IP)", "--port", "29400", "--advertise-host", "$(BALLAST_POD_IP)",
                               "--http-port", "29401"));
  EXPECT_FALSE(pod["spec"].contains("volumes"));
  EXPECT_EQ(pod["metadata"]["annotations"]["prometheus.io/scrape"], "true");
  EXPECT_EQ(pod["metadata"]["annotations"]["prometheus.io/port"], "29401");
  Json svc_pod = BuildMasterPod(*job, MasterPodParams{1, "img", "service", "ballast", ""});
  std::vector<std::string> svc_cmd = svc_pod["spec"]["containers"][0]["command"];
  EXPECT_EQ(svc_cmd[11], "train-master.ml.svc");
  const Json svc = BuildMasterService(*job);
  EXPECT_EQ(svc["spec"]["selector"]["ballast.dev/role"], "master");
  EXPECT_EQ(svc["spec"]["ports"][1], Json::parse(R"({"name": "http", "port": 29401, "targetPort": 29401})"));
  EXPECT_EQ(BuildMasterRoleBinding(*job)["roleRef"]["name"], "ballast-master");
  // The workers' service account may read the job's Lease (the template's, else "default").
  const Json wrb = BuildWorkerRoleBinding(*job);
  EXPECT_EQ(wrb["metadata"]["name"], "train-worker");
  EXPECT_EQ(wrb["roleRef"]["name"], "ballast-worker");
  EXPECT_EQ(wrb["subjects"][0]["name"], "default");
  Json j = Job();
  j["spec"]["template"]["spec"]["serviceAccountName"] = "trainer-sa";
  EXPECT_EQ(BuildWorkerRoleBinding(*ParseElasticJob(j))["subjects"][0]["name"], "trainer-sa");
  EXPECT_EQ(BuildTokenSecret(*job, "tok")["stringData"]["token"], "tok");
}

TEST(MasterObjects, PodKeepsItsJournalInAnEmptyDirNamedAfterItsUid) {
  auto job = ParseElasticJob(Job());
  ASSERT_TRUE(job.ok());
  Json pod = BuildMasterPod(*job, MasterPodParams{2, "img", "service", "ballast", "/var/lib/ballast/journal"});
  const Json& c = pod["spec"]["containers"][0];
  std::vector<std::string> cmd = c["command"];
  ASSERT_GE(cmd.size(), 2u);
  EXPECT_EQ(cmd[cmd.size() - 2], "--journal");
  EXPECT_EQ(cmd.back(), "/var/lib/ballast/journal/$(BALLAST_POD_UID)");
  bool uid_env = false;
  for (const Json& e : c["env"]) {
    uid_env = uid_env || (e["name"] == "BALLAST_POD_UID" && e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid");
  }
  EXPECT_TRUE(uid_env) << c.dump();
  EXPECT_EQ(c["volumeMounts"][0]["mountPath"], "/var/lib/ballast/journal");
  EXPECT_EQ(c["volumeMounts"][0]["name"], "journal");
  EXPECT_EQ(pod["spec"]["volumes"][0]["name"], "journal");
  EXPECT_TRUE(pod["spec"]["volumes"][0].contains("emptyDir"));
}

// status.time: what a master leaves for the next one (after a preemption)
// reads back as the breakdown it wrote, with the operator's queue and
// admission times beside it.
TEST(StatusTime, ReadsBackAsTheBreakdownTheNextMasterCarriesOn) {
  using Acc = master::GoodputAccountant;
  v1::Goodput g;
  g.set_known(true);
  g.set_wall_s(46.5);
  g.set_high_water_step(11);
  g.set_recomputed_steps(2);
  const std::vector<std::pair<Acc::Part, double>> parts = {
      {Acc::kProductive, 10}, {Acc::kRecompute, 0.5}, {Acc::kStartup, 2}, {Acc::kQueued, 30}, {Acc::kPreempted, 4}};
  for (int p = 0; p < Acc::kNumParts; ++p) {
    v1::GoodputPart* part = g.add_parts();
    part->set_part(std::string(Acc::PartName(static_cast<Acc::Part>(p))));
    for (const auto& [which, sec] : parts) {
      if (which == p) part->set_seconds(sec);
    }
  }
  const absl::Time at = absl::FromUnixMicros(1'800'000'000'250'000);
  Json status = {{"time", StatusTime(g, at)}, {"queuedSeconds", 30.0}, {"admittedAt", "2027-01-15T08:00:10.5Z"}};
  EXPECT_EQ(status["time"]["at"], "2027-01-15T08:00:00.250000Z");
  EXPECT_EQ(status["time"]["parts"]["preempted"], 4.0);
  const master::GoodputBefore b = GoodputBeforeFrom(status);
  EXPECT_DOUBLE_EQ(b.at_unix_s, 1'800'000'000.25);
  EXPECT_DOUBLE_EQ(b.admitted_unix_s, 1'800'000'010.5);
  EXPECT_DOUBLE_EQ(b.queued_s, 30.0);
  EXPECT_DOUBLE_EQ(b.breakdown.wall_s, 46.5);
  for (const auto& [which, sec] : parts) EXPECT_DOUBLE_EQ(b.breakdown.seconds[which], sec) << which;
  EXPECT_TRUE(b.breakdown.steps_seen);
  EXPECT_EQ(b.breakdown.high_water_step, 11);
  EXPECT_EQ(b.breakdown.recomputed_steps, 2);
  // A job no master ran yet: only the queue's time.
  const master::GoodputBefore fresh = GoodputBeforeFrom(Json{{"queuedSeconds", 12.5}, {"time", "garbage"}});
  EXPECT_DOUBLE_EQ(fresh.breakdown.wall_s, 0);
  EXPECT_DOUBLE_EQ(fresh.queued_s, 12.5);
  EXPECT_FALSE(fresh.empty());
  EXPECT_TRUE(GoodputBeforeFrom(Json::object()).empty());
}

}  // namespace
}  // namespace ballast::scheduler::kubernetes
