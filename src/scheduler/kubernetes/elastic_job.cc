#include "scheduler/kubernetes/elastic_job.h"

#include <algorithm>

#include <ctime>
#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/chaos.h"
#include "common/module_list.h"
#include "common/net.h"
#include "common/node_range.h"
#include "common/save_every.h"

namespace ballast::scheduler::kubernetes {
namespace {

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("ElasticJob spec.", field, ": ", what));
}

// An optional integer field with bounds; the default when absent.
absl::StatusOr<int> IntField(const Json& spec, const char* key, int def, int min, int max) {
  auto it = spec.find(key);
  if (it == spec.end() || it->is_null()) return def;
  if (!it->is_number_integer()) return Invalid(key, absl::StrCat("must be an integer, not ", it->dump()));
  int64_t v = it->get<int64_t>();
  if (v < min || v > max) return Invalid(key, absl::StrCat(v, " is out of range ", min, "..", max));
  return static_cast<int>(v);
}

absl::StatusOr<bool> BoolField(const Json& spec, const char* key) {
  auto it = spec.find(key);
  if (it == spec.end() || it->is_null()) return false;
  if (!it->is_boolean()) return Invalid(key, absl::StrCat("must be true or false, not ", it->dump()));
  return it->get<bool>();
}

std::string StrField(const Json& spec, const char* key) {
  auto it = spec.find(key);
  return it != spec.end() && it->is_string() ? it->get<std::string>() : "";
}

Json EnvValue(const std::string& name, const std::string& value) { return Json{{"name", name}, {"value", value}}; }
Json EnvField(const std::string& name, const std::string& path) {
  return Json{{"name", name}, {"valueFrom", {{"fieldRef", {{"fieldPath", path}}}}}};
}
Json EnvSecret(const std::string& name, const std::string& secret, const std::string& key) {
  return Json{{"name", name}, {"valueFrom", {{"secretKeyRef", {{"name", secret}, {"key", key}}}}}};
}

// Sets (replacing a same-named entry) environment variables of a container.
void SetEnv(Json* container, const std::vector<Json>& vars) {
  Json env = container->contains("env") && (*container)["env"].is_array() ? (*container)["env"] : Json::array();
  for (const Json& v : vars) {
    Json kept = Json::array();
    for (const Json& e : env) {
      if (e.value("name", "") != v["name"].get<std::string>()) kept.push_back(e);
    }
    kept.push_back(v);
    env = kept;
  }
  (*container)["env"] = env;
}

Json Labels(const ElasticJobSpec& job, const std::string& role) {
  return Json{{kJobLabel, job.name}, {kRoleLabel, role}, {"app.kubernetes.io/managed-by", "ballast"}};
}

Json Metadata(const ElasticJobSpec& job, const std::string& name, const std::string& role) {
  return Json{{"name", name},
              {"namespace", job.ns},
              {"labels", Labels(job, role)},
              {"ownerReferences", Json::array({OwnerReference(job)})}};
}

}  // namespace

std::string ElasticJobSpec::WorkerPodName(int node_rank, int incarnation) const {
  return absl::StrCat(name, "-worker-", node_rank, "-", incarnation);
}
std::string ElasticJobSpec::WorkerSelector() const {
  return absl::StrCat(kJobLabel, "=", name, ",", kRoleLabel, "=worker");
}
std::string ElasticJobSpec::MasterSelector() const {
  return absl::StrCat(kJobLabel, "=", name, ",", kRoleLabel, "=master");
}

