#include "scheduler/slurm/slurm_scheduler.h"

#include <signal.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler::slurm {
namespace {

constexpr char kPlaceholderPrefix[] = "no-free-node-for-rank-";
constexpr char kStepPrefix[] = "ballast-agent-";

// The steady-clock time `seconds` from now.
std::chrono::steady_clock::time_point After(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

std::string Get(const std::map<std::string, std::string>& env, const std::string& key) {
  auto it = env.find(key);
  return it == env.end() ? "" : it->second;
}

}  // namespace

std::string SlurmAllocation::Describe() const {
  return absl::StrCat("Slurm job ", job_id, " (", nodelist, ": ", nodes.size(), " node", nodes.size() == 1 ? "" : "s",
                      ")");
}

absl::StatusOr<SlurmAllocation> ReadAllocation(const std::map<std::string, std::string>& env,
                                               const SlurmTools& tools) {
  SlurmAllocation a;
  a.job_id = Get(env, "SLURM_JOB_ID");
  if (a.job_id.empty()) a.job_id = Get(env, "SLURM_JOBID");
  if (a.job_id.empty()) {
    return absl::FailedPreconditionError(
        "not inside a Slurm allocation (no SLURM_JOB_ID): run `ballast slurm` from a batch script submitted with "
        "`sbatch -N NODES --no-kill train.sbatch` (see examples/slurm/train.sbatch), or inside `salloc -N NODES "
        "--no-kill`");
  }
  a.nodelist = Get(env, "SLURM_JOB_NODELIST");
  if (a.nodelist.empty()) a.nodelist = Get(env, "SLURM_NODELIST");
  if (a.nodelist.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Slurm job ", a.job_id, ": SLURM_JOB_NODELIST is not set; run `ballast slurm` in the job's batch script or "
        "salloc shell, not in a shell that only copied SLURM_JOB_ID"));
  }
  auto r = RunCapture({tools.scontrol, "show", "hostnames", a.nodelist}, tools.timeout_s);
  if (!r.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot expand SLURM_JOB_NODELIST=", a.nodelist, " with `",
                                                      tools.scontrol, " show hostnames`: ", r.status().message(),
                                                      " (is the Slurm client installed on this node?)"));
  }
  if (!r->ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot expand SLURM_JOB_NODELIST=", a.nodelist, ": ", r->Describe("scontrol show hostnames")));
  }
  for (absl::string_view line : absl::StrSplit(r->out, '\n', absl::SkipWhitespace())) {
    a.nodes.emplace_back(absl::StripAsciiWhitespace(line));
  }
  if (a.nodes.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("SLURM_JOB_NODELIST=", a.nodelist, " names no node"));
  }
  std::string count = Get(env, "SLURM_JOB_NUM_NODES");
  if (count.empty()) count = Get(env, "SLURM_NNODES");
  int n = 0;
  if (!count.empty() && (!absl::SimpleAtoi(count, &n) || n != static_cast<int>(a.nodes.size()))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Slurm job ", a.job_id, ": SLURM_JOB_NUM_NODES=", count, " contradicts SLURM_JOB_NODELIST=", a.nodelist, " (",
        a.nodes.size(), " nodes); the environment was changed by hand: start `ballast slurm` from the job's own "
        "batch script"));
  }
  a.batch_host = Get(env, "SLURMD_NODENAME");
  return a;
}

bool NodeStateIsLost(const std::string& state) {
  const std::string s = absl::AsciiStrToLower(state);
  if (s.empty()) return false;
  if (s.back() == '*') return true;  // not responding
  for (const char* bad : {"down", "drain", "fail", "unknown", "not_responding", "no_respond"}) {
    if (s.find(bad) != std::string::npos) return true;
  }
  return false;
}

SlurmScheduler::SlurmScheduler(SlurmSchedulerOptions options) : options_(std::move(options)) {}

SlurmScheduler::~SlurmScheduler() { StopAll(0); }

std::string SlurmScheduler::NextNodeName(int node_rank, int incarnation) {
  const std::vector<std::string> free = FreeNodes();
  if (free.empty()) return absl::StrCat(kPlaceholderPrefix, node_rank, "-", incarnation);
  reserved_.insert(free.front());
  return free.front();
}

std::vector<std::string> SlurmScheduler::FreeNodes() const {
  std::vector<std::string> free;
  for (const std::string& node : options_.allocation.nodes) {
    if (steps_.count(node) == 0 && retired_.count(node) == 0 && reserved_.count(node) == 0) free.push_back(node);
  }
  return free;
}

void SlurmScheduler::Retire(const std::string& node, const std::string& why) {
  reserved_.erase(node);
  retired_.emplace(node, why);  // the first reason stays
}

