// ballast simulate: the goodput of a training job at scale under failures,
// for three policies (manual, DLRover-like, Ballast), from a discrete-event
// simulation that drives the real job master (src/sim/simulator.h).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "sim/simulator.h"

namespace ballast::cli {
namespace {

// The chart: each policy's goodput over the run, and where each one's time
// went (matplotlib, Debian's python3-matplotlib).
constexpr char kPlotScript[] = R"PY(
import csv, json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
csv_path, json_path, png_path = sys.argv[1:4]
doc = json.load(open(json_path))
rows = list(csv.DictReader(open(csv_path)))
names = [n for n in ("manual", "dlrover", "ballast") if n in doc["policies"]]
colors = {"manual": "#9aa3b2", "dlrover": "#e0a030", "ballast": "#2e9e5b"}
fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
for n in names:
    pts = [(float(r["hours"]), float(r[n])) for r in rows if r.get(n)]
    if pts:
        a.plot([p[0] / 24 for p in pts], [100 * p[1] for p in pts], label=f"{n} ({100 * doc['policies'][n]['goodput']:.1f}%)", color=colors[n], lw=2)
a.set_xlabel("days"); a.set_ylabel("goodput so far (%)"); a.set_ylim(0, 100); a.grid(alpha=.3); a.legend(loc="lower right")
inp = doc["inputs"]
a.set_title(f"{inp['gpus']} GPUs, {inp['failure_rate_per_gpu_day'] * 100:.2f}%/GPU/day: P(failure a day) = {100 * doc['p_failure_per_day']:.1f}%")
parts = sorted({p for n in names for p in doc["policies"][n]["lost_s"]})
left = [0.0] * len(names)
for p in parts:
    hours = [doc["policies"][n]["lost_s"].get(p, 0) / 3600 for n in names]
    if max(hours) <= 0:
        continue
    b.barh(names, hours, left=left, label=p)
    left = [l + h for l, h in zip(left, hours)]
b.set_xlabel("hours lost"); b.set_title("time lost by cause"); b.legend(fontsize=8); b.grid(axis="x", alpha=.3)
fig.tight_layout()
fig.savefig(png_path, dpi=110)
)PY";

// Runs argv (no shell) and returns its exit status (-1: could not run it).
int RunProgram(const std::vector<std::string>& argv) {
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ) != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  return static_cast<bool>(f.flush());
}

}  // namespace