absl::StatusOr<ElasticJobSpec> ParseElasticJob(const Json& obj) {
  ElasticJobSpec j;
  j.ns = kube::Str(obj, {"metadata", "namespace"});
  j.name = kube::Str(obj, {"metadata", "name"});
  j.uid = kube::Str(obj, {"metadata", "uid"});
  if (j.name.empty()) return absl::InvalidArgumentError("ElasticJob has no metadata.name");
  const Json* specp = kube::Find(obj, {"spec"});
  if (specp == nullptr || !specp->is_object()) return Invalid("", "missing: an ElasticJob needs a spec");
  const Json& spec = *specp;
  auto nodes_it = spec.find("nodes");
  if (nodes_it == spec.end()) return Invalid("nodes", "required: N or MIN:MAX, e.g. \"2:4\"");
  std::string nodes = nodes_it->is_number_integer() ? std::to_string(nodes_it->get<int64_t>())
                                                    : (nodes_it->is_string() ? nodes_it->get<std::string>() : "");
  auto range = ParseNodeRange(nodes, "spec.nodes");
  if (!range.ok()) return Invalid("nodes", std::string(range.status().message()));
  j.min_nodes = range->min;
  j.max_nodes = range->max;
  if (!spec.contains("nprocPerNode")) return Invalid("nprocPerNode", "required: workers per node, e.g. 8");
  auto nproc = IntField(spec, "nprocPerNode", 1, 1, 1024);
  if (!nproc.ok()) return nproc.status();
  j.nproc_per_node = *nproc;
  struct IntSpec {
    const char* key;
    int* out;
    int def, min, max;
  } ints[] = {{"nodeUnit", &j.node_unit, 1, 1, 100000},
              {"spares", &j.spares, 0, 0, 100000},
              {"maxRestarts", &j.max_restarts, 3, 0, 1000000},
              {"maxReplacements", &j.max_replacements, 3, 0, 1000000},
              {"maxRollbacks", &j.health.max_rollbacks, 3, 0, 1000000},
              {"replicaCheckEvery", &j.health.replica_check_every, 100, 0, 100000000},
              {"pendingTimeoutSeconds", &j.pending_timeout_s, 120, 1, 86400 * 30}};
  for (const IntSpec& f : ints) {
    auto v = IntField(spec, f.key, f.def, f.min, f.max);
    if (!v.ok()) return v.status();
    *f.out = *v;
  }
  struct BoolSpec {
    const char* key;
    bool* out;
  } bools[] = {{"networkCheck", &j.network_check},
               {"excludeStragglers", &j.exclude_stragglers},
               {"cordonBadNodes", &j.cordon_bad_nodes},
               {"suspend", &j.suspend}};
  for (const BoolSpec& f : bools) {
    auto v = BoolField(spec, f.key);
    if (!v.ok()) return v.status();
    *f.out = *v;
  }
  if (j.exclude_stragglers && !j.network_check) {
    return Invalid("excludeStragglers", "needs spec.networkCheck: true (stragglers are found by the pre-flight check)");
  }
  if (auto it = spec.find("hangTimeoutSeconds"); it != spec.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() < 0) return Invalid("hangTimeoutSeconds", "must be a number >= 0");
    j.hang_timeout_s = it->get<double>();
  }
  if (auto it = spec.find("lossSpike"); it != spec.end() && !it->is_null()) {
    if (!it->is_number()) return Invalid("lossSpike", "must be a number: a z-score >= 1, or 0 for off");
    j.health.loss_spike_z = it->get<double>();
  }
  if (const std::string on_nan = StrField(spec, "onNan"); !on_nan.empty()) {
    absl::StatusOr<health::OnNan> mode = health::ParseOnNan(on_nan);
    if (!mode.ok()) return Invalid("onNan", "must be rollback, fail or ignore");
    j.health.on_nan = *mode;
  }
  if (auto it = spec.find("skipData"); it != spec.end() && !it->is_null()) {
    if (!it->is_boolean()) return Invalid("skipData", "must be true or false");
    j.health.skip_data = it->get<bool>();
  }
  if (absl::Status s = health::Validate(j.health); !s.ok()) {
    return Invalid(j.health.loss_spike_z != 0 ? "lossSpike" : "maxRollbacks", std::string(s.message()));
  }
  j.requested_max_nodes = j.max_nodes;
  j.requested_spares = j.spares;
  if (const Json* a = kube::Find(obj, {"metadata", "annotations", kAdmittedWorkersAnnotation});
      a != nullptr && a->is_string()) {
    // Kueue's partial admission: never below MIN (Kueue's minCount).
    int admitted = 0;
    if (!absl::SimpleAtoi(a->get<std::string>(), &admitted) || admitted < j.min_nodes) {
      return absl::InvalidArgumentError(absl::StrCat("ElasticJob annotation ", kAdmittedWorkersAnnotation, ": ",
                                                     a->dump(), " is not a worker count >= spec.nodes' MIN (",
                                                     j.min_nodes, ")"));
    }
    j.max_nodes = std::min(j.max_nodes, admitted);
    j.spares = std::min(j.spares, admitted - j.max_nodes);
  }
  j.checkpoint_dir = StrField(spec, "checkpointDir");
  j.warm_modules = StrField(spec, "warmModules");
  if (auto modules = ParseModuleList(j.warm_modules); !modules.ok()) {
    return Invalid("warmModules", std::string(modules.status().message()));
  }
  // saveEvery: "auto", "auto:MAX" or a step count (a YAML integer too).
  if (auto it = spec.find("saveEvery"); it != spec.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      j.save_every = std::to_string(it->get<long long>());
    } else if (it->is_string()) {
      j.save_every = it->get<std::string>();
    } else {
      return Invalid("saveEvery", "must be a step count, \"auto\" or \"auto:MAX\"");
    }
    if (absl::Status s = ValidateSaveEvery(j.save_every, "spec.saveEvery"); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("ElasticJob ", s.message()));
    }
  }
  j.mtbf = StrField(spec, "mtbf");
  if (!j.mtbf.empty()) {
    if (auto m = ParseDurationSeconds(j.mtbf, "spec.mtbf"); !m.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("ElasticJob ", m.status().message()));
    }
  }
  if (auto it = spec.find("ckptCopyShare"); it != spec.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() <= 0 || it->get<double>() > 1) {
      return Invalid("ckptCopyShare", "must be a share of the time above 0 and at most 1, e.g. 0.25");
    }
    j.ckpt_copy_share = it->get<double>();
  }
  j.master_image = StrField(spec, "masterImage");
  const Json* tmpl = kube::Find(spec, {"template"});
  if (tmpl == nullptr || !tmpl->is_object()) return Invalid("template", "required: a pod template for the workers");
  const Json* containers = kube::Find(*tmpl, {"spec", "containers"});
  if (containers == nullptr || !containers->is_array() || containers->empty()) {
    return Invalid("template.spec.containers", "required: at least one container (the first one trains)");
  }
  const Json& c0 = (*containers)[0];
  const Json* cmd = kube::Find(c0, {"command"});
  if (cmd == nullptr || !cmd->is_array() || cmd->empty()) {
    return Invalid("template.spec.containers[0].command",
                   "required: the training command, e.g. [\"python3\", \"train.py\"] (ballast runs it on every "
                   "node under `ballast run`)");
  }
  for (const Json& a : *cmd) {
    if (!a.is_string()) return Invalid("template.spec.containers[0].command", "must be a list of strings");
  }
  j.pod_template = *tmpl;
  return j;
}

