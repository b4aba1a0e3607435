#include "scheduler/kubernetes/kubernetes_job.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/net.h"
#include "common/tunables.h"
#include "kube/lease.h"
#include "master/journal.h"
#include "scheduler/kubernetes/master_state.h"
#include "scheduler/kubernetes/kubernetes_scheduler.h"
#include "scheduler/node_manager.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler::kubernetes {
namespace {

// A suspended (or Kueue-preempted) job's master, fenced: it replaces no pod,
// but serves the agents while the operator deletes their pods. Each agent
// persists its newest flash checkpoint as it stops and reports the shards
// here; the master commits the step once every rank's shard is durable, so
// the job resumes from the step it reached. Returns once every node has
// left (or the workers' termination grace, plus a margin, has passed, or a
// signal came).
void DrainSuspended(master::MasterServer& m, const ElasticJobSpec& job, const std::atomic<int>* signal) {
  int64_t grace = kube::Int(job.pod_template, {"spec", "terminationGracePeriodSeconds"}, 30);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(std::clamp<int64_t>(grace, 0, 600) + 10);
  auto live = [&m] {
    int n = 0;
    const v1::JobStatus st = m.Status();
    for (const v1::NodeStatus& node : st.nodes()) {
      const std::string& state = node.state();
      if (state != "dead" && state != "left" && state != "excluded" && state != "done") ++n;
    }
    return n;
  };
  int left = live();
  if (left == 0) return;
  spdlog::info("ElasticJob {}: serving the {} node(s) of the suspended job until they have persisted their "
               "checkpoints and left",
               job.Describe(), left);
  const auto t0 = std::chrono::steady_clock::now();
  while ((left = live()) > 0 && signal->load() == 0 && std::chrono::steady_clock::now() < deadline) {
    if (m.WaitForFinish(0.1).has_value()) break;  // finished meanwhile: nothing more to commit
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (left == 0) {
    spdlog::info("ElasticJob {}: every node left the suspended job ({:.1f} s)", job.Describe(), waited);
  } else {
    spdlog::warn("ElasticJob {}: {} node(s) of the suspended job had not left after {:.1f} s; stopping anyway",
                 job.Describe(), left, waited);
  }
}

using kube::Json;

std::string JobPath(const ElasticJobSpec& job) { return kube::ObjectPath(kApiVersion, kPlural, job.ns, job.name); }

void PrintError(const std::string& msg) { std::fprintf(stderr, "ballast master: %s\n", msg.c_str()); }

int MembersOf(const v1::JobStatus& st) {
  int n = 0;
  for (const auto& node : st.nodes()) n += node.group_rank() >= 0 ? 1 : 0;
  return n;
}

}  // namespace

// --- JobStatusWriter ---

JobStatusWriter::JobStatusWriter(kube::KubeClient* client, const ElasticJobSpec& job, std::string pod_name)
    : client_(client), job_(job), pod_name_(std::move(pod_name)) {
  thread_ = std::thread([this] {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  });
}

JobStatusWriter::~JobStatusWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void JobStatusWriter::SetGate(std::function<bool()> may_write) {
  std::lock_guard<std::mutex> lock(mu_);
  may_write_ = std::move(may_write);
}

void JobStatusWriter::SetFence(JobFence* fence) {
  std::lock_guard<std::mutex> lock(mu_);
  fence_ = fence;
}

void JobStatusWriter::Enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back([this, task = std::move(task)] {
      std::function<bool()> gate;
      {
        std::lock_guard<std::mutex> lock(mu_);
        gate = may_write_;
      }
      if (gate && !gate()) return;  // another master writes the job's status now
      task();
    });
  }
  cv_.notify_one();
}

void JobStatusWriter::Patch(const Json& fields) {
  for (const auto& [k, v] : fields.items()) applied_[k] = v;
  Json body = {{"apiVersion", kApiVersion},
               {"kind", kKind},
               {"metadata", {{"name", job_.name}, {"namespace", job_.ns}}},
               {"status", applied_}};
  Enqueue([this, body = std::move(body)] {
    JobFence* fence;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fence = fence_;
    }
    if (fence != nullptr) {
      // Not over a suspension the operator wrote meanwhile (the fence drops it).
      absl::Status s = fence->ApplyStatus(body, "ballast-master");
      if (!s.ok() && !absl::IsFailedPrecondition(s)) spdlog::warn("kubernetes: {}", std::string(s.message()));
      return;
    }
    auto r = client_->Apply(JobPath(job_) + "/status", body, "ballast-master",
                            absl::StrCat("update the status of ElasticJob ", job_.Describe()));
    if (!r.ok()) spdlog::warn("kubernetes: {}", std::string(r.status().message()));
  });
}

