// The agent loop against a fake in-process Master service (the seam is the
// gRPC endpoint: the real MasterClient talks to it over a local socket).
#include "agent/agent.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "ballast/v1/master.grpc.pb.h"
#include "common/grpc_util.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr char kToken[] = "secret";

class FakeMaster final : public v1::Master::Service {
 public:
  // --- test side ---
  void Push(const v1::Decision& d) {
    std::lock_guard<std::mutex> lock(mu_);
    decisions_.push_back(d);
    current_ = d;
    cv_.notify_all();
  }
  void PushStart(int64_t round, int group_rank = 0, int restart = 0, int world = 2, int offset = 0) {
    v1::Decision d;
    auto* s = d.mutable_start_round();
    s->set_round(round);
    s->set_group_rank(group_rank);
    s->set_group_world_size(1);
    s->set_rank_offset(offset);
    s->set_world_size(world);
    s->set_restart_count(restart);
    s->set_max_restarts(3);
    s->set_run_id("fake-run");
    Push(d);
  }
  void PushFinished(bool ok, const std::string& msg) {
    v1::Decision d;
    d.mutable_job_finished()->set_succeeded(ok);
    d.mutable_job_finished()->set_message(msg);
    Push(d);
  }
  // Waits until pred() holds (under the lock).
  bool WaitFor(const std::function<bool()>& pred, double timeout_s = 20) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), pred);
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<v1::JoinRequest> joins_;
  std::vector<v1::FailureReport> failures_;
  std::vector<v1::WorkersDoneRequest> dones_;
  std::vector<v1::LeaveRequest> leaves_;
  std::map<std::string, std::string> kv_;
  int heartbeats_ = 0;
  int watches_ = 0;
  v1::HeartbeatRequest last_heartbeat_;
  absl::Status join_error_;
  std::function<void(const v1::JoinRequest&)> on_join_;  // called without the lock

  // --- service side ---
  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* req, v1::JoinResponse* resp) override {
    if (TokenFromContext(*ctx) != kToken) return grpc::Status(grpc::UNAUTHENTICATED, "bad token");
    std::function<void(const v1::JoinRequest&)> hook;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!join_error_.ok()) return ToGrpcStatus(join_error_);
      joins_.push_back(*req);
      cv_.notify_all();
      hook = on_join_;
    }
    resp->set_heartbeat_interval_s(0.1);
    resp->set_heartbeat_timeout_s(5);
    resp->set_job_id("fake-job");
    resp->mutable_spec()->set_min_nodes(1);
    resp->mutable_spec()->set_max_nodes(1);
    if (hook) hook(*req);
    return grpc::Status::OK;
  }
  grpc::Status Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* req, v1::Ack*) override {
    std::lock_guard<std::mutex> lock(mu_);
    leaves_.push_back(*req);
    cv_.notify_all();
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req, v1::HeartbeatResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++heartbeats_;
    last_heartbeat_ = *req;
    cv_.notify_all();
    return grpc::Status::OK;
  }
  grpc::Status ReportFailure(grpc::ServerContext*, const v1::FailureReport* req, v1::Ack*) override {
    std::lock_guard<std::mutex> lock(mu_);
    failures_.push_back(*req);
    cv_.notify_all();
    return grpc::Status::OK;
  }
  grpc::Status ReportWorkersDone(grpc::ServerContext*, const v1::WorkersDoneRequest* req, v1::Ack*) override {
    std::lock_guard<std::mutex> lock(mu_);
    dones_.push_back(*req);
    cv_.notify_all();
    return grpc::Status::OK;
  }
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest* req, v1::Ack*) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[req->key()] = req->value();
    cv_.notify_all();
    return grpc::Status::OK;
  }
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest* req, v1::KvGetResponse* resp) override {
    std::unique_lock<std::mutex> lock(mu_);
    bool found = cv_.wait_for(lock, std::chrono::milliseconds(req->wait_ms()),
                              [&] { return kv_.count(req->key()) > 0; });
    if (!found) return grpc::Status(grpc::NOT_FOUND, "no key " + req->key());
    resp->set_value(kv_[req->key()]);
    return grpc::Status::OK;
  }
  grpc::Status Watch(grpc::ServerContext* ctx, const v1::WatchRequest*,
                     grpc::ServerWriter<v1::Decision>* writer) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++watches_;
    cv_.notify_all();
    // Like the real master: the current decision first, then every new one.
    size_t next = decisions_.size();
    if (current_.has_value() && !writer->Write(*current_)) return grpc::Status::OK;
    while (!ctx->IsCancelled() && !closing_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      while (next < decisions_.size()) {
        v1::Decision d = decisions_[next++];
        lock.unlock();
        bool ok = writer->Write(d);
        lock.lock();
        if (!ok) return grpc::Status::OK;
      }
    }
    return grpc::Status(grpc::UNAVAILABLE, "closing");
  }
  void CloseStreams() {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    cv_.notify_all();
  }

 private:
  std::deque<v1::Decision> decisions_;
  std::optional<v1::Decision> current_;
  bool closing_ = false;
};