std::vector<std::string> WrapTrainingCommand(const std::vector<std::string>& command) {
  static const std::regex kPython(R"((.*/)?python[0-9.]*)");
  if (!command.empty() && std::regex_match(command[0], kPython)) {
    size_t i = 1;
    while (i < command.size() && command[i] == "-u") ++i;  // the agent runs workers unbuffered anyway
    if (i + 1 < command.size() && command[i] == "-m") {
      std::vector<std::string> out = {"--python", command[0], "--module"};
      out.insert(out.end(), command.begin() + static_cast<long>(i) + 1, command.end());
      return out;
    }
    if (i < command.size() && !command[i].empty() && command[i][0] != '-') {
      std::vector<std::string> out = {"--python", command[0]};
      out.insert(out.end(), command.begin() + static_cast<long>(i), command.end());
      return out;
    }
  }
  std::vector<std::string> out = {"--no-python"};
  out.insert(out.end(), command.begin(), command.end());
  return out;
}

Json OwnerReference(const ElasticJobSpec& job) {
  return Json{{"apiVersion", kApiVersion}, {"kind", kKind},       {"name", job.name},
              {"uid", job.uid},            {"controller", true}, {"blockOwnerDeletion", true}};
}

absl::StatusOr<Json> BuildWorkerPod(const ElasticJobSpec& job, const WorkerPodParams& p) {
  Json pod = {{"apiVersion", "v1"}, {"kind", "Pod"}};
  const std::string name = job.WorkerPodName(p.node_rank, p.incarnation);
  pod["metadata"] = Metadata(job, name, "worker");
  if (const Json* labels = kube::Find(job.pod_template, {"metadata", "labels"}); labels != nullptr && labels->is_object()) {
    for (const auto& [k, v] : labels->items()) {
      if (!pod["metadata"]["labels"].contains(k)) pod["metadata"]["labels"][k] = v;
    }
  }
  pod["metadata"]["labels"][kRankLabel] = std::to_string(p.node_rank);
  pod["metadata"]["labels"][kIncarnationLabel] = std::to_string(p.incarnation);
  if (const Json* ann = kube::Find(job.pod_template, {"metadata", "annotations"}); ann != nullptr && ann->is_object()) {
    pod["metadata"]["annotations"] = *ann;
  }
  Json spec = job.pod_template.value("spec", Json::object());
  if (!spec.contains("containers") || !spec["containers"].is_array() || spec["containers"].empty()) {
    return Invalid("template.spec.containers", "required: at least one container");
  }
  // A node is one pod: the agent restarts its workers itself, and a pod that
  // ended is replaced by a new incarnation, never restarted in place.
  spec["restartPolicy"] = "Never";
  Json& c = spec["containers"][0];
  std::vector<std::string> user;
  for (const char* key : {"command", "args"}) {
    if (c.contains(key) && c[key].is_array()) {
      for (const Json& a : c[key]) user.push_back(a.is_string() ? a.get<std::string>() : a.dump());
    }
  }
  if (user.empty()) return Invalid("template.spec.containers[0].command", "required: the training command");
  std::vector<std::string> cmd = {p.ballast,
                                  "run",
                                  "--rdzv-endpoint",
                                  p.master_endpoint,
                                  "--rdzv-id",
                                  job.name,
                                  "--nnodes",
                                  absl::StrCat(job.min_nodes, ":", job.max_nodes),
                                  "--nproc-per-node",
                                  std::to_string(job.nproc_per_node),
                                  "--node-rank",
                                  std::to_string(p.node_rank),
                                  "--max-restarts",
                                  std::to_string(job.max_restarts),
                                  "--node-unit",
                                  std::to_string(job.node_unit),
                                  // Other pods reach this one at its pod IP (a pod's host name
                                  // resolves only with a headless Service).
                                  "--local-addr",
                                  "$(BALLAST_POD_IP)"};
  if (job.network_check) cmd.push_back("--network-check");
  if (job.exclude_stragglers) cmd.push_back("--exclude-stragglers");
  if (job.hang_timeout_s > 0) cmd.insert(cmd.end(), {"--hang-timeout", absl::StrCat(job.hang_timeout_s)});
  if (!job.warm_modules.empty()) cmd.insert(cmd.end(), {"--warm-modules", job.warm_modules});
  if (!job.save_every.empty()) cmd.insert(cmd.end(), {"--save-every", job.save_every});
  if (!job.mtbf.empty()) cmd.insert(cmd.end(), {"--mtbf", job.mtbf});
  if (job.ckpt_copy_share > 0) cmd.insert(cmd.end(), {"--ckpt-copy-share", absl::StrCat(job.ckpt_copy_share)});
  for (std::string& a : WrapTrainingCommand(user)) cmd.push_back(std::move(a));
  c["command"] = cmd;
  c.erase("args");
  std::vector<Json> env = {EnvSecret("BALLAST_TOKEN", job.TokenSecret(), kTokenKey),
                           EnvField("BALLAST_POD_IP", "status.podIP"), EnvField("BALLAST_NODE_ID", "metadata.name"),
                           // Which agent of its node rank this is (fault drills: BALLAST_CHAOS).
                           EnvValue(kChaosIncarnationEnv, std::to_string(p.incarnation))};
  if (!job.checkpoint_dir.empty()) env.push_back(EnvValue("BALLAST_CKPT_DIR", job.checkpoint_dir));
  // A lost master pod is replaced and takes the job over: its Lease says
  // where it serves (whatever the address mode), and the agents train on
  // while it comes back - after a node loss, the pod eviction first (5 min
  // at Kubernetes' defaults), unless the template says otherwise.
  env.push_back(EnvValue(kMasterLeaseEnv, absl::StrCat(job.ns, "/", job.MasterName())));
  bool reconnect_set = false;
  if (c.contains("env") && c["env"].is_array()) {
    for (const Json& e : c["env"]) reconnect_set = reconnect_set || e.value("name", "") == kReconnectTimeoutEnv;
  }
  if (!reconnect_set) env.push_back(EnvValue(kReconnectTimeoutEnv, "900"));
  SetEnv(&c, env);
  if (!p.avoid_hosts.empty()) {
    // Required node anti-affinity, added to every term the template has
    // (terms are ORed: each must exclude the hosts).
    Json expr = {{"key", "kubernetes.io/hostname"}, {"operator", "NotIn"}, {"values", p.avoid_hosts}};
    Json& terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
    if (!terms.is_array() || terms.empty()) terms = Json::array({Json{{"matchExpressions", Json::array()}}});
    for (Json& t : terms) {
      if (!t.contains("matchExpressions") || !t["matchExpressions"].is_array()) t["matchExpressions"] = Json::array();
      t["matchExpressions"].push_back(expr);
    }
  }
  pod["spec"] = spec;
  return pod;
}

