// ballast operator: the ElasticJob controller (see src/operator/operator.h).
// Runs in the cluster as the ballast-operator Deployment (deploy/), or outside
// it with --kubeconfig.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/strings/str_cat.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/net.h"
#include "kube/kube_client.h"
#include "kube/lease.h"
#include "operator/operator.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

std::string EnvOr(const char* name, const std::string& def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : def;
}

}  // namespace

int OperatorCommand(const Args& args) {
  CLI::App app{"Run the ElasticJob operator: a master pod for every ElasticJob, recreated when it dies.", "operator"};
  op::OperatorOptions o;
  std::string kubeconfig;
  o.image = EnvOr("BALLAST_IMAGE", "");
  o.master_address = EnvOr("BALLAST_MASTER_ADDRESS", "service");
  o.master_journal = EnvOr("BALLAST_MASTER_JOURNAL", o.master_journal);
  app.add_option("--namespace,-n", o.ns, "Watch only this namespace (default: every namespace)");
  app.add_option("--image", o.image, "Image of the master pods unless a job names spec.masterImage "
                                     "(default: $BALLAST_IMAGE, else the job's worker image)");
  app.add_option("--master-address", o.master_address,
                 "How workers reach their master: service (its Service's DNS name) or pod-ip (clusters without DNS; "
                 "default: $BALLAST_MASTER_ADDRESS, else service)")
      ->check(CLI::IsMember({"service", "pod-ip"}));
  app.add_option("--master-journal", o.master_journal,
                 "Where each master pod keeps its journal (an emptyDir volume): a master process that dies is "
                 "restarted in its pod and resumes the job while the worker pods train on; none: no journal "
                 "(default: $BALLAST_MASTER_JOURNAL, else /var/lib/ballast/journal)");
  app.add_option("--kubeconfig", kubeconfig, "A kubeconfig (default: $KUBECONFIG, else the pod's service account)");
  app.add_option("--resync", o.resync_s, "Seconds between full reconciles")->check(CLI::PositiveNumber);
  app.add_option("--max-master-restarts", o.max_master_restarts,
                 "Master pods that may die before a job fails")->check(CLI::NonNegativeNumber);
  bool no_leader_elect = false;
  std::string lease_ns = EnvOr("POD_NAMESPACE", "");
  std::string lease_name = "ballast-operator";
  app.add_flag("--no-leader-elect", no_leader_elect,
               "Reconcile without the leader Lease (one replica only: two would both act)");
  app.add_option("--lease-namespace", lease_ns,
                 "Namespace of the leader Lease (default: $POD_NAMESPACE, else the kubeconfig's namespace)");
  app.add_option("--lease-name", lease_name, "Name of the leader Lease (coordination.k8s.io)");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (o.master_address != "service" && o.master_address != "pod-ip") {
    std::fprintf(stderr, "ballast operator: --master-address must be service or pod-ip, not %s\n",
                 o.master_address.c_str());
    return kUsageExit;
  }
  if (o.master_journal == "none") o.master_journal.clear();
  if (!o.master_journal.empty() && o.master_journal[0] != '/') {
    std::fprintf(stderr, "ballast operator: --master-journal must be an absolute path (or none), not %s\n",
                 o.master_journal.c_str());
    return kUsageExit;
  }
  auto cfg = kube::KubeConfig::Load(kubeconfig);
  if (!cfg.ok()) {
    std::fprintf(stderr, "ballast operator: %s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  spdlog::info("operator: Kubernetes API {} ({})", cfg->server, cfg->source);
  kube::KubeClient client(*cfg);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  // Replicas elect a leader: only the holder of the Lease reconciles; a
  // standby takes over when the leader stops renewing it (15 s) or at once
  // when it releases it (its pod being deleted).
  std::unique_ptr<kube::LeaderLease> lease;
  if (!no_leader_elect) {
    kube::LeaseOptions lo;
    lo.ns = lease_ns.empty() ? cfg->namespace_name : lease_ns;
    lo.name = lease_name;
    lo.identity = EnvOr("POD_NAME", absl::StrCat(HostName(), "-", getpid()));
    lo.what = absl::StrCat("the operator's leader Lease ", lo.ns, "/", lo.name);
    lease = std::make_unique<kube::LeaderLease>(&client, lo);
    absl::Status s = lease->Acquire(&g_signal, -1, [](const std::string& holder) {
      spdlog::info("operator: standby: {} leads; taking over when it stops renewing the Lease", holder);
    });
    if (!s.ok()) return 0;  // stopped while standing by
    spdlog::info("operator: leading as {}", lo.identity);
    o.leading = [l = lease.get()] { return l->held(); };
  }
  op::Operator oper(&client, o);
  const int rc = oper.Run(&g_signal);
  if (lease) lease->Release();
  return rc;
}

}  // namespace ballast::cli