class FakeMasterServer {
 public:
  FakeMasterServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeMasterServer() { Stop(); }
  void Stop() {
    if (!server_) return;
    service_.CloseStreams();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.reset();
  }
  std::string endpoint() const { return absl::StrCat("127.0.0.1:", port_); }
  FakeMaster& fake() { return service_; }

 private:
  FakeMaster service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

class TempDir {
 public:
  TempDir() : path_(fs::path(::testing::TempDir()) / ("agent_" + RandomHex(6))) { fs::create_directories(path_); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

AgentOptions Options(const std::string& endpoint, const std::string& script, int nproc = 2) {
  AgentOptions o;
  o.run.nproc_per_node = nproc;
  o.run.no_python = true;
  o.run.training_script = "/bin/sh";
  o.run.training_args = {"-c", script};
  o.run.monitor_interval_s = 0.02;
  o.endpoint = endpoint;
  o.token = kToken;
  o.node_id = "node-test";
  o.tunables.stop_grace_s = 1;
  o.tunables.reconnect_timeout_s = 1;
  o.tunables.connect_timeout_s = 2;
  o.tunables.kv_wait_s = 5;
  return o;
}

// Runs the agent on its own thread (a thread that outlives the workers).
std::future<int> RunAsync(Agent* agent) {
  return std::async(std::launch::async, [agent] { return agent->Run(); });
}

TEST(Agent, JoinsRunsARoundAndExitsZeroWhenTheJobSucceeds) {
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  m.on_join_ = [&](const v1::JoinRequest&) { m.PushStart(1); };
  AgentOptions o = Options(server.endpoint(), "exit 0");
  o.run.nnodes_given = true;
  o.run.min_nodes = 1;
  o.run.max_nodes = 2;
  o.run.max_restarts = 4;
  o.run.rdzv_id = "myrun";
  Agent agent(o);
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m.WaitFor([&] { return !m.dones_.empty(); }));
  m.PushFinished(true, "");
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 0);
  std::lock_guard<std::mutex> lock(m.mu_);
  ASSERT_EQ(m.joins_.size(), 1u);
  const auto& join = m.joins_[0];
  EXPECT_EQ(join.node().node_id(), "node-test");
  EXPECT_EQ(join.node().local_world_size(), 2);
  EXPECT_EQ(join.node().host(), "127.0.0.1");  // loopback master -> loopback host
  EXPECT_EQ(join.node().node_rank_hint(), -1);
  EXPECT_EQ(join.spec().min_nodes(), 1);
  EXPECT_EQ(join.spec().max_nodes(), 2);
  EXPECT_EQ(join.spec().max_restarts(), 4);
  EXPECT_EQ(join.spec().run_id(), "myrun");
  EXPECT_EQ(m.dones_[0].round(), 1);
  ASSERT_EQ(m.kv_.count("round/1/master_endpoint"), 1u);
  EXPECT_THAT(m.kv_["round/1/master_endpoint"], HasSubstr("127.0.0.1:"));
  EXPECT_TRUE(m.failures_.empty());
}

TEST(Agent, ReportsAFailureRestartsOnANewRoundAndExitsOneWhenTheJobFails) {
  TempDir dir;
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  m.on_join_ = [&](const v1::JoinRequest&) { m.PushStart(1, 0, 0, 2, 0); };
  // Local rank 1 fails in the first attempt; the restart records its env.
  std::string script = absl::StrCat("echo $TORCHELASTIC_RESTART_COUNT-$RANK-$MASTER_ADDR >> ", dir / "runs",
                                    "; if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $LOCAL_RANK = 1 ]; then "
                                    "echo 'Traceback: boom' >&2; exit 3; fi; sleep 300");
  Agent agent(Options(server.endpoint(), script));
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m.WaitFor([&] { return !m.failures_.empty(); }));
  {
    std::lock_guard<std::mutex> lock(m.mu_);
    const auto& f = m.failures_[0];
    EXPECT_EQ(f.node_id(), "node-test");
    EXPECT_EQ(f.round(), 1);
    EXPECT_EQ(f.local_rank(), 1);
    EXPECT_EQ(f.global_rank(), 1);
    EXPECT_EQ(f.exit_code(), 3);
    EXPECT_EQ(f.signal(), 0);
    EXPECT_EQ(f.cause(), "exit code 3");
    EXPECT_EQ(f.stderr_tail(), "Traceback: boom");
  }
  m.PushStart(2, 0, 1, 2, 0);
  ASSERT_TRUE(m.WaitFor([&] { return m.last_heartbeat_.round() == 2 && m.last_heartbeat_.workers_size() == 2; }));
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ReadFile(dir / "runs").find("1-1-127.0.0.1") == std::string::npos && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_THAT(ReadFile(dir / "runs"), HasSubstr("1-0-127.0.0.1"));
  EXPECT_THAT(ReadFile(dir / "runs"), HasSubstr("1-1-127.0.0.1"));
  m.PushFinished(false, "node node-test rank 1 failed: exit code 3");
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 1);
  std::lock_guard<std::mutex> lock(m.mu_);
  EXPECT_EQ(m.failures_.size(), 1u);  // the restarted workers were stopped, not failed
  for (const auto& w : m.last_heartbeat_.workers()) EXPECT_FALSE(ProcessAlive(static_cast<pid_t>(w.pid())));
}

