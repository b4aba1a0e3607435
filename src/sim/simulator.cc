#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <memory>
#include <queue>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/clock.h"
#include "common/tunables.h"
#include "master/job_master.h"
#include "nlohmann/json.hpp"
#include "scheduler/node_manager.h"
#include "spdlog/spdlog.h"

namespace ballast::sim {
namespace {

using master::JobMaster;

constexpr double kEpsilon = 1e-3;  // a tick just after a timer is due

// CPU seconds of the calling thread (each policy runs on its own).
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The scheduler seam, simulated: a launched node's agent joins after the
// launch delay (0 for the first nodes, the replacement time after that).
class SimScheduler : public scheduler::SchedulerInterface {
 public:
  std::function<void(const std::string& name)> on_launch;
  std::function<void(const std::string& name)> on_release;

  std::string Kind() const override { return "simulated"; }
  absl::Status LaunchNode(const scheduler::NodeRequest& r) override {
    if (running_.count(r.name) > 0) return absl::AlreadyExistsError(r.name);
    running_.insert(r.name);
    on_launch(r.name);
    return absl::OkStatus();
  }
  absl::Status ReleaseNode(const std::string& name, const std::string&, double) override {
    if (running_.erase(name) == 0) return absl::NotFoundError(name);
    on_release(name);
    return absl::OkStatus();
  }
  std::vector<scheduler::NodeEvent> Poll() override { return std::exchange(events_, {}); }
  std::vector<std::string> RunningNodes() const override { return {running_.begin(), running_.end()}; }
  void StopAll(double) override { running_.clear(); }
  void Started(const std::string& name) {
    scheduler::NodeEvent e;
    e.kind = scheduler::NodeEvent::Kind::kStarted;
    e.name = name;
    e.host = name;
    events_.push_back(e);
  }

 private:
  std::set<std::string> running_;
  std::vector<scheduler::NodeEvent> events_;
};

class PolicyRun {
 public:
  PolicyRun(const SimOptions& o, Policy p, const std::vector<Fault>& faults)
      : o_(o), policy_(p), faults_(faults), nodes_(o.gpus / o.gpus_per_node) {
    // The costs that make a policy (simulator.h).
    switch (p) {
      case Policy::kManual:
        restart_s_ = o.manual_delay_s + o.job_start_s;
        replace_s_ = o.manual_delay_s + o.node_replacement_s;
        spares_ = 0;
        break;
      case Policy::kDlrover:
        restart_s_ = o.dlrover_restart_s;
        replace_s_ = o.node_replacement_s;
        spares_ = 0;
        break;
      case Policy::kBallast:
        restart_s_ = o.ballast_restart_s;
        replace_s_ = o.node_replacement_s;
        spares_ = o.spares;
        break;
    }
    if (p == Policy::kBallast) {
      ckpt_every_ = 1;
      stall_per_step_ = o.flash_ckpt_s;
    } else {
      ckpt_every_ = std::max<int64_t>(1, static_cast<int64_t>(std::llround(o.disk_ckpt_interval_s / o.step_time_s)));
      stall_per_step_ = o.disk_ckpt_s / static_cast<double>(ckpt_every_);
    }
    step_eff_ = o.step_time_s + stall_per_step_;
    end_s_ = o.steps > 0 ? 1e15 : o.days * 86400.0;
  }

  PolicyResult Go();