Json BuildMasterPod(const ElasticJobSpec& job, const MasterPodParams& p) {
  Json pod = {{"apiVersion", "v1"}, {"kind", "Pod"}};
  pod["metadata"] = Metadata(job, absl::StrCat(job.MasterName(), "-", p.generation), "master");
  const std::string advertise = p.advertise == "pod-ip" ? "$(BALLAST_POD_IP)"
                                                        : absl::StrCat(job.MasterName(), ".", job.ns, ".svc");
  Json container = {
      {"name", "master"},
      {"image", p.image},
      {"command",
       {p.ballast, "master", "--kubernetes-job", job.name, "--namespace", job.ns, "--host", "$(BALLAST_POD_IP)",
        "--port", std::to_string(kMasterPort), "--advertise-host", advertise, "--http-port",
        std::to_string(kMasterHttpPort)}},
      {"ports", Json::array({Json{{"name", "grpc"}, {"containerPort", kMasterPort}},
                             Json{{"name", "http"}, {"containerPort", kMasterHttpPort}}})},
      {"env",
       Json::array({EnvSecret("BALLAST_TOKEN", job.TokenSecret(), kTokenKey), EnvField("BALLAST_POD_IP", "status.podIP"),
                    EnvField("BALLAST_POD_NAME", "metadata.name")})},
      {"resources", {{"requests", {{"cpu", "100m"}, {"memory", "128Mi"}}}, {"limits", {{"memory", "1Gi"}}}}},
  };
  // Prometheus' kubernetes_sd pod role finds the master by these (the scrape
  // needs the job token: docs/kubernetes.md, "Master address, image, dashboard").
  pod["metadata"]["annotations"] = {{"prometheus.io/scrape", "true"},
                                    {"prometheus.io/port", std::to_string(kMasterHttpPort)},
                                    {"prometheus.io/path", "/metrics"}};
  pod["spec"] = {{"serviceAccountName", job.MasterName()},
                 {"restartPolicy", "Never"},
                 {"terminationGracePeriodSeconds", 30}};
  if (!p.journal_dir.empty()) {
    // `ballast master --journal` runs the master in a child process and
    // restarts it from the journal when it dies (a crash, the OOM killer):
    // the pod, its address and its worker pods stay. The folder is the pod's
    // own (its uid), so a master pod never resumes another pod's journal even
    // where the volume outlives the pod.
    container["command"].push_back("--journal");
    container["command"].push_back(absl::StrCat(p.journal_dir, "/$(BALLAST_POD_UID)"));
    container["env"].push_back(EnvField("BALLAST_POD_UID", "metadata.uid"));
    container["volumeMounts"] = Json::array({Json{{"name", "journal"}, {"mountPath", p.journal_dir}}});
    pod["spec"]["volumes"] = Json::array({Json{{"name", "journal"}, {"emptyDir", Json::object()}}});
  }
  pod["spec"]["containers"] = Json::array({container});
  return pod;
}