absl::Status SlurmScheduler::LaunchNode(const NodeRequest& request) {
  const std::string& node = request.name;
  const auto& all = options_.allocation.nodes;
  if (std::find(all.begin(), all.end(), node) == all.end()) {
    std::vector<std::string> why;
    for (const auto& [n, reason] : retired_) why.push_back(absl::StrCat(n, ": ", reason));
    return absl::ResourceExhaustedError(absl::StrCat(
        "no free node left in ", options_.allocation.Describe(), ": ", steps_.size(), " in use",
        why.empty() ? "" : absl::StrCat(", not used again: ", absl::StrJoin(why, "; ")),
        options_.spares > 0
            ? absl::StrCat(" (its ", options_.spares, " spare node(s) are in use already; the job goes on with the "
                           "nodes it has)")
            : " (submit with more nodes than --nodes MAX for spares: sbatch -N MAX+SPARES --no-kill)"));
  }
  if (steps_.count(node) != 0) return absl::AlreadyExistsError(absl::StrCat("node ", node, " already runs an agent"));
  if (auto r = retired_.find(node); r != retired_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", node, " is not used again in this job (", r->second, ")"));
  }
  reserved_.erase(node);
  LocalCommand cmd = options_.command_for(request);
  Step step;
  step.step_name = kStepPrefix + node;
  SpawnOptions so;
  // One step per node: --overlap shares the allocation's CPUs with the batch
  // step and the other agents, and keeps a step on a lost node from blocking
  // later steps ("step creation temporarily disabled").
  so.argv = {options_.tools.srun, "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=" + node,
             "--job-name=" + step.step_name, "--kill-on-bad-exit=0", "--unbuffered"};
  so.argv.insert(so.argv.end(), cmd.argv.begin(), cmd.argv.end());
  so.env = CurrentEnvironment();
  for (const auto& [k, v] : cmd.env) so.env[k] = v;
  so.env["BALLAST_NODE_ID"] = node;
  so.new_process_group = true;
  so.die_with_parent = true;
  auto proc = Subprocess::Spawn(so);
  if (!proc.ok()) {
    return absl::Status(proc.status().code(),
                        absl::StrCat("cannot run `", options_.tools.srun, "` for node ", node, ": ",
                                     proc.status().message(), " (is the Slurm client installed on the batch host?)"));
  }
  spdlog::info("slurm: started the agent of node rank {} on {} (step {}, srun pid {})", request.node_rank, node,
               step.step_name, proc->pid());
  step.srun = std::move(*proc);
  steps_.emplace(node, std::move(step));
  NodeEvent e;
  e.kind = NodeEvent::Kind::kStarted;
  e.name = node;
  e.host = node;
  pending_events_.push_back(e);
  return absl::OkStatus();
}

std::map<std::string, std::string> SlurmScheduler::StepIds() {
  std::map<std::string, std::string> ids;
  auto r = RunCapture({options_.tools.squeue, "--steps", "--noheader", "--jobs=" + options_.allocation.job_id,
                       "--format=%i %j"},
                      options_.tools.timeout_s);
  if (!r.ok() || !r->ok()) {
    spdlog::warn("slurm: cannot list the job's steps: {}", r.ok() ? r->Describe("squeue") : std::string(r.status().message()));
    return ids;
  }
  for (absl::string_view line : absl::StrSplit(r->out, '\n', absl::SkipWhitespace())) {
    std::vector<std::string> f = absl::StrSplit(absl::StripAsciiWhitespace(line), ' ', absl::SkipWhitespace());
    if (f.size() >= 2) ids[f[1]] = f[0];
  }
  return ids;
}

void SlurmScheduler::CancelSteps(const std::vector<std::string>& step_names) {
  if (step_names.empty()) return;
  const std::map<std::string, std::string> ids = StepIds();
  std::vector<std::string> argv = {options_.tools.scancel, "--quiet"};
  for (const std::string& name : step_names) {
    if (auto it = ids.find(name); it != ids.end()) argv.push_back(it->second);
  }
  if (argv.size() == 2) return;  // none left
  auto r = RunCapture(argv, options_.tools.timeout_s);
  if (!r.ok() || !r->ok()) {
    spdlog::warn("slurm: cannot cancel steps {}: {}", absl::StrJoin(argv.begin() + 2, argv.end(), " "),
                 r.ok() ? r->Describe("scancel") : std::string(r.status().message()));
  }
}