 private:
  enum class Kind { kFault, kJoin, kWorkersUp, kReport, kTick, kSample, kDone };
  struct Ev {
    double t;
    uint64_t seq;
    Kind kind;
    std::string node;
    int64_t round;
    size_t index;
    bool operator>(const Ev& b) const { return t != b.t ? t > b.t : seq > b.seq; }
  };
  struct Agent {
    bool alive = true;    // its node runs (a lost node's agent is silent)
    bool joined = false;
    uint64_t stream = 0;  // its open Watch stream (Sink), 0: none
    int64_t round = 0;    // the round whose workers it runs or starts
    bool up = false;      // its workers of `round` made their first step possible
    int global_rank = 0;
    size_t order = 0;     // its place in id order (ordered_)
  };
  // A decision the master delivered to an agent's Watch stream, not yet
  // acted on (Drain): what the agent reads of it.
  struct Delivery {
    enum class What { kStartRound, kStop, kFinished, kOther };
    Agent* agent;
    const std::string* id;
    uint64_t stream;  // the stream it came on: dropped once that stream ended
    What what;
    int64_t round;
    int rank_offset;
  };
  // An agent's Watch stream: the master delivers each decision under its
  // lock; it is only noted here (Drain acts on it), as the gRPC server only
  // queues a write. O(1) a decision, where polling every agent's stream at
  // every drain was O(agents).
  class Sink : public JobMaster::DecisionSink {
   public:
    Sink(PolicyRun* run, Agent* agent, const std::string* id, uint64_t stream)
        : run_(run), agent_(agent), id_(id), stream_(stream) {}
    void Deliver(const v1::Decision& d) override {
      Delivery x{agent_, id_, stream_, Delivery::What::kOther, 0, 0};
      if (d.has_start_round()) {
        x.what = Delivery::What::kStartRound;
        x.round = d.start_round().round();
        x.rank_offset = d.start_round().rank_offset();
      } else if (d.has_wait() || d.has_stop_workers()) {
        x.what = Delivery::What::kStop;
      } else if (d.has_job_finished()) {
        x.what = Delivery::What::kFinished;
      }
      run_->delivered_.push_back(x);
    }
    // Replaced or gone: what it delivered and the agent did not read yet is
    // never read (a stream's Next would return the error first).
    void End(const absl::Status&) override {
      if (agent_->stream == stream_) agent_->stream = 0;
    }

   private:
    PolicyRun* run_;
    Agent* agent_;
    const std::string* id_;
    uint64_t stream_;
  };
  // The world's training, as the workers see it.
  struct Training {
    bool on = false;
    int64_t round = 0;
    double t_first = 0;   // when step s0 completed
    int64_t s0 = 0;
  };

  void At(double t, Kind kind, std::string node = "", int64_t round = 0, size_t index = 0) {
    if (kind == Kind::kTick && !tick_times_.insert(t).second) return;  // one tick per moment
    q_.push(Ev{t, seq_++, kind, std::move(node), round, index});
  }
  double Now() const { return clock_.Now() - t0_; }
  Agent& AgentOf(const std::string& id) {
    auto it = agent_index_.find(id);
    if (it != agent_index_.end()) return *it->second;
    Agent& a = agents_[id];
    agent_index_.emplace(id, &a);
    order_stale_ = true;
    return a;
  }
  // Orders deliveries as polling the agents in id order did: by agent id,
  // each agent's in the order delivered.
  void OrderDeliveries(std::vector<Delivery>* ds);
  // The world's step at time t (0: none this round), and when it was reached.
  int64_t WorldStep(double t) const {
    if (!train_.on || t < train_.t_first) return 0;
    return train_.s0 + static_cast<int64_t>(std::floor((t - train_.t_first) / step_eff_));
  }
  double ReachedAt(int64_t s) const { return train_.t_first + static_cast<double>(s - train_.s0) * step_eff_; }
  void StopTraining(double t) {
    if (!train_.on) return;
    high_water_ = std::max(high_water_, WorldStep(t));
    train_.on = false;
  }
  void ReportProgress(double t);
  void Heartbeats();
  void Drain(double t);
  void OnStartRound(const Delivery& s, double t);
  void MaybeStartTraining(int64_t round, double t);
  // Queues the workers this drain started (starting_) as one kWorkersUp event.
  void FlushStarting();
  void Handle(const Ev& e);
  // Changes an agent through `change`, keeping up_ (the agents up per round)
  // right: MaybeStartTraining compares it with the round's members instead of
  // looking at every member on each worker start (O(nodes^2) a round).
  template <typename F>
  void Change(Agent& a, F change) {
    if (a.alive && a.up) --up_[a.round];
    const bool alive = a.alive, joined = a.joined;
    change(a);
    if (a.alive && a.up) ++up_[a.round];
    if (a.alive != alive || a.joined != joined) ++roster_;
  }

  const SimOptions& o_;
  const Policy policy_;
  const std::vector<Fault>& faults_;
  const int nodes_;
  double restart_s_ = 0, replace_s_ = 0;
  int spares_ = 0;
  int64_t ckpt_every_ = 1;
  double stall_per_step_ = 0, step_eff_ = 0, end_s_ = 0;