TEST(Agent, ARepeatedStartRoundDoesNotRestartWorkers) {
  TempDir dir;
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  m.on_join_ = [&](const v1::JoinRequest&) { m.PushStart(3); };
  Agent agent(Options(server.endpoint(), absl::StrCat("echo x >> ", dir / "starts", "; sleep 300"), 1));
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m.WaitFor([&] { return m.last_heartbeat_.round() == 3; }));
  m.PushStart(3);  // what a reconnecting watch receives
  m.PushStart(2);  // stale
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  m.PushFinished(true, "");
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 0);
  EXPECT_EQ(ReadFile(dir / "starts"), "x\n");
}

TEST(Agent, NonZeroGroupRankTakesMasterEndpointFromTheKvStore) {
  TempDir dir;
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  m.on_join_ = [&](const v1::JoinRequest&) { m.PushStart(1, 1, 0, 4, 2); };
  Agent agent(Options(server.endpoint(), absl::StrCat("echo $RANK $MASTER_ADDR $MASTER_PORT >> ", dir / "env"), 2));
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m.WaitFor([&] { return !m.joins_.empty(); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the agent waits on KvGet meanwhile
  {
    std::lock_guard<std::mutex> lock(m.mu_);
    m.kv_["round/1/master_endpoint"] = "10.9.9.9:1234";
    m.cv_.notify_all();
  }
  ASSERT_TRUE(m.WaitFor([&] { return !m.dones_.empty(); }));
  m.PushFinished(true, "");
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 0);
  std::string env = ReadFile(dir / "env");
  EXPECT_THAT(env, HasSubstr("2 10.9.9.9 1234\n"));
  EXPECT_THAT(env, HasSubstr("3 10.9.9.9 1234\n"));
}

TEST(Agent, ExitsOneWhenTheMasterRefusesTheToken) {
  FakeMasterServer server;
  AgentOptions o = Options(server.endpoint(), "exit 0");
  o.token = "wrong";
  Agent agent(o);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(agent.Run(), 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.5);
}

TEST(Agent, ExitsOneWhenTheMasterRefusesTheJoin) {
  FakeMasterServer server;
  server.fake().join_error_ = absl::FailedPreconditionError("--nnodes 1:2 contradicts the master's 2:4");
  Agent agent(Options(server.endpoint(), "exit 0"));
  EXPECT_EQ(agent.Run(), 1);
}

TEST(Agent, ExitsOneWhenTheMasterIsUnreachable) {
  auto port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  AgentOptions o = Options(absl::StrCat("127.0.0.1:", *port), "exit 0");
  o.run.join_timeout_s = 0.5;
  Agent agent(o);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(agent.Run(), 1);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.4);
  EXPECT_LT(took, 5);
}