Json BuildMasterService(const ElasticJobSpec& job) {
  Json svc = {{"apiVersion", "v1"}, {"kind", "Service"}};
  svc["metadata"] = Metadata(job, job.MasterName(), "master");
  svc["spec"] = {{"selector", {{kJobLabel, job.name}, {kRoleLabel, "master"}}},
                 // Agents connect while the master pod starts.
                 {"publishNotReadyAddresses", true},
                 {"ports", Json::array({Json{{"name", "grpc"}, {"port", kMasterPort}, {"targetPort", kMasterPort}},
                                        Json{{"name", "http"}, {"port", kMasterHttpPort},
                                             {"targetPort", kMasterHttpPort}}})}};
  return svc;
}

Json BuildTokenSecret(const ElasticJobSpec& job, const std::string& token) {
  Json s = {{"apiVersion", "v1"}, {"kind", "Secret"}, {"type", "Opaque"}};
  s["metadata"] = Metadata(job, job.TokenSecret(), "token");
  s["stringData"] = {{kTokenKey, token}};
  return s;
}

Json BuildMasterServiceAccount(const ElasticJobSpec& job) {
  Json sa = {{"apiVersion", "v1"}, {"kind", "ServiceAccount"}};
  sa["metadata"] = Metadata(job, job.MasterName(), "master");
  return sa;
}