  FakeClock clock_{0.0};
  double t0_ = 0;
  std::unique_ptr<JobMaster> jm_;
  SimScheduler sched_;
  std::unique_ptr<scheduler::NodeManager> manager_;
  std::map<std::string, Agent> agents_;  // in id order (the order the master's decisions are drained in)
  absl::flat_hash_map<std::string, Agent*> agent_index_;  // agents_ by hash (AgentOf)
  bool order_stale_ = true;  // an agent was added since Agent::order was set
  uint64_t streams_ = 0;     // Watch streams opened (Agent::stream)
  std::vector<Delivery> delivered_;  // by the Sinks, since the last drain
  // Bumped when an agent turns alive or not, or joins: the lists below are
  // rebuilt then, not at every heartbeat or report.
  uint64_t roster_ = 0;
  uint64_t heartbeat_ids_at_ = ~uint64_t{0};
  std::vector<NodeId> heartbeat_ids_;  // the alive agents that joined, in id order
  std::tuple<int64_t, uint64_t, size_t> progress_ids_at_{-1, 0, 0};
  std::vector<NodeId> progress_ids_;  // the training round's alive members
  std::vector<Delivery> draining_;   // the drain's (a buffer reused)
  // Agents whose workers start, by when they are up: one event for all that
  // a drain started at once (the old way, one event each, was n queue
  // entries a round). kWorkersUp's index names its batch.
  std::map<size_t, std::vector<std::pair<Agent*, int64_t>>> up_batches_;
  size_t next_batch_ = 0;
  std::vector<std::pair<Agent*, int64_t>> starting_;  // this drain's (agent, round)
  double starting_at_ = 0;                            // ... when their workers are up
  std::map<int64_t, std::vector<std::string>> members_;  // round -> its members
  std::map<int64_t, size_t> up_;  // round -> its alive agents whose workers are up (Change)
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> q_;
  uint64_t seq_ = 0;
  std::set<double> tick_times_;
  uint64_t drained_at_ = 0;    // JobMaster::decisions_pushed() at the last drain
  double refreshed_at_ = -1;   // when the agents last reported
  double heartbeats_at_ = -1e18;  // when they last heartbeat
  std::tuple<int64_t, double, int64_t> reported_{-1, 0, -1};  // the training (round, start) and step last reported
  Training train_;
  int64_t high_water_ = 0;     // the highest step completed
  bool started_once_ = false;  // a world trained before (later starts are restarts)
  bool finished_ = false;
  bool launching_initial_ = true;
  int64_t latest_round_ = 0;   // the newest round the agents were told about
  bool last_fault_node_ = false;  // the last fault lost a node (manual: the person replaced it already)
  PolicyResult result_;
};

void PolicyRun::Heartbeats() {
  // Every alive agent that joined, in id order: the list kept until one
  // joins, is lost or is replaced (roster_), and sent in one call.
  if (heartbeat_ids_at_ != roster_) {
    heartbeat_ids_at_ = roster_;
    heartbeat_ids_.clear();
    for (const auto& [id, a] : agents_) {
      if (a.alive && a.joined) heartbeat_ids_.emplace_back(id);
    }
  }
  (void)jm_->Heartbeats(heartbeat_ids_);
}

void PolicyRun::ReportProgress(double t) {
  const int64_t s = WorldStep(t);
  if (s <= 0) return;
  // The same step of the same round again: every field would be as the
  // master has it already (the step's age is kept as when it was reached).
  const auto now_at = std::make_tuple(train_.round, train_.t_first, s);
  if (reported_ == now_at) return;
  reported_ = now_at;
  const double stall = static_cast<double>(s - train_.s0 + 1) * stall_per_step_;
  // The round's alive members, in the order they were told of it: the list
  // kept while the round and the roster stay.
  const std::vector<std::string>& members = members_[train_.round];
  const auto key = std::make_tuple(train_.round, roster_, members.size());
  if (progress_ids_at_ != key) {
    progress_ids_at_ = key;
    progress_ids_.clear();
    for (const std::string& id : members) {
      if (AgentOf(id).alive) progress_ids_.emplace_back(id);
    }
  }
  if (progress_ids_.empty()) return;
  v1::ProgressReport r;  // the same for every member (each sends its own; one call for all)
  r.set_round(train_.round);
  r.set_step(s);
  r.set_step_time_s(step_eff_);
  r.set_step_age_s(t - ReachedAt(s));
  r.set_first_step_known(true);
  r.set_first_step(train_.s0);
  r.set_first_step_age_s(t - train_.t_first);
  r.set_ckpt_saves((s - train_.s0 + 1) * o_.gpus_per_node / ckpt_every_);
  r.set_ckpt_stall_max_s(stall);
  r.set_ckpt_stall_sum_s(stall * o_.gpus_per_node);
  (void)jm_->ReportProgressFrom(progress_ids_, r);
}

void PolicyRun::OnStartRound(const Delivery& s, double t) {
  Agent& a = *s.agent;
  const std::string& id = *s.id;
  if (s.round <= a.round) return;
  StopTraining(t);  // the workers of the old round stop
  if (s.round > latest_round_) {
    // The first member told of a new round: the rounds before the last
    // trained and the last told are over (every member of them moved on or
    // is gone); their member lists are n strings each, rounds x n in all.
    const int64_t keep = std::min(train_.round, latest_round_);
    members_.erase(members_.begin(), members_.lower_bound(keep));
    up_.erase(up_.begin(), up_.lower_bound(keep));
  }
  latest_round_ = std::max(latest_round_, s.round);
  Change(a, [&](Agent& x) {
    x.round = s.round;
    x.up = false;
  });
  a.global_rank = s.rank_offset;
  members_[s.round].push_back(id);  // every member gets its StartRound in the same drain
  // Manual: after a replaced node the person's delay was in the replacement.
  const bool restart = started_once_ && !(policy_ == Policy::kManual && last_fault_node_);
  const double up_at = t + (restart ? restart_s_ : o_.job_start_s);
  if (!starting_.empty() && up_at != starting_at_) FlushStarting();
  starting_at_ = up_at;
  starting_.emplace_back(&a, s.round);
}

void PolicyRun::FlushStarting() {
  if (starting_.empty()) return;
  const size_t batch = next_batch_++;
  up_batches_[batch] = std::exchange(starting_, {});
  At(starting_at_, Kind::kWorkersUp, "", 0, batch);
}

void PolicyRun::OrderDeliveries(std::vector<Delivery>* ds) {
  if (order_stale_) {
    size_t i = 0;
    for (auto& [id, a] : agents_) a.order = i++;
    order_stale_ = false;
  }
  auto by_order = [](const Delivery& x, const Delivery& y) { return x.agent->order < y.agent->order; };
  if (std::is_sorted(ds->begin(), ds->end(), by_order)) return;
  if (ds->size() < 64) {
    std::stable_sort(ds->begin(), ds->end(), by_order);
    return;
  }
  // A round's n decisions: a counting sort by place (stable), O(n + agents).
  std::vector<uint32_t> start(agents_.size() + 1, 0);
  for (const Delivery& d : *ds) ++start[d.agent->order + 1];
  for (size_t i = 1; i < start.size(); ++i) start[i] += start[i - 1];
  std::vector<Delivery> out(ds->size());
  for (const Delivery& d : *ds) out[start[d.agent->order]++] = d;
  ds->swap(out);
}

void PolicyRun::MaybeStartTraining(int64_t round, double t) {
  // Only a member of `round` runs it (OnStartRound), so all are up when as
  // many agents are up in it as it has members.
  if (up_[round] != members_[round].size()) return;
  // Every worker is up: the first step completes one step later, from the
  // newest checkpoint (flash: every step; disk: every ckpt_every_ steps).
  const int64_t restored = (high_water_ / ckpt_every_) * ckpt_every_;
  train_ = Training{true, round, t + o_.step_time_s, restored + 1};
  started_once_ = true;
  if (o_.steps > 0) At(ReachedAt(std::max(o_.steps, train_.s0)) + 1e-6, Kind::kDone, "", round);
}

void PolicyRun::Drain(double t) {
  const uint64_t pushed = jm_->decisions_pushed();
  if (pushed == drained_at_) return;  // nothing new for anyone
  drained_at_ = pushed;
  // The agents read their streams in id order, as polling each in turn did
  // (the order a round's members are listed in, and its workers start in).
  draining_.swap(delivered_);
  delivered_.clear();
  OrderDeliveries(&draining_);
  for (const Delivery& d : draining_) {
    Agent& a = *d.agent;
    if (!a.alive || !a.joined || a.stream != d.stream) continue;
    switch (d.what) {
      case Delivery::What::kStartRound:
        OnStartRound(d, t);
        break;
      case Delivery::What::kStop:
        if (train_.on && a.round == train_.round) StopTraining(t);
        Change(a, [](Agent& x) { x.up = false; });
        break;
      case Delivery::What::kFinished:
        finished_ = true;
        break;
      case Delivery::What::kOther:
        break;
    }
  }
  draining_.clear();
  FlushStarting();
}

void PolicyRun::Handle(const Ev& e) {
  const double t = e.t;
  switch (e.kind) {
    case Kind::kJoin: {
      Agent& a = AgentOf(e.node);
      if (!a.alive) return;
      v1::JoinRequest req;
      req.mutable_node()->set_node_id(e.node);
      req.mutable_node()->set_node_rank_hint(-1);
      req.mutable_node()->set_local_world_size(o_.gpus_per_node);
      req.mutable_node()->set_host(e.node);
      if (!jm_->Join(req).ok()) return;
      const uint64_t stream = ++streams_;
      const std::string* id = &agents_.find(e.node)->first;
      auto h = jm_->OpenWatch(e.node, std::make_shared<Sink>(this, &a, id, stream));
      if (!h.ok()) return;
      Change(a, [&](Agent& x) {
        x.joined = true;
        x.stream = stream;
      });
      sched_.Started(e.node);
      At(t + Tunables::Get().last_call_s + kEpsilon, Kind::kTick);
      break;
    }
    case Kind::kWorkersUp: {
      auto batch = up_batches_.find(e.index);
      for (const auto& [agent, round] : batch->second) {
        Agent& a = *agent;
        if (!a.alive || a.round != round) continue;
        Change(a, [](Agent& x) { x.up = true; });
        MaybeStartTraining(round, t);
      }
      up_batches_.erase(batch);
      break;
    }
    case Kind::kFault: {
      const Fault& f = faults_[e.index];
      // The fault hits a node of the world (of the alive ones when no round runs).
      std::vector<const std::string*> pool;
      for (const auto& id : members_[train_.on ? train_.round : latest_round_]) {
        if (AgentOf(id).alive) pool.push_back(&id);
      }
      if (pool.empty()) return;
      const std::string id =
          *pool[std::min(pool.size() - 1, static_cast<size_t>(f.pick * static_cast<double>(pool.size())))];
      StopTraining(t);
      last_fault_node_ = f.node_loss;
      if (f.node_loss) {
        ++result_.node_failures;
        v1::HeartbeatRequest hb;  // its last (see Go)
        hb.set_node_id(id);
        (void)jm_->Heartbeat(hb);
        Change(AgentOf(id), [](Agent& x) { x.alive = false; });  // silent from now on: lost at the heartbeat timeout
        At(t + o_.heartbeat_timeout_s + kEpsilon, Kind::kTick);
      } else {
        ++result_.process_failures;
        At(t + o_.detect_s, Kind::kReport, id, AgentOf(id).round);
      }
      break;
    }
    case Kind::kReport: {
      const Agent& a = AgentOf(e.node);
      if (!a.alive) return;
      v1::FailureReport r;
      r.set_node_id(e.node);
      r.set_round(e.round);
      r.set_global_rank(a.global_rank);
      r.set_signal(9);
      r.set_cause("simulated process failure");
      r.set_kind("killed");
      r.set_max_retries(-1);
      r.set_seen_age_s(o_.detect_s);
      (void)jm_->ReportFailure(r);
      At(t + Tunables::Get().failure_settle_s + kEpsilon, Kind::kTick);
      break;
    }
    case Kind::kSample: {
      const v1::Goodput g = jm_->GoodputNow();
      if (g.known()) result_.goodput_series.emplace_back(t / 3600.0, g.goodput());
      break;
    }
    case Kind::kDone: {
      if (!train_.on || train_.round != e.round || WorldStep(t) < o_.steps) return;
      for (const std::string& id : members_[e.round]) {
        v1::WorkersDoneRequest d;
        d.set_node_id(id);
        d.set_round(e.round);
        (void)jm_->ReportWorkersDone(d);
      }
      break;
    }
    case Kind::kTick:
      break;
  }
}

PolicyResult PolicyRun::Go() {
  const double cpu0 = ThreadCpuSeconds();
  const Tunables& tun = Tunables::Get();
  master::JobMasterOptions jo;
  jo.job_id = absl::StrCat("sim-", PolicyName(policy_));
  jo.min_nodes = nodes_;
  jo.max_nodes = nodes_;
  jo.node_unit = 1;
  jo.max_restarts = 1 << 30;
  jo.last_call_s = tun.last_call_s;
  jo.heartbeat_interval_s = std::min(tun.heartbeat_interval_s, o_.heartbeat_timeout_s / 2);
  jo.heartbeat_timeout_s = o_.heartbeat_timeout_s;
  jo.wait_for_nodes_s = 1e12;  // a lost node's replacement may take long: wait
  jo.failure_settle_s = tun.failure_settle_s;
  jo.hang_settle_s = tun.hang_settle_s;
  jo.disconnect_grace_s = 0;
  jo.straggler_factor = tun.straggler_factor;
  jo.clock = &clock_;
  jo.send_round_members = false;  // see JobMasterOptions: the simulated agents collect them
  t0_ = clock_.Now();
  std::atomic<scheduler::NodeManager*> slot{nullptr};
  scheduler::NodeCallbacks forward = scheduler::ForwardTo(&slot);
  jo.on_node_lost = forward.lost;
  jo.on_node_excluded = forward.excluded;
  jm_ = std::make_unique<JobMaster>(jo);

  sched_.on_launch = [this](const std::string& name) {
    Change(AgentOf(name), [](Agent& x) { x = Agent(); });
    At(Now() + (launching_initial_ ? 0.0 : replace_s_), Kind::kJoin, name);
    if (!launching_initial_) ++result_.replacements;
  };
  sched_.on_release = [this](const std::string& name) { Change(AgentOf(name), [](Agent& x) { x.alive = false; }); };
  scheduler::NodeManagerOptions nmo;
  nmo.initial_nodes = nodes_ + spares_;
  nmo.max_replacements = 1 << 30;
  manager_ = std::make_unique<scheduler::NodeManager>(&sched_, nmo);
  slot.store(manager_.get());
  (void)manager_->Start();
  launching_initial_ = false;

  for (size_t i = 0; i < faults_.size(); ++i) {
    if (faults_[i].at_s < end_s_) At(faults_[i].at_s, Kind::kFault, "", 0, i);
  }
  const double sample_every = o_.steps > 0 ? 1.0 : std::max(60.0, end_s_ / 336);
  for (double s = sample_every; s < end_s_ && o_.steps == 0; s += sample_every) At(s, Kind::kSample);

  while (!q_.empty() && !finished_) {
    Ev e = q_.top();
    if (e.t >= end_s_) break;
    q_.pop();
    clock_.Set(t0_ + e.t);
    if (e.t > refreshed_at_) {  // what the agents would have sent by now (once per moment)
      refreshed_at_ = e.t;
      ReportProgress(e.t);
      // Heartbeats only as often as the master needs them, not at every
      // moment: before any tick that could find an alive node silent (the
      // timeout less a margin; ticks come only at moments, after this). A
      // node that is lost sends its last one at the fault (Handle), as an
      // agent that heartbeats every second would have just before it: the
      // master times it out when it would have.
      if (e.t - heartbeats_at_ >= 0.75 * o_.heartbeat_timeout_s) {
        heartbeats_at_ = e.t;
        Heartbeats();
      }
    }
    Handle(e);
    // The rest of the moment's workers coming up: the master sees none of
    // it, so one tick after all of them (a round's n nodes come up together).
    while (e.kind == Kind::kWorkersUp && !q_.empty() && q_.top().t == e.t && q_.top().kind == Kind::kWorkersUp) {
      Handle(q_.top());
      q_.pop();
    }
    jm_->Tick();
    Drain(e.t);
    manager_->Poll(finished_);
  }
  if (!finished_) {
    const double t = o_.steps > 0 ? Now() : end_s_;
    clock_.Set(t0_ + t);
    ReportProgress(t);
    Heartbeats();
    jm_->Abort("the simulation ended");
  }
  const v1::JobStatus st = jm_->Status();
  const v1::Goodput& g = st.goodput();
  result_.policy = policy_;
  result_.wall_s = g.wall_s();
  result_.goodput = g.known() ? g.goodput() : 0;
  for (const auto& p : g.parts()) result_.parts.emplace_back(p.part(), p.seconds());
  result_.restarts = st.restart_count();
  result_.rounds = static_cast<int>(st.round());
  result_.steps = g.high_water_step();
  const master::Histogram recovery = jm_->RecoveryHistogram();  // every resumed failure, not just the listed
  result_.mean_resume_s = recovery.count > 0 ? recovery.sum / static_cast<double>(recovery.count) : 0;
  result_.sim_cpu_s = ThreadCpuSeconds() - cpu0;
  return result_;
}

}  // namespace

const char* PolicyName(Policy p) {
  switch (p) {
    case Policy::kManual:
      return "manual";
    case Policy::kDlrover:
      return "dlrover";
    case Policy::kBallast:
      return "ballast";
  }
  return "?";
}

absl::Status ValidateSimOptions(const SimOptions& o) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.gpus_per_node < 1) return bad("--gpus-per-node must be at least 1");
  if (o.gpus < o.gpus_per_node || o.gpus % o.gpus_per_node != 0) {
    return bad(absl::StrCat("--gpus ", o.gpus, " must be a positive multiple of --gpus-per-node ", o.gpus_per_node));
  }
  if (!(o.days > 0) && o.steps <= 0) return bad("--days must be > 0 (or give --steps)");
  if (!(o.failure_rate_per_gpu_day >= 0)) return bad("--failure-rate must be >= 0 (failures per GPU per day)");
  if (!(o.restart_fixable >= 0 && o.restart_fixable <= 1)) return bad("--restart-fixable must be between 0 and 1");
  if (!(o.step_time_s > 0)) return bad("--step-time must be > 0 seconds");
  if (o.spares < 0) return bad("--spares must be >= 0");
  for (double v : {o.node_replacement_s, o.job_start_s, o.manual_delay_s, o.dlrover_restart_s, o.disk_ckpt_s,
                   o.ballast_restart_s, o.flash_ckpt_s, o.detect_s}) {
    if (!(v >= 0)) return bad("times must be >= 0 seconds");
  }
  if (!(o.disk_ckpt_interval_s > 0)) return bad("--disk-ckpt-interval must be > 0 seconds");
  if (!(o.heartbeat_timeout_s > 0)) return bad("--heartbeat-timeout must be > 0 seconds");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Fault>> ParseFaultSchedule(const std::string& text) {
  std::vector<Fault> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> kv = absl::StrSplit(item, ':');
    Fault f;
    if (kv.size() != 2 || !absl::SimpleAtod(kv[0], &f.at_s) || !(f.at_s >= 0) ||
        (kv[1] != "node" && kv[1] != "process")) {
      return absl::InvalidArgumentError(absl::StrCat("--faults: '", item,
                                                     "' is not SECONDS:process or SECONDS:node (e.g. 5.4:process,30:node)"));
    }
    f.node_loss = kv[1] == "node";
    out.push_back(f);
  }
  std::sort(out.begin(), out.end(), [](const Fault& a, const Fault& b) { return a.at_s < b.at_s; });
  return out;
}