int SimulateCommand(const Args& args) {
  CLI::App app{"Simulate a training job's goodput under failures for the manual, DLRover-like and Ballast "
               "policies, driving the real job master on a virtual clock.",
               "simulate"};
  sim::SimOptions o;
  bool json = false;
  std::string csv_path, png_path, faults, policies = "manual,dlrover,ballast", python = "/usr/bin/python3";
  app.add_option("--gpus", o.gpus, "GPUs in the job")->check(PositiveCount())->capture_default_str();
  app.add_option("--gpus-per-node", o.gpus_per_node, "GPUs per node")->check(PositiveCount())->capture_default_str();
  app.add_option("--days", o.days, "Simulated days")->capture_default_str();
  app.add_option("--steps", o.steps, "End the job at this step instead of after --days")->check(Count<int64_t>());
  app.add_option("--failure-rate", o.failure_rate_per_gpu_day,
                 "Failures per GPU per day (0.0027: the 8% a month Ant Group reported)")
      ->capture_default_str();
  app.add_option("--restart-fixable", o.restart_fixable,
                 "Share of failures a process restart fixes; the rest need a new node (DLRover: 0.75)")
      ->capture_default_str();
  app.add_option("--node-replacement", o.node_replacement_s, "Seconds until a new node's agent joins")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--spares", o.spares, "Hot spare nodes (the ballast policy)")->check(Count())->capture_default_str();
  app.add_option("--step-time", o.step_time_s, "Seconds per training step")->capture_default_str();
  app.add_option("--seed", o.seed, "Random seed of the fault schedule")
      ->check(Count<uint64_t>())
      ->capture_default_str();
  app.add_option("--faults", faults, "A fault schedule instead of random faults: SECONDS:process|node,...");
  app.add_option("--job-start", o.job_start_s, "Seconds from a job's start to its first step")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--manual-delay", o.manual_delay_s, "manual: seconds until a person restarts the job")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--dlrover-restart", o.dlrover_restart_s, "dlrover: seconds a process restart takes")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--disk-ckpt-interval", o.disk_ckpt_interval_s,
                 "manual, dlrover: training seconds between disk checkpoints")
      ->capture_default_str();
  app.add_option("--disk-ckpt-cost", o.disk_ckpt_s, "manual, dlrover: seconds a disk checkpoint blocks training")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--ballast-restart", o.ballast_restart_s, "ballast: seconds a warm restart takes")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--flash-ckpt-cost", o.flash_ckpt_s, "ballast: seconds each step's flash checkpoint blocks training")
      ->check(Seconds())
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", o.heartbeat_timeout_s, "Seconds of silence before a node is lost")
      ->capture_default_str();
  app.add_option("--policies", policies, "Policies to run, comma-separated")->capture_default_str();
  app.add_flag("--json", json, "Print one JSON document");
  app.add_option("--csv", csv_path, "Write each policy's goodput over the run as CSV");
  app.add_option("--png", png_path, "Write a chart (goodput over time, time lost by cause)");
  app.add_option("--python", python, "Interpreter with matplotlib for --png")->capture_default_str();
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (!faults.empty()) {
    auto parsed = sim::ParseFaultSchedule(faults);
    if (!parsed.ok()) {
      std::fprintf(stderr, "ballast simulate: %s\n", std::string(parsed.status().message()).c_str());
      return kUsageExit;
    }
    o.faults = *parsed;
    o.random_faults = false;
  }
  o.policies.clear();
  for (absl::string_view name : absl::StrSplit(policies, ',', absl::SkipWhitespace())) {
    if (name == "manual") {
      o.policies.push_back(sim::Policy::kManual);
    } else if (name == "dlrover") {
      o.policies.push_back(sim::Policy::kDlrover);
    } else if (name == "ballast") {
      o.policies.push_back(sim::Policy::kBallast);
    } else {
      std::fprintf(stderr, "ballast simulate: --policies: unknown policy '%s' (manual, dlrover, ballast)\n",
                   std::string(name).c_str());
      return kUsageExit;
    }
  }
  if (o.policies.empty()) {
    std::fprintf(stderr, "ballast simulate: --policies names no policy (manual, dlrover, ballast)\n");
    return kUsageExit;
  }
  if (absl::Status s = sim::ValidateSimOptions(o); !s.ok()) {
    std::fprintf(stderr, "ballast simulate: %s\n", std::string(s.message()).c_str());
    return kUsageExit;
  }
  const sim::SimResult r = sim::Simulate(o);
  const std::string doc = sim::SimResultJson(o, r);
  std::fputs(json ? doc.c_str() : sim::SimResultText(o, r).c_str(), stdout);
  const std::string csv = sim::SimSeriesCsv(r);
  if (!csv_path.empty() && !WriteFile(csv_path, csv)) {
    std::fprintf(stderr, "ballast simulate: cannot write %s\n", csv_path.c_str());
    return 1;
  }
  if (!png_path.empty()) {
    char dir[] = "/tmp/ballast-simulate-XXXXXX";
    if (mkdtemp(dir) == nullptr) {
      std::perror("ballast simulate: mkdtemp");
      return 1;
    }
    const std::string base = dir;
    if (!WriteFile(base + "/series.csv", csv) || !WriteFile(base + "/result.json", doc) ||
        !WriteFile(base + "/plot.py", kPlotScript)) {
      std::fprintf(stderr, "ballast simulate: cannot write under %s\n", dir);
      return 1;
    }
    const std::string script = base + "/plot.py", series = base + "/series.csv", result = base + "/result.json";
    const int rc = RunProgram({python, script, series, result, png_path});
    for (const std::string& f : {script, series, result}) unlink(f.c_str());
    rmdir(dir);
    if (rc != 0) {
      std::fprintf(stderr,
                   "ballast simulate: the chart was not written: %s failed (it needs matplotlib: apt-get install "
                   "python3-matplotlib, or pass --python)\n",
                   python.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace ballast::cli