TEST(Agent, ASignalStopsWorkersLeavesAndExits128PlusSignal) {
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  m.on_join_ = [&](const v1::JoinRequest&) { m.PushStart(1); };
  Agent agent(Options(server.endpoint(), "sleep 300"));
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m.WaitFor([&] { return m.last_heartbeat_.workers_size() == 2; }));
  std::vector<pid_t> pids;
  {
    std::lock_guard<std::mutex> lock(m.mu_);
    for (const auto& w : m.last_heartbeat_.workers()) pids.push_back(static_cast<pid_t>(w.pid()));
  }
  for (pid_t p : pids) EXPECT_TRUE(ProcessAlive(p));
  agent.PostSignal(SIGTERM);
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 128 + SIGTERM);
  for (pid_t p : pids) EXPECT_FALSE(ProcessAlive(p));
  std::lock_guard<std::mutex> lock(m.mu_);
  ASSERT_EQ(m.leaves_.size(), 1u);
  EXPECT_EQ(m.leaves_[0].node_id(), "node-test");
}

TEST(Agent, ASecondSignalKillsWorkersThatIgnoreSigterm) {
  TempDir dir;
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  m.on_join_ = [&](const v1::JoinRequest&) { m.PushStart(1); };
  AgentOptions o = Options(server.endpoint(),
                           absl::StrCat("trap '' TERM; touch ", dir / "ready", "; while true; do sleep 0.05; done"), 1);
  o.tunables.stop_grace_s = 60;
  Agent agent(o);
  auto result = RunAsync(&agent);
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!fs::exists(dir / "ready") && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  agent.PostSignal(SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(result.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);  // still in the grace
  agent.PostSignal(SIGINT);
  ASSERT_EQ(result.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(result.get(), 128 + SIGINT);
}

TEST(Agent, ASignalDuringTheInitialJoinEndsItAtOnce) {
  auto port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok());
  AgentOptions o = Options(absl::StrCat("127.0.0.1:", *port), "exit 0");
  o.tunables.connect_timeout_s = 60;
  Agent agent(o);
  auto result = RunAsync(&agent);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  agent.PostSignal(SIGTERM);
  ASSERT_EQ(result.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(result.get(), 128 + SIGTERM);
}

TEST(Agent, ALostMasterStopsWorkersAndExitsOne) {
  auto server = std::make_unique<FakeMasterServer>();
  FakeMaster* m = &server->fake();
  m->on_join_ = [m](const v1::JoinRequest&) { m->PushStart(1); };
  Agent agent(Options(server->endpoint(), "sleep 300", 1));
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m->WaitFor([&] { return m->last_heartbeat_.workers_size() == 1; }));
  pid_t pid;
  {
    std::lock_guard<std::mutex> lock(m->mu_);
    pid = static_cast<pid_t>(m->last_heartbeat_.workers(0).pid());
  }
  server->Stop();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 1);
  EXPECT_FALSE(ProcessAlive(pid));
}