double FailureProbabilityPerDay(const SimOptions& o) {
  return 1.0 - std::exp(-static_cast<double>(o.gpus) * o.failure_rate_per_gpu_day);
}

std::vector<Fault> RandomFaults(const SimOptions& o) {
  std::mt19937_64 rng(o.seed);
  const double rate_per_s = static_cast<double>(o.gpus) * o.failure_rate_per_gpu_day / 86400.0;
  std::vector<Fault> out;
  if (rate_per_s <= 0) return out;
  std::exponential_distribution<double> gap(rate_per_s);
  std::uniform_real_distribution<double> u(0, 1);
  const double end = o.days * 86400.0;
  for (double t = gap(rng); t < end; t += gap(rng)) out.push_back(Fault{t, u(rng), u(rng) >= o.restart_fixable});
  return out;
}

PolicyResult RunPolicy(const SimOptions& o, Policy p, const std::vector<Fault>& faults) {
  return PolicyRun(o, p, faults).Go();
}

SimResult Simulate(const SimOptions& o) {
  SimResult r;
  r.nodes = o.gpus / o.gpus_per_node;
  r.p_failure_per_day = FailureProbabilityPerDay(o);
  r.faults = o.random_faults ? RandomFaults(o) : o.faults;
  // The master logs every decision for every node: far too much at this
  // scale, and not the simulation's output.
  const spdlog::level::level_enum level = spdlog::get_level();
  spdlog::set_level(spdlog::level::off);
  // The policies are independent runs (each its own master and clock): one
  // thread each, the results in the order asked.
  r.policies.resize(o.policies.size());
  std::vector<std::thread> runs;
  for (size_t i = 0; i < o.policies.size(); ++i) {
    runs.emplace_back([&, i] { r.policies[i] = RunPolicy(o, o.policies[i], r.faults); });
  }
  for (std::thread& t : runs) t.join();
  spdlog::set_level(level);
  return r;
}

