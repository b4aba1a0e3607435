// ballast operator: the ElasticJob controller (see src/operator/operator.h).
// Runs in the cluster as the ballast-operator Deployment (deploy/), or outside
// it with --kubeconfig.
#include <signal.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kube/kube_client.h"
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
  op::Operator oper(&client, o);
  return oper.Run(&g_signal);
}

}  // namespace ballast::cli