Json BuildMasterRoleBinding(const ElasticJobSpec& job) {
  Json rb = {{"apiVersion", "rbac.authorization.k8s.io/v1"}, {"kind", "RoleBinding"}};
  rb["metadata"] = Metadata(job, job.MasterName(), "master");
  rb["roleRef"] = {{"apiGroup", "rbac.authorization.k8s.io"}, {"kind", "ClusterRole"}, {"name", "ballast-master"}};
  rb["subjects"] = Json::array({Json{{"kind", "ServiceAccount"}, {"name", job.MasterName()}, {"namespace", job.ns}}});
  return rb;
}

Json BuildWorkerRoleBinding(const ElasticJobSpec& job) {
  Json rb = {{"apiVersion", "rbac.authorization.k8s.io/v1"}, {"kind", "RoleBinding"}};
  rb["metadata"] = Metadata(job, job.name + "-worker", "worker");
  rb["roleRef"] = {{"apiGroup", "rbac.authorization.k8s.io"}, {"kind", "ClusterRole"}, {"name", "ballast-worker"}};
  const Json spec = job.pod_template.value("spec", Json::object());
  std::string sa = spec.value("serviceAccountName", "");
  if (sa.empty()) sa = spec.value("serviceAccount", "");
  if (sa.empty()) sa = "default";
  rb["subjects"] = Json::array({Json{{"kind", "ServiceAccount"}, {"name", sa}, {"namespace", job.ns}}});
  return rb;
}

std::string Rfc3339Now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string Rfc3339Precise(absl::Time t) { return absl::FormatTime("%Y-%m-%d%ET%H:%M:%E6SZ", t, absl::UTCTimeZone()); }

std::optional<absl::Time> ParseRfc3339(const std::string& text) {
  absl::Time t;
  std::string err;
  if (text.empty() || !absl::ParseTime(absl::RFC3339_full, text, &t, &err)) return std::nullopt;
  return t;
}

Json BuildJobEvent(const Json& meta, const std::string& reason, const std::string& message, bool warning,
                   const std::string& component) {
  const std::string ns = kube::Str(meta, {"namespace"});
  const std::string name = kube::Str(meta, {"name"});
  const std::string now = Rfc3339Now();
  return Json{{"apiVersion", "v1"},
              {"kind", "Event"},
              {"metadata", {{"name", absl::StrCat(name, ".", RandomHex(8))}, {"namespace", ns}}},
              {"involvedObject",
               {{"apiVersion", kApiVersion}, {"kind", kKind}, {"name", name}, {"namespace", ns},
                {"uid", kube::Str(meta, {"uid"})}}},
              {"reason", reason},
              {"message", message.size() > 1000 ? message.substr(0, 997) + "..." : message},
              {"type", warning ? "Warning" : "Normal"},
              {"firstTimestamp", now},
              {"lastTimestamp", now},
              {"count", 1},
              {"source", {{"component", component}}}};
}

}  // namespace ballast::scheduler::kubernetes