double PolicyResult::Part(const std::string& name) const {
  for (const auto& [n, s] : parts) {
    if (n == name) return s;
  }
  return 0;
}

std::string SimResultJson(const SimOptions& o, const SimResult& r) {
  nlohmann::json doc;
  doc["inputs"] = {{"gpus", o.gpus},
                   {"gpus_per_node", o.gpus_per_node},
                   {"nodes", r.nodes},
                   {"days", o.steps > 0 ? 0.0 : o.days},
                   {"steps", o.steps},
                   {"failure_rate_per_gpu_day", o.failure_rate_per_gpu_day},
                   {"restart_fixable", o.restart_fixable},
                   {"node_replacement_s", o.node_replacement_s},
                   {"spares", o.spares},
                   {"step_time_s", o.step_time_s},
                   {"seed", o.seed},
                   {"job_start_s", o.job_start_s},
                   {"manual_delay_s", o.manual_delay_s},
                   {"dlrover_restart_s", o.dlrover_restart_s},
                   {"disk_ckpt_interval_s", o.disk_ckpt_interval_s},
                   {"disk_ckpt_s", o.disk_ckpt_s},
                   {"ballast_restart_s", o.ballast_restart_s},
                   {"flash_ckpt_s", o.flash_ckpt_s},
                   {"heartbeat_timeout_s", o.heartbeat_timeout_s}};
  doc["p_failure_per_day"] = r.p_failure_per_day;
  int node_faults = 0;
  for (const Fault& f : r.faults) node_faults += f.node_loss ? 1 : 0;
  doc["faults"] = {{"total", r.faults.size()}, {"process", r.faults.size() - node_faults}, {"node", node_faults}};
  nlohmann::json policies = nlohmann::json::object();
  for (const PolicyResult& p : r.policies) {
    nlohmann::json lost = nlohmann::json::object();
    for (const auto& [name, s] : p.parts) {
      if (name != "productive") lost[name] = s;
    }
    policies[PolicyName(p.policy)] = {{"goodput", p.goodput},
                                      {"wall_s", p.wall_s},
                                      {"productive_s", p.Part("productive")},
                                      {"lost_s", lost},
                                      {"steps", p.steps},
                                      {"process_failures", p.process_failures},
                                      {"node_failures", p.node_failures},
                                      {"restarts", p.restarts},
                                      {"rounds", p.rounds},
                                      {"replacements", p.replacements},
                                      {"mean_resume_s", p.mean_resume_s},
                                      {"sim_seconds", p.sim_cpu_s}};
  }
  doc["policies"] = policies;
  return doc.dump(2) + "\n";
}

