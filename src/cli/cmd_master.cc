// ballast master: one job master that agents on several hosts join with
// `ballast run --rdzv-endpoint HOST:PORT --token T ...`.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/health_flags.h"
#include "cli/http_flags.h"
#include "cli/tls_flags.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "common/tunables.h"
#include "master/master_server.h"
#include "scheduler/kubernetes/kubernetes_job.h"
#include "spdlog/spdlog.h"

namespace ballast::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

// Set in the master process a supervisor started.
constexpr char kSupervisedEnv[] = "BALLAST_MASTER_SUPERVISED";
// A master that keeps dying is not restarted forever.
constexpr int kMaxQuickRestarts = 5;
constexpr double kQuickRestartWindowS = 60;

// With --journal, `ballast master` runs the master in a child process and
// restarts it when it dies of a signal (a crash, the OOM killer, kill -9):
// the journal makes the new process the same job, and its agents keep
// training. An exit is the job's outcome (or a usage error) and is passed on;
// SIGINT/SIGTERM are forwarded. The child dies with this process.
int SuperviseMaster(const Args& args, const std::string& token, const std::string& journal) {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  using Clock = std::chrono::steady_clock;
  std::deque<Clock::time_point> restarts;
  for (int incarnation = 1;; ++incarnation) {
    SpawnOptions so;
    so.argv = {SelfExePath(), "master"};
    so.argv.insert(so.argv.end(), args.begin(), args.end());
    so.env = CurrentEnvironment();
    so.env["BALLAST_TOKEN"] = token;  // a generated token must survive the restart
    so.env[kSupervisedEnv] = "1";
    auto child = Subprocess::Spawn(so);
    if (!child.ok()) {
      std::fprintf(stderr, "ballast master: cannot start the master process: %s\n",
                   std::string(child.status().message()).c_str());
      return 1;
    }
    spdlog::info("master process pid {} started (incarnation {}); it is restarted from the journal {} if it dies",
                 child->pid(), incarnation, journal);
    std::optional<ExitStatus> st;
    int forwarded = 0;
    while (!(st = child->Wait(0.2)).has_value()) {
      if (const int sig = g_signal.load(); sig != 0 && forwarded == 0) {
        forwarded = sig;
        child->Signal(sig);
      }
    }
    if (forwarded != 0) return 128 + forwarded;
    if (st->signal == 0) return st->exit_code;
    const auto now = Clock::now();
    while (!restarts.empty() && std::chrono::duration<double>(now - restarts.front()).count() > kQuickRestartWindowS) {
      restarts.pop_front();
    }
    if (static_cast<int>(restarts.size()) >= kMaxQuickRestarts) {
      spdlog::error("the master process died of {} again: {} restarts within {} s, giving up (see its log above; "
                    "start `ballast master` with the same --journal to resume the job)",
                    st->Describe(), kMaxQuickRestarts, kQuickRestartWindowS);
      return 1;
    }
    restarts.push_back(now);
    spdlog::warn("the master process (pid {}) died of {}; restarting it from the journal {}", child->pid(),
                 st->Describe(), journal);
  }
}

}  // namespace