void JobStatusWriter::Event(const std::string& reason, const std::string& message, bool warning) {
  Json ev = BuildJobEvent(Json{{"namespace", job_.ns}, {"name", job_.name}, {"uid", job_.uid}}, reason, message,
                          warning, "ballast-master");
  ev["reportingComponent"] = "ballast.dev/master";
  ev["reportingInstance"] = pod_name_.empty() ? job_.MasterName() : pod_name_;
  Enqueue([this, ev = std::move(ev)] {
    JobFence* fence;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fence = fence_;
    }
    // A suspended job's events are the operator's (Suspended, Resumed): none
    // from a master that had not seen the suspension when it decided this.
    if (fence != nullptr) {
      absl::StatusOr<bool> suspended = fence->Confirm();
      if (suspended.ok() && *suspended) return;
    }
    auto r = client_->Create(kube::CollectionPath("v1", "events", job_.ns), ev,
                             absl::StrCat("create an event for ElasticJob ", job_.Describe()));
    if (!r.ok()) spdlog::warn("kubernetes: {}", std::string(r.status().message()));
  });
}

void JobStatusWriter::SetCondition(Json* status, const std::string& type, const std::string& reason,
                                   const std::string& message) {
  // One condition True at a time among the phases; the others turn False.
  const std::string now = Rfc3339Now();
  bool found = false;
  for (Json& c : conditions_) {
    const bool mine = c["type"] == type;
    found = found || mine;
    const std::string want = mine ? "True" : "False";
    if (c["status"] != want) {
      c["status"] = want;
      c["lastTransitionTime"] = now;
    }
    if (mine) {
      c["reason"] = reason;
      c["message"] = message.size() > 1000 ? message.substr(0, 997) + "..." : message;
    }
  }
  if (!found) {
    conditions_.push_back({{"type", type},
                           {"status", "True"},
                           {"reason", reason},
                           {"message", message.size() > 1000 ? message.substr(0, 997) + "..." : message},
                           {"lastTransitionTime", now}});
  }
  (*status)["conditions"] = conditions_;
}

void JobStatusWriter::Update(const v1::JobStatus& st, int replacements) {
  if (st.state() == "succeeded" || st.state() == "failed") return;  // Finish() says it
  const int members = MembersOf(st);
  Json s;
  const bool running = st.state() == "running" || (st.state() == "rendezvous" && st.round() > 0);
  s["phase"] = running ? "Running" : "Pending";
  s["round"] = st.round();
  s["nodes"] = members;
  s["workers"] = st.world_size();
  s["world"] = st.round() > 0 ? absl::StrCat(members, "/", job_.max_nodes, " nodes, ", st.world_size(), " workers")
                              : absl::StrCat("0/", job_.max_nodes, " nodes");
  s["restarts"] = st.restart_count();
  s["replacements"] = replacements;
  s["message"] = st.message();
  if (!pod_name_.empty()) s["masterPod"] = pod_name_;
  if (st.goodput().known()) s["goodput"] = absl::StrFormat("%.1f%%", 100 * st.goodput().goodput());
  s["time"] = StatusTime(st.goodput(), absl::Now());
  // Events for round changes, before the status that shows them.
  if (st.round() > last_round_) {
    if (last_round_ == 0) {
      Event("Started", absl::StrCat("round ", st.round(), " started: ", members, " nodes, ", st.world_size(),
                                    " workers"), false);
    } else if (st.restart_count() > last_restarts_) {
      const auto& f = st.last_failure();
      Event("Restarted",
            absl::StrCat("restart ", st.restart_count(), "/", job_.max_restarts, " (round ", st.round(), "): ",
                         f.node_id().empty() ? st.message()
                                             : absl::StrCat("worker rank ", f.global_rank(), " on node ", f.node_id(),
                                                            " (host ", f.host(), "): ", f.cause())),
            true);
    } else if (members < last_nodes_) {
      Event("ScaledDown", absl::StrCat("round ", st.round(), ": scaled down to ", members, " nodes (",
                                       st.world_size(), " workers)"), true);
    } else if (members > last_nodes_) {
      Event("ScaledUp", absl::StrCat("round ", st.round(), ": scaled up to ", members, " nodes (", st.world_size(),
                                     " workers)"), false);
    }
    last_round_ = st.round();
    last_restarts_ = st.restart_count();
    last_nodes_ = members;
  }
  Json compare = s;
  if (running && !started_) {
    started_ = true;
    s["startTime"] = Rfc3339Now();
  }
  // status.time moves at every call (its "at"): what else changed decides.
  Json without_goodput = compare;
  without_goodput.erase("goodput");
  without_goodput.erase("time");
  Json last_without_goodput = last_;
  if (last_without_goodput.is_object()) {
    last_without_goodput.erase("goodput");
    last_without_goodput.erase("time");
  }
  const auto now = std::chrono::steady_clock::now();
  if (without_goodput == last_without_goodput && !s.contains("startTime") &&
      now - goodput_written_ < std::chrono::seconds(5)) {
    return;  // only goodput and the time split moved: every 5 s is enough for `kubectl get`
  }
  goodput_written_ = now;
  last_ = compare;
  SetCondition(&s, running ? "Running" : "Pending", running ? "RoundRunning" : "WaitingForNodes",
               st.message());
  Patch(s);
}