std::string SimSeriesCsv(const SimResult& r) {
  std::string out = "hours";
  for (const PolicyResult& p : r.policies) absl::StrAppend(&out, ",", PolicyName(p.policy));
  out += "\n";
  size_t n = 0;
  for (const PolicyResult& p : r.policies) n = std::max(n, p.goodput_series.size());
  for (size_t i = 0; i < n; ++i) {
    double hours = -1;
    for (const PolicyResult& p : r.policies) {
      if (i < p.goodput_series.size()) hours = p.goodput_series[i].first;
    }
    absl::StrAppend(&out, absl::StrFormat("%.3f", hours));
    for (const PolicyResult& p : r.policies) {
      absl::StrAppend(&out, ",", i < p.goodput_series.size() ? absl::StrFormat("%.5f", p.goodput_series[i].second) : "");
    }
    out += "\n";
  }
  return out;
}

std::string SimResultText(const SimOptions& o, const SimResult& r) {
  int node_faults = 0;
  for (const Fault& f : r.faults) node_faults += f.node_loss ? 1 : 0;
  std::string out = absl::StrFormat(
      "%d GPUs (%d nodes of %d), %s: P(at least one failure a day) = %.1f%%; %d faults (%d fixed by a process "
      "restart, %d lost nodes)\n",
      o.gpus, r.nodes, o.gpus_per_node,
      o.steps > 0 ? absl::StrCat(o.steps, " steps") : absl::StrFormat("%.1f days", o.days), 100 * r.p_failure_per_day,
      static_cast<int>(r.faults.size()), static_cast<int>(r.faults.size()) - node_faults, node_faults);
  for (const PolicyResult& p : r.policies) {
    std::string lost;
    for (const auto& [name, s] : p.parts) {
      if (name == "productive" || s < 0.05) continue;
      absl::StrAppend(&lost, lost.empty() ? "" : ", ", name, " ", s >= 3600 ? absl::StrFormat("%.1f h", s / 3600)
                                                                            : absl::StrFormat("%.0f s", s));
    }
    absl::StrAppend(&out, absl::StrFormat("  %-8s goodput %5.1f%%  lost: %s; %d restarts, mean resume %.0f s "
                                          "(simulated in %.1f s)\n",
                                          PolicyName(p.policy), 100 * p.goodput, lost.empty() ? "none" : lost,
                                          p.restarts, p.mean_resume_s, p.sim_cpu_s));
  }
  return out;
}

}  // namespace ballast::sim