TEST(Agent, ReconnectsToAMasterThatComesBackAndKeepsItsWorkers) {
  TempDir dir;
  FakeMasterServer server;
  FakeMaster& m = server.fake();
  std::atomic<int> joins{0};
  m.on_join_ = [&](const v1::JoinRequest&) {
    if (++joins == 1) m.PushStart(1);
  };
  AgentOptions o = Options(server.endpoint(), absl::StrCat("echo x >> ", dir / "starts", "; sleep 300"), 1);
  o.tunables.reconnect_timeout_s = 10;
  Agent agent(o);
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m.WaitFor([&] { return m.last_heartbeat_.round() == 1 && m.watches_ == 1; }));
  // Break the stream once; the agent re-joins and re-watches, gets round 1 again.
  m.CloseStreams();
  ASSERT_TRUE(m.WaitFor([&] { return m.joins_.size() >= 2; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  m.PushFinished(true, "");
  // Streams stay closed in this fake now; the finish is delivered on a re-watch,
  // which the fake answers with the current decision.
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 0);
  EXPECT_EQ(ReadFile(dir / "starts"), "x\n");
}

TEST(Agent, FollowsAMasterThatMovedWhereItsLocatorSaysAndKeepsItsWorkers) {
  // A master pod replaced on Kubernetes: the old address is gone for good,
  // the job's Lease names the new one. The workers never restart.
  TempDir dir;
  auto old_master = std::make_unique<FakeMasterServer>();
  FakeMaster* m1 = &old_master->fake();
  m1->on_join_ = [m1](const v1::JoinRequest&) { m1->PushStart(1); };
  FakeMasterServer new_master;
  FakeMaster& m2 = new_master.fake();
  // The new master resumed round 1: it re-sends the round the agent runs.
  m2.on_join_ = [&m2](const v1::JoinRequest&) { m2.PushStart(1); };
  std::mutex mu;
  std::string located;  // "" until the new master holds the Lease
  std::atomic<int> lookups{0};
  AgentOptions o = Options(old_master->endpoint(), absl::StrCat("echo x >> ", dir / "starts", "; sleep 300"), 1);
  o.tunables.reconnect_timeout_s = 10;
  o.locate_master = [&] {
    ++lookups;
    std::lock_guard<std::mutex> lock(mu);
    return located;
  };
  Agent agent(o);
  auto result = RunAsync(&agent);
  ASSERT_TRUE(m1->WaitFor([&] { return m1->last_heartbeat_.round() == 1 && m1->watches_ == 1; }));
  EXPECT_EQ(lookups.load(), 0) << "no lookup while the master answers";
  old_master->Stop();
  old_master.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // no master at all for a while
  EXPECT_GT(lookups.load(), 0);
  {
    std::lock_guard<std::mutex> lock(mu);
    located = new_master.endpoint();
  }
  ASSERT_TRUE(m2.WaitFor([&] { return m2.joins_.size() >= 1 && m2.last_heartbeat_.round() == 1; }));
  m2.PushFinished(true, "");
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(result.get(), 0);
  EXPECT_EQ(ReadFile(dir / "starts"), "x\n") << "the worker started once";
}

TEST(AgentHelpers, DerivesHostAndCommand) {
  EXPECT_EQ(DeriveHost("", "localhost"), "127.0.0.1");
  EXPECT_EQ(DeriveHost("", "127.0.0.2"), "127.0.0.1");
  EXPECT_EQ(DeriveHost("10.0.0.5", "localhost"), "10.0.0.5");
  // A master name that does not resolve here: the host name, as before.
  EXPECT_EQ(DeriveHost("", "master.invalid"), HostName());
  RunOptions o;
  o.training_script = "train.py";
  o.training_args = {"--lr", "1"};
  EXPECT_EQ(WorkerCommand(o), (std::vector<std::string>{"python3", "-u", "train.py", "--lr", "1"}));
  o.module = true;
  o.python = "/usr/bin/python3";
  EXPECT_EQ(WorkerCommand(o), (std::vector<std::string>{"/usr/bin/python3", "-u", "-m", "train.py", "--lr", "1"}));
  o.module = false;
  o.no_python = true;
  EXPECT_EQ(WorkerCommand(o), (std::vector<std::string>{"train.py", "--lr", "1"}));
  std::string id = MakeNodeId();
  EXPECT_THAT(id, HasSubstr(absl::StrCat("-", getpid(), "-")));
  RunOptions none;
  v1::JobSpec spec = JoinSpec(none);
  EXPECT_EQ(spec.min_nodes(), 0);
  EXPECT_FALSE(spec.has_max_restarts());
  EXPECT_EQ(spec.run_id(), "");
}

}  // namespace
}  // namespace ballast::agent