void JobStatusWriter::Finish(bool succeeded, const std::string& message, int restarts, int replacements,
                             const v1::Goodput& goodput) {
  Json s;
  if (goodput.known()) s["goodput"] = absl::StrFormat("%.1f%%", 100 * goodput.goodput());
  if (goodput.parts_size() > 0) s["time"] = StatusTime(goodput, absl::Now());
  s["phase"] = succeeded ? "Succeeded" : "Failed";
  s["message"] = message;
  s["restarts"] = restarts;
  s["replacements"] = replacements;
  s["completionTime"] = Rfc3339Now();
  SetCondition(&s, succeeded ? "Succeeded" : "Failed", succeeded ? "JobSucceeded" : "JobFailed", message);
  Patch(s);
  Event(succeeded ? "Succeeded" : "Failed", message, !succeeded);
}

void JobStatusWriter::Resume(const Json& status) {
  if (!status.is_object()) return;
  // The fields this master applies (Update, Finish): applying without one it
  // applied before would remove it. The operator's own fields stay its own.
  for (const char* k : {"phase", "round", "nodes", "workers", "world", "restarts", "replacements", "message",
                        "masterPod", "startTime", "goodput", "time"}) {
    if (status.contains(k)) applied_[k] = status[k];
  }
  if (status.contains("conditions") && status["conditions"].is_array()) {
    conditions_ = status["conditions"];
    applied_["conditions"] = conditions_;
  }
  last_round_ = status.value("round", int64_t{0});
  last_restarts_ = status.value("restarts", 0);
  last_nodes_ = status.value("nodes", 0);
  started_ = status.contains("startTime");
}

Json StatusTime(const v1::Goodput& g, absl::Time at) {
  auto cents = [](double s) { return std::round(s * 100) / 100; };
  Json parts = Json::object();
  for (const v1::GoodputPart& p : g.parts()) parts[p.part()] = cents(p.seconds());
  return Json{{"at", Rfc3339Precise(at)},
              {"wallSeconds", cents(g.wall_s())},
              {"parts", std::move(parts)},
              {"stepsSeen", g.known()},
              {"highWaterStep", g.high_water_step()},
              {"recomputedSteps", g.recomputed_steps()}};
}