int MasterCommand(const Args& args) {
  CLI::App app{"Run a job master. Agents join it with `ballast run --rdzv-endpoint HOST:PORT`.", "master"};
  std::string nnodes = "1";
  master::MasterOptions opts;
  opts.max_restarts = 3;
  std::string token;
  scheduler::kubernetes::KubernetesJobOptions k8s;
  app.add_option("--nnodes", nnodes, "Nodes the job runs on: N or MIN:MAX (required unless --kubernetes-job)");
  app.add_option("--kubernetes-job,--kubernetes_job", k8s.job_name,
                 "Run the master of this ElasticJob: read its spec, create and replace its worker pods, keep its "
                 "status (what `ballast operator` runs in the job's master pod)");
  app.add_option("--namespace,-n", k8s.ns, "With --kubernetes-job: the job's namespace (default: the pod's own)");
  app.add_option("--kubeconfig", k8s.kubeconfig,
                 "With --kubernetes-job: a kubeconfig (default: $KUBECONFIG, else the pod's service account)");
  app.add_option("--node-unit,--node_unit", opts.node_unit,
                 "The world's node count is a multiple of this")->check(PositiveCount());
  app.add_option("--max-restarts,--max_restarts", opts.max_restarts,
                 "Worker-failure restarts before the job fails")->check(Count());
  app.add_option("--host", opts.bind_host, "Address to listen on")->capture_default_str();
  app.add_option("--port", opts.port, "Port to listen on (0: any free port)")->check(Port())->capture_default_str();
  HttpFlags http;
  http.Add(app);
  HealthFlags health;
  health.Add(app);
  app.add_option("--advertise-host", opts.advertise_host, "Host name agents use to reach this master");
  app.add_option("--token", token, "Job token agents must present (default: $BALLAST_TOKEN, else random)");
  app.add_option("--job-id,--rdzv-id,--rdzv_id", opts.job_id, "Job id (TORCHELASTIC_RUN_ID); default random");
  TlsFlags tls;
  tls.Add(app, /*server=*/true);
  bool no_supervise = false;
  app.add_option("--journal", opts.journal_dir,
                 "Directory for the master's journal: a master restarted with the same --journal resumes the job "
                 "and its agents keep training; this command then runs the master in a child process that it "
                 "restarts when it dies (default: no journal)");
  app.add_flag("--no-supervise,--no_supervise", no_supervise,
               "With --journal: run the master in this process (a supervisor of your own restarts it)");
  // Unset (-1): the tunables' defaults; a negative value given is refused, not taken for unset.
  app.add_option("--last-call", opts.last_call_s, "Seconds after the last join before a round at >= MIN completes")
      ->check(Seconds());
  app.add_option("--heartbeat-timeout", opts.heartbeat_timeout_s, "Seconds of agent silence before its node is dead")
      ->check(Seconds(/*positive=*/true));
  app.add_option("--wait-for-nodes", opts.wait_for_nodes_s, "Seconds a job below MIN nodes waits before failing")
      ->check(Seconds());
  app.add_flag("--network-check,--network_check", opts.precheck,
               "Pre-flight check (matmul + allreduce in node pairs) of every node before it trains; faulty nodes "
               "are excluded and must be replaced");
  app.add_flag("--exclude-stragglers,--exclude_stragglers", opts.exclude_stragglers,
               "Exclude (and so replace) stragglers: nodes slower than BALLAST_STRAGGLER_FACTOR (2) x the median, in "
               "the pre-flight check (--network-check) or at runtime for 3 s in a row (their compute time per "
               "forward pass, from ballast.step(step, model=))");
  // Set by `ballast launch|slurm --journal`, whose master runs in a child
  // process: the nodes its backend starts at once (MAX + spares).
  app.add_option("--expected-nodes", opts.expected_nodes, "Nodes started at once (the first round waits for them)")
      ->check(Count())
      ->group("");
  // Also theirs: after the job ends, keep serving (its status, JobFinished to
  // late agents) until SIGTERM, so the driver reads the outcome before any
  // agent's exit can look like a lost node; then exit by the outcome.
  bool serve_until_stopped = false;
  app.add_flag("--serve-until-stopped", serve_until_stopped, "After the job ends, serve until SIGTERM")->group("");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  absl::StatusOr<health::HealthPolicy> health_policy = health.Get();
  if (!health_policy.ok()) {
    std::fprintf(stderr, "ballast master: %s\n", std::string(health_policy.status().message()).c_str());
    return kUsageExit;
  }
  opts.health = *health_policy;
  if (!k8s.job_name.empty()) {
    // The job's spec holds the settings: flags that would contradict it are refused.
    if (app.count("--nnodes") > 0 || app.count("--node-unit") > 0 || app.count("--max-restarts") > 0 ||
        opts.precheck || opts.exclude_stragglers || tls.files.on()) {
      std::fprintf(stderr, "ballast master: with --kubernetes-job the ElasticJob's spec sets nodes, node unit, max "
                           "restarts and the network check, and --tls-* is not supported there yet; drop those flags\n");
      return kUsageExit;
    }
    k8s.bind_host = opts.bind_host;
    k8s.port = opts.port == 0 ? scheduler::kubernetes::kMasterPort : opts.port;
    k8s.advertise_host = opts.advertise_host;
    k8s.token = TokenFromFlagOrEnv(token);
    if (const char* pod = std::getenv("BALLAST_POD_NAME"); pod != nullptr) k8s.pod_name = pod;
    k8s.journal_dir = opts.journal_dir;
    if (http.port != -2) k8s.http_port = http.port;
    k8s.metrics_public = http.metrics_public;
    if (app.count("--on-nan") > 0 || app.count("--max-rollbacks") > 0 || app.count("--loss-spike") > 0 ||
        app.count("--replica-check-every") > 0 || health.no_skip_data) {
      std::fprintf(stderr, "ballast master: with --kubernetes-job the ElasticJob's spec sets onNan, maxRollbacks, "
                           "lossSpike, skipData and replicaCheckEvery; drop those flags\n");
      return kUsageExit;
    }
    if (!k8s.journal_dir.empty() && !no_supervise && std::getenv(kSupervisedEnv) == nullptr) {
      return SuperviseMaster(args, k8s.token, k8s.journal_dir);
    }
    std::signal(SIGINT, OnSignal);
    std::signal(SIGTERM, OnSignal);
    return scheduler::kubernetes::RunKubernetesJob(k8s, &g_signal);
  }
  if (app.count("--nnodes") == 0) {
    std::fprintf(stderr, "ballast master: --nnodes N|MIN:MAX is required (or --kubernetes-job NAME)\n");
    return kUsageExit;
  }

  auto range = ParseNodeRange(nnodes, "--nnodes");
  if (!range.ok()) {
    std::fprintf(stderr, "ballast master: %s\n", std::string(range.status().message()).c_str());
    return kUsageExit;
  }
  opts.min_nodes = range->min;
  opts.max_nodes = range->max;
  opts.token = TokenFromFlagOrEnv(token);
  if (opts.token.empty()) opts.token = RandomHex(16);
  http.Apply(&opts);
  opts.tls = tls.Get();
  if (!opts.journal_dir.empty() && !no_supervise && std::getenv(kSupervisedEnv) == nullptr) {
    return SuperviseMaster(args, opts.token, opts.journal_dir);
  }

  auto server = master::MasterServer::Start(opts);
  if (!server.ok()) {
    std::fprintf(stderr, "ballast master: %s\n", std::string(server.status().message()).c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? kUsageExit : 1;
  }
  auto& m = **server;
  if (serve_until_stopped) {
    // A driver's master (`ballast launch --journal`, `ballast ray run`): the driver starts the nodes and
    // prints how to reach the job; the token stays out of this log.
    std::printf("ballast master: job %s listening on %s\n", m.job_id().c_str(), m.address().c_str());
  } else {
    std::printf(
        "ballast master: job %s listening on %s\n"
        "  token: %s\n"
        "  start each node with:\n"
        "    BALLAST_TOKEN=%s ballast run --rdzv-endpoint %s --nnodes %s --nproc-per-node N train.py\n",
        m.job_id().c_str(), m.address().c_str(), m.token().c_str(), m.token().c_str(), m.address().c_str(),
        nnodes.c_str());
    if (m.http_port() > 0) std::printf("  dashboard: %s\n", m.dashboard_url().c_str());
  }
  std::fflush(stdout);

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::optional<master::JobResult> result;
  while (!result.has_value() && g_signal.load() == 0) result = m.WaitForFinish(0.2);
  if (!result.has_value()) {
    int sig = g_signal.load();
    spdlog::warn("master stopped by {} before the job finished; agents will lose their master", sig);
    m.Shutdown(0);
    return 128 + sig;
  }
  if (serve_until_stopped) {
    while (g_signal.load() == 0) usleep(20000);
  }
  m.Shutdown(Tunables::Get().finish_linger_s);
  if (result->succeeded) {
    std::printf("ballast master: job %s succeeded (%d restarts)\n", m.job_id().c_str(), result->restart_count);
    return 0;
  }
  std::fprintf(stderr, "ballast master: job %s failed: %s\n", m.job_id().c_str(), result->message.c_str());
  return 1;
}

}  // namespace ballast::cli