absl::Status SlurmScheduler::ReleaseNode(const std::string& name, const std::string& reason, double grace_s) {
  auto it = steps_.find(name);
  if (it == steps_.end()) return absl::NotFoundError(absl::StrCat("no running agent on node ", name));
  spdlog::info("slurm: cancelling the agent step on {} ({}); the node is not used again in this job", name, reason);
  Retire(name, reason);
  // Slurm ends the step on the node (or, for a node it cannot reach, when
  // the node comes back); srun gets SIGTERM, which it forwards, and SIGKILL
  // after the grace period. Nothing here waits: the replacement starts now.
  CancelSteps({it->second.step_name});
  it->second.srun.Signal(SIGTERM);
  Stopping stop;
  stop.srun = std::move(it->second.srun);
  stop.deadline = After(grace_s);
  stopping_.push_back(std::move(stop));
  steps_.erase(it);
  return absl::OkStatus();
}

std::vector<NodeEvent> SlurmScheduler::Poll() {
  std::vector<NodeEvent> events = std::move(pending_events_);
  pending_events_.clear();
  for (auto it = steps_.begin(); it != steps_.end();) {
    if (auto st = it->second.srun.Poll(); st.has_value()) {
      NodeEvent e;
      e.kind = NodeEvent::Kind::kExited;
      e.name = it->first;
      e.host = it->first;
      e.status = *st;
      events.push_back(e);
      Retire(it->first, absl::StrCat("its agent step ended: srun ", st->Describe()));
      it->second.srun.Terminate(0);
      it = steps_.erase(it);
    } else {
      ++it;
    }
  }
  const auto now = std::chrono::steady_clock::now();
  for (auto it = stopping_.begin(); it != stopping_.end();) {
    if (it->srun.Poll().has_value() || now >= it->deadline) {
      it->srun.Terminate(0);
      it = stopping_.erase(it);
    } else {
      ++it;
    }
  }
  if (now >= next_state_poll_ && !steps_.empty()) {
    next_state_poll_ = After(options_.node_state_poll_s);
    std::vector<std::string> nodes;
    for (const auto& [node, step] : steps_) nodes.push_back(node);
    auto r = RunCapture({options_.tools.sinfo, "--noheader", "--Node", "--nodes=" + absl::StrJoin(nodes, ","),
                         "--format=%N|%T"},
                        options_.tools.timeout_s);
    if (!r.ok() || !r->ok()) {
      spdlog::warn("slurm: cannot read node states: {}",
                   r.ok() ? r->Describe("sinfo") : std::string(r.status().message()));
    } else {
      std::set<std::string> reported;
      for (absl::string_view line : absl::StrSplit(r->out, '\n', absl::SkipWhitespace())) {
        std::pair<std::string, std::string> f = absl::StrSplit(absl::StripAsciiWhitespace(line), '|');
        if (steps_.count(f.first) == 0 || !NodeStateIsLost(f.second) || !reported.insert(f.first).second) continue;
        NodeEvent e;
        e.kind = NodeEvent::Kind::kLost;
        e.name = f.first;
        e.host = f.first;
        e.reason = absl::StrCat("Slurm reports node ", f.first, " ", f.second);
        events.push_back(e);
      }
    }
  }
  return events;
}

std::vector<std::string> SlurmScheduler::RunningNodes() const {
  std::vector<std::string> names;
  for (const auto& [name, step] : steps_) names.push_back(name);
  return names;
}

void SlurmScheduler::StopAll(double grace_s) {
  // srun forwards SIGTERM to its task (the agent stops its workers); what is
  // left after the grace period is cancelled in Slurm and its srun killed.
  for (auto& [name, step] : steps_) {
    if (step.srun.running()) step.srun.Signal(grace_s > 0 ? SIGTERM : SIGKILL);
  }
  const auto deadline = After(grace_s);
  std::vector<std::string> left;
  for (auto& [name, step] : steps_) {
    const double wait = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (wait > 0) step.srun.Wait(wait);
    if (step.srun.running()) left.push_back(step.step_name);
  }
  if (grace_s > 0) CancelSteps(left);
  for (auto& [name, step] : steps_) step.srun.Terminate(0);
  for (auto& s : stopping_) s.srun.Terminate(0);
  steps_.clear();
  stopping_.clear();
}

absl::Status SlurmScheduler::Drain(const std::string& node, const std::string& reason) {
  auto r = RunCapture({options_.tools.scontrol, "update", "nodename=" + node, "state=drain", "reason=" + reason},
                      options_.tools.timeout_s);
  if (!r.ok()) return r.status();
  if (r->ok()) return absl::OkStatus();
  const std::string said = r->LastLine();
  const std::string lower = absl::AsciiStrToLower(said);
  if (lower.find("access") != std::string::npos || lower.find("permi") != std::string::npos ||
      lower.find("not authorized") != std::string::npos) {
    return absl::PermissionDeniedError(absl::StrCat("Slurm does not permit this user to drain ", node, ": ", said,
                                                    " (draining needs a Slurm operator or administrator)"));
  }
  return absl::InternalError(r->Describe(absl::StrCat("scontrol update nodename=", node, " state=drain")));
}

}  // namespace ballast::scheduler::slurm