master::GoodputBefore GoodputBeforeFrom(const Json& status) {
  auto unix_s = [](const std::string& text) {
    const std::optional<absl::Time> t = ParseRfc3339(text);
    return t.has_value() ? absl::ToDoubleSeconds(*t - absl::UnixEpoch()) : 0.0;
  };
  auto number = [](const Json* j) { return j != nullptr && j->is_number() ? j->get<double>() : 0.0; };
  master::GoodputBefore b;
  b.queued_s = std::max(0.0, number(kube::Find(status, {"queuedSeconds"})));
  b.admitted_unix_s = unix_s(kube::Str(status, {"admittedAt"}));
  const Json* time = kube::Find(status, {"time"});
  const Json* parts = time != nullptr ? kube::Find(*time, {"parts"}) : nullptr;
  const double at = time != nullptr ? unix_s(kube::Str(*time, {"at"})) : 0;
  if (parts == nullptr || !parts->is_object() || at <= 0) return b;
  using Acc = master::GoodputAccountant;
  Acc::Breakdown& d = b.breakdown;
  for (int p = 0; p < Acc::kNumParts; ++p) {
    const std::string name(Acc::PartName(static_cast<Acc::Part>(p)));
    d.seconds[p] = std::max(0.0, number(kube::Find(*parts, {name.c_str()})));
    d.wall_s += d.seconds[p];
  }
  d.steps_seen = time->value("stepsSeen", false);
  d.high_water_step = kube::Int(*time, {"highWaterStep"});
  d.recomputed_steps = kube::Int(*time, {"recomputedSteps"});
  b.at_unix_s = at;
  return b;
}

// --- the master's loop ---

int RunKubernetesJob(const KubernetesJobOptions& o, const std::atomic<int>* signal) {
  auto cfg = kube::KubeConfig::Load(o.kubeconfig);
  if (!cfg.ok()) {
    PrintError(std::string(cfg.status().message()));
    return 1;
  }
  kube::KubeClient client(*cfg);
  const std::string ns = o.ns.empty() ? cfg->namespace_name : o.ns;
  auto obj = client.Get(kube::ObjectPath(kApiVersion, kPlural, ns, o.job_name),
                        absl::StrCat("get ElasticJob ", ns, "/", o.job_name));
  if (!obj.ok()) {
    PrintError(absl::StrCat(obj.status().message(),
                            absl::IsNotFound(obj.status()) ? " (is the ElasticJob CRD installed? kubectl apply -f deploy/)"
                                                           : ""));
    return 1;
  }
  auto job = ParseElasticJob(*obj);
  if (!job.ok()) {
    ElasticJobSpec bare;
    bare.ns = ns;
    bare.name = o.job_name;
    bare.uid = kube::Str(*obj, {"metadata", "uid"});
    JobStatusWriter w(&client, bare, o.pod_name);
    w.Finish(false, std::string(job.status().message()), 0, 0);
    PrintError(std::string(job.status().message()));
    return 2;
  }
  if (o.token.empty()) {
    PrintError("no job token: BALLAST_TOKEN must hold the job's Secret (the operator sets it)");
    return 1;
  }
  // A suspended job fences its master (job_fence.h): from the moment it is
  // seen suspended this master touches no pod and writes nothing.
  JobFence fence(&client, *job);
  fence.Observe(*obj);
  auto stop_suspended = [&] {
    std::fprintf(stderr, "ballast master: %s: this master does nothing; set spec.suspend to false to resume the job "
                         "(the operator starts a new master)\n",
                 fence.why().c_str());
    return kMasterExitSuspended;
  };
  if (fence.fenced()) return stop_suspended();
  fence.Start();
  JobStatusWriter status(&client, *job, o.pod_name);
  status.SetFence(&fence);
  // One master acts for the job at a time: it holds the job's Lease, whose
  // annotation tells agents where it serves (they look when they lose it).
  const std::string identity = o.pod_name.empty() ? absl::StrCat(HostName(), "-", getpid()) : o.pod_name;
  kube::LeaseOptions lo;
  lo.ns = job->ns;
  lo.name = job->MasterName();
  lo.identity = identity;
  lo.annotations[kMasterEndpointAnnotation] =
      absl::StrCat(o.advertise_host.empty() ? o.bind_host : o.advertise_host, ":", o.port);
  lo.owner_reference = OwnerReference(*job);
  lo.what = absl::StrCat("the master lease of ElasticJob ", job->Describe());
  kube::LeaderLease lease(&client, lo);
  const auto lease_wait = std::chrono::steady_clock::now();
  absl::Status acquired = lease.Acquire(signal, -1, [&](const std::string& holder) {
    spdlog::warn("ElasticJob {}: master {} holds the job's Lease; waiting until it releases it or stops renewing "
                 "it for {} s",
                 job->Describe(), holder.empty() ? "?" : holder, lo.lease_duration_s);
  });
  if (!acquired.ok()) return 128 + signal->load();
  const double lease_wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - lease_wait).count();
  status.SetGate([&lease, &fence] { return lease.held() && !fence.fenced(); });
  if (fence.fenced()) {  // suspended while it waited for the Lease
    lease.Release();
    return stop_suspended();
  }
  // The state the job's last master kept outside its pod: a master pod that
  // replaces a lost one resumes the job from it (the worker pods train on).
  MasterStateStore store(&client, *job, identity);
  bool mirror = !o.journal_dir.empty();
  std::string took_over_from;
  if (auto claimed = store.Claim(); !claimed.ok()) {
    spdlog::warn("ElasticJob {}: {}; this master's state is not kept outside its pod, so losing the pod restarts "
                 "the workers (the master needs configmaps get/create/update: deploy/02-rbac.yaml)",
                 job->Describe(), std::string(claimed.status().message()));
    mirror = false;
  } else if (claimed->has_value() && o.journal_dir.empty()) {
    spdlog::warn("ElasticJob {}: master {} kept the job's state, but this master runs without --journal: the job "
                 "starts over from its checkpoints",
                 job->Describe(), store.claimed_from());
  } else if (claimed->has_value()) {
    auto seeded = master::Journal::Seed(o.journal_dir, **claimed);
    if (!seeded.ok()) {
      status.Finish(false, std::string(seeded.status().message()), 0, 0);
      PrintError(std::string(seeded.status().message()));
      return 1;
    }
    if (*seeded) {
      took_over_from = store.claimed_from();
      spdlog::warn("ElasticJob {}: resuming the job from the state master {} kept (round {}, restart count {})",
                   job->Describe(), took_over_from, (*claimed)->round().round(), (*claimed)->round().restart_count());
    }
  }
  master::MasterOptions mo;
  mo.bind_host = o.bind_host;
  mo.port = o.port;
  mo.advertise_host = o.advertise_host.empty() ? o.bind_host : o.advertise_host;
  mo.token = o.token;
  mo.job_id = job->name;
  mo.min_nodes = job->min_nodes;
  mo.max_nodes = job->max_nodes;
  mo.expected_nodes = job->max_nodes + job->spares;
  mo.node_unit = job->node_unit;
  mo.max_restarts = job->max_restarts;
  mo.precheck = job->network_check;
  mo.exclude_stragglers = job->exclude_stragglers;
  mo.health = job->health;
  std::atomic<NodeManager*> manager{nullptr};
  // The master's notices (a node lost, excluded) reach the NodeManager
  // through the FencedScheduler, once the job is confirmed not suspended.
  std::atomic<FencedScheduler*> fenced_slot{nullptr};
  mo.on_node_lost = [&fenced_slot](const std::string& id, const std::string& reason) {
    if (FencedScheduler* f = fenced_slot.load()) f->OnNodeLost(id, reason);
  };
  mo.on_node_excluded = [&fenced_slot](const std::string& id, const std::string& reason) {
    if (FencedScheduler* f = fenced_slot.load()) f->OnNodeExcluded(id, reason);
  };
  mo.journal_dir = o.journal_dir;
  // Goodput carries on from the time the job spent before this master
  // (queued, the last master's breakdown, preempted); unless it resumes
  // from that master's state, which has it.
  if (const Json* st = kube::Find(*obj, {"status"}); st != nullptr) mo.goodput_before = GoodputBeforeFrom(*st);
  mo.http_port = o.http_port;
  mo.metrics_public = o.metrics_public;
  auto server = master::MasterServer::Start(mo);
  if (!server.ok()) {
    status.Finish(false, std::string(server.status().message()), 0, 0);
    PrintError(std::string(server.status().message()));
    return 1;
  }
  master::MasterServer& m = **server;
  MasterStateMirror mirror_state(&store, [&m](uint64_t seq) { return m.JournalStateAfter(seq); });
  auto may_act = [&lease, &mirror_state, &fence] {
    return lease.held() && !mirror_state.fenced() && !fence.fenced();
  };
  spdlog::info("ElasticJob {}: master on {} (agents dial {}); nodes {}:{} x {} workers, {} spare(s)",
               job->Describe(), absl::StrCat(o.bind_host, ":", m.port()), m.address(), job->min_nodes,
               job->max_nodes, job->nproc_per_node, job->spares);
  if (m.resumed()) {
    if (const Json* st = kube::Find(*obj, {"status"}); st != nullptr) status.Resume(*st);
  }

  KubernetesSchedulerOptions so;
  so.client = &client;
  so.job = *job;
  so.master_endpoint = m.address();
  so.ballast = o.ballast;
  so.pending_timeout_s = job->pending_timeout_s;
  so.adopt = m.resumed();  // the earlier master's pods train on
  so.may_act = may_act;
  auto sched = KubernetesScheduler::Start(so);
  if (!sched.ok()) {
    m.Abort(std::string(sched.status().message()));
    status.Finish(false, std::string(sched.status().message()), 0, 0);
    m.Shutdown(0);
    PrintError(std::string(sched.status().message()));
    return 1;
  }
  NodeManagerOptions nmo;
  nmo.initial_nodes = job->max_nodes + job->spares;
  nmo.max_replacements = job->max_replacements;
  nmo.release_grace_s = Tunables::Get().stop_grace_s + 2;
  nmo.name = [&](int rank, int inc) { return job->WorkerPodName(rank, inc); };
  nmo.on_event = [&status](const std::string& reason, const std::string& message, bool warning) {
    status.Event(reason, message, warning);
  };
  FencedScheduler fenced(sched->get(), &fence, ForwardTo(&manager));
  fenced_slot.store(&fenced);
  NodeManager nodes(&fenced, nmo);
  manager.store(&nodes);
  // Its first pods too only once the job, read now, is not suspended (the
  // operator may have started this master just before a suspension).
  if (absl::StatusOr<bool> suspended = fence.Confirm(); suspended.ok() && *suspended) {
    spdlog::warn("ElasticJob {}: suspended before this master created its worker pods", job->Describe());
  } else if (absl::Status s = nodes.Start(); !s.ok()) {
    m.Abort(std::string(s.message()));
  }
  if (m.resumed()) {
    const v1::JobStatus st = m.Status();
    if (!took_over_from.empty()) {
      status.Event("MasterTookOver",
                   absl::StrCat("master pod ", identity, " took over the job from ", took_over_from, " (round ",
                                st.round(), ", ", st.restart_count(), " restart(s); waited ",
                                absl::StrFormat("%.1f", lease_wait_s), " s for the job's Lease): ",
                                (*sched)->AdoptedNodes().size(), " worker pod(s) train on"),
                   true);
    } else {
      status.Event("MasterResumed",
                   absl::StrCat("the master process restarted and resumed the job from its journal (round ",
                                st.round(), ", ", st.restart_count(), " restart(s)); took over ",
                                (*sched)->AdoptedNodes().size(), " worker pod(s), which train on"),
                   true);
    }
  }
  if (mirror) mirror_state.Start();
  std::set<std::string> cordoned;
  std::optional<master::JobResult> result;
  while (!result.has_value() && signal->load() == 0 && may_act()) {
    result = m.WaitForFinish(0.1);
    if (result.has_value()) break;
    nodes.Poll(/*job_finished=*/false);
    if (absl::Status f = (*sched)->fatal(); !f.ok()) m.Abort(std::string(f.message()));
    if (nodes.Exhausted()) {
      m.Abort(absl::StrCat("every worker pod ended and spec.maxReplacements (", job->max_replacements,
                           ") is used up; see the job's events"));
    }
    for (const std::string& host : nodes.avoid_hosts()) {
      if (!job->cordon_bad_nodes || !cordoned.insert(host).second) continue;
      auto r = client.Patch(kube::ObjectPath("v1", "nodes", "", host), Json{{"spec", {{"unschedulable", true}}}},
                            absl::StrCat("cordon node ", host));
      if (r.ok()) {
        status.Event("NodeCordoned", absl::StrCat("cordoned Kubernetes node ", host, " (spec.cordonBadNodes)"), true);
      } else {
        status.Event("CordonFailed",
                     absl::StrCat("spec.cordonBadNodes: cannot cordon node ", host, ": ", r.status().message(),
                                  absl::IsPermissionDenied(r.status())
                                      ? " (grant the master's ServiceAccount `patch nodes` to allow it)"
                                      : ""),
                     true);
      }
    }
    const v1::JobStatus st = m.Status();
    mirror_state.NoteRound(st.round());  // saved at once when it changed
    status.Update(st, nodes.replacements());
  }
  const int sig = signal->load();
  if (!result.has_value()) {
    // This pod is being deleted (by a person, an eviction, a drain: the
    // operator starts the next master, which takes the job over), or
    // another master holds the job's Lease now. Never touch the worker pods
    // here: they train on (the pods of a deleted or suspended job are
    // deleted by the garbage collector or the operator).
    if (fence.fenced()) {
      spdlog::warn("ElasticJob {}: this master stops acting for the job: {}; resuming it starts a new master",
                   job->Describe(), fence.why());
      m.Suspended();  // goodput: preempted from here
      DrainSuspended(m, *job, signal);
      // The one write of a fenced master: the job's time so far, which the
      // next master carries on from (it decides nothing the operator acts on).
      auto r = client.Patch(JobPath(*job) + "/status",
                            Json{{"status", {{"time", StatusTime(m.Status().goodput(), absl::Now())}}}},
                            absl::StrCat("record the time of ElasticJob ", job->Describe()));
      if (!r.ok()) spdlog::warn("kubernetes: {}", std::string(r.status().message()));
    } else if (!may_act()) {
      spdlog::error("ElasticJob {}: this master stops acting for the job: {}", job->Describe(),
                    mirror_state.fenced() ? mirror_state.fenced_why()
                                          : absl::StrCat("it lost the job's Lease (", lease.lost_reason(), ")"));
    } else {
      spdlog::warn("ElasticJob {}: master stopped by signal {}: the worker pods train on; the next master takes "
                   "them over",
                   job->Describe(), sig);
    }
    mirror_state.Stop(/*final_save=*/may_act());
    m.Shutdown(0);
    lease.Release();
    fenced_slot.store(nullptr);
    if (fence.fenced()) return kMasterExitSuspended;
    return sig != 0 ? 128 + sig : 3;
  }
  mirror_state.Stop(/*final_save=*/true);
  status.Finish(result->succeeded,
                result->succeeded ? absl::StrCat("job succeeded: ", result->restart_count, " restart(s), ",
                                                 nodes.replacements(), " pod replacement(s)")
                                  : result->message,
                result->restart_count, nodes.replacements(), m.Status().goodput());
  // Agents exit on JobFinished; give them the time to, then clean up.
  m.Shutdown(Tunables::Get().finish_linger_s);
  for (int i = 0; i < 40 && !(*sched)->RunningNodes().empty(); ++i) {
    nodes.Poll(/*job_finished=*/true);
    usleep(50000);
  }
  nodes.Poll(/*job_finished=*/true);
  (*sched)->StopAll(Tunables::Get().stop_grace_s);
  // Until only the pods that succeeded are left: pods on a dead node are
  // force-deleted after their grace period (Poll does it), never left behind.
  const auto give_up = std::chrono::steady_clock::now() +
                       std::chrono::duration<double>(Tunables::Get().stop_grace_s + 2 + so.force_delete_after_s + 5);
  while ((*sched)->PodsInApi() > (*sched)->SucceededPods() && std::chrono::steady_clock::now() < give_up) {
    nodes.Poll(/*job_finished=*/true);
    usleep(100000);
  }
  lease.Release();
  fenced_slot.store(nullptr);
  if (result->succeeded) {
    std::printf("ballast master: ElasticJob %s succeeded (%d restarts, %d pod replacements)\n",
                job->Describe().c_str(), result->restart_count, nodes.replacements());
    return 0;
  }
  PrintError(absl::StrCat("ElasticJob ", job->Describe(), " failed: ", result->message));
  return 1;
}

}  // namespace ballast::scheduler::kubernetes
