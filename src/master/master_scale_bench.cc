// master_scale_bench: how the job master's cost grows with the number of
// agents. A real `ballast master` process on loopback; N simulated agents in
// this process (callback gRPC clients spread over N/100 channels, no Python):
// each joins, keeps a Watch stream open and heartbeats once a second, like
// `ballast run`'s MasterClient. One line per size:
//
//   agents=N rendezvous_s=X heartbeat_cores=Y push_s=Z rss_mb=W
//
//   rendezvous_s     first Join sent -> every agent read StartRound(round 1)
//   heartbeat_cores  the master's CPU time (user + system, /proc) over a
//                    window of 1 Hz heartbeats from every agent, / wall time
//   push_s           one agent's failure report sent -> every agent read the
//                    restart's StartRound (includes the 0.1 s failure settle)
//   rss_mb           the master's resident memory at the end
//
// Usage: master_scale_bench [--ballast build/bin/ballast] [--agents 100,1000,10000]
//                           [--heartbeat-window-s 10]
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "ballast/v1/master.grpc.pb.h"
#include "common/grpc_util.h"
#include "common/net.h"
#include "common/subprocess.h"

namespace ballast {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kAgentsPerChannel = 100;
const char* const kToken = "scale-bench-token";

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// utime + stime of a process, in seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::vector<std::string> f = absl::StrSplit(stat.substr(close + 2), ' ');
  // Fields after "pid (comm) ": state is [0], utime [11], stime [12].
  double ut = 0, st = 0;
  if (f.size() < 13 || !absl::SimpleAtod(f[11], &ut) || !absl::SimpleAtod(f[12], &st)) return 0;
  return (ut + st) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double RssMb(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  }
  return 0;
}

struct Counter {
  std::mutex mu;
  std::condition_variable cv;
  int n = 0;
  void Add() {
    std::lock_guard<std::mutex> lock(mu);
    ++n;
    cv.notify_all();
  }
  bool WaitFor(int want, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return n >= want; });
  }
  int Get() {
    std::lock_guard<std::mutex> lock(mu);
    return n;
  }
};

class SimAgent;

struct Fleet {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::Master::Stub>> stubs;
  Counter joined, round1, round2, errors;
};

void Authorize(grpc::ClientContext* ctx) { ctx->AddMetadata(std::string(kTokenMetadataKey), kToken); }

// One agent: Join, then a Watch stream that counts the rounds it reads.
class SimAgent final : public grpc::ClientReadReactor<v1::Decision> {
 public:
  SimAgent(Fleet* fleet, v1::Master::Stub* stub, int index) : fleet_(fleet), stub_(stub) {
    id_ = absl::StrCat("sim-", index);
  }
  const std::string& id() const { return id_; }
  v1::Master::Stub* stub() const { return stub_; }

  void Join() {
    auto* ctx = new grpc::ClientContext();
    Authorize(ctx);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    auto* req = new v1::JoinRequest();
    req->mutable_node()->set_node_id(id_);
    req->mutable_node()->set_local_world_size(1);
    req->mutable_node()->set_host("127.0.0.1");
    req->mutable_node()->set_node_rank_hint(-1);
    auto* resp = new v1::JoinResponse();
    stub_->async()->Join(ctx, req, resp, [this, ctx, req, resp](grpc::Status s) {
      delete ctx;
      delete req;
      delete resp;
      if (!s.ok()) {
        std::fprintf(stderr, "join %s: %s\n", id_.c_str(), s.error_message().c_str());
        fleet_->errors.Add();
        return;
      }
      fleet_->joined.Add();
      StartWatch();
    });
  }
  void StartWatch() {
    Authorize(&watch_ctx_);
    watch_req_.set_node_id(id_);
    stub_->async()->Watch(&watch_ctx_, &watch_req_, this);
    StartRead(&decision_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ends (OnDone follows)
    if (decision_.has_start_round()) {
      round_ = decision_.start_round().round();
      if (round_ == 1) fleet_->round1.Add();
      if (round_ == 2) fleet_->round2.Add();
    }
    StartRead(&decision_);
  }
  void OnDone(const grpc::Status&) override {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_ = true;
    done_cv_.notify_all();
  }
  void Cancel() { watch_ctx_.TryCancel(); }
  void WaitDone() {
    std::unique_lock<std::mutex> lock(done_mu_);
    done_cv_.wait_for(lock, std::chrono::seconds(10), [&] { return done_; });
  }
  bool watching() const { return !watch_req_.node_id().empty(); }
  int64_t round() const { return round_; }

 private:
  Fleet* fleet_;
  v1::Master::Stub* stub_;
  std::string id_;
  grpc::ClientContext watch_ctx_;
  v1::WatchRequest watch_req_;
  v1::Decision decision_;
  std::atomic<int64_t> round_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  bool done_ = false;
};

// Sends one heartbeat per agent per second, evenly spread, for window_s;
// waits for the answers.
void Heartbeats(std::vector<std::unique_ptr<SimAgent>>& agents, double window_s, Counter* failed) {
  Counter answered;
  int sent = 0;
  const auto start = Clock::now();
  const double per_s = static_cast<double>(agents.size());
  while (Since(start) < window_s) {
    const int due = static_cast<int>(Since(start) * per_s);
    for (; sent < due; ++sent) {
      SimAgent& a = *agents[sent % agents.size()];
      auto* ctx = new grpc::ClientContext();
      Authorize(ctx);
      ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      auto* req = new v1::HeartbeatRequest();
      req->set_node_id(a.id());
      req->set_round(a.round());
      auto* resp = new v1::HeartbeatResponse();
      a.stub()->async()->Heartbeat(ctx, req, resp, [ctx, req, resp, &answered, failed](grpc::Status s) {
        delete ctx;
        delete req;
        delete resp;
        if (!s.ok()) failed->Add();
        answered.Add();
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  answered.WaitFor(sent, 60);
}

int RunSize(const std::string& ballast, int n, double window_s) {
  const int port = [] {
    auto p = PickFreePort();
    return p.ok() ? *p : 0;
  }();
  SpawnOptions so;
  so.argv = {ballast, "master", "--nnodes", std::to_string(n), "--host", "127.0.0.1", "--port", std::to_string(port),
             "--token", kToken, "--http-port", "-1", "--heartbeat-timeout", "60", "--last-call", "0",
             "--job-id", "scale"};
  so.env = CurrentEnvironment();
  so.env["BALLAST_LOG_LEVEL"] = "warn";  // 10,000 joins and decisions at info would measure the terminal
  so.stdout_file = "/dev/null";
  auto master = Subprocess::Spawn(so);
  if (!master.ok()) {
    std::fprintf(stderr, "cannot start %s: %s\n", ballast.c_str(), std::string(master.status().message()).c_str());
    return 1;
  }
  Fleet fleet;
  const int nchan = (n + kAgentsPerChannel - 1) / kAgentsPerChannel;
  for (int c = 0; c < nchan; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("ballast.bench.channel", c);  // a connection of its own
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    fleet.channels.push_back(grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                                       grpc::InsecureChannelCredentials(), args));
    fleet.stubs.push_back(v1::Master::NewStub(fleet.channels.back()));
  }
  for (auto& ch : fleet.channels) {
    if (!ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30))) {
      std::fprintf(stderr, "the master on port %d did not come up\n", port);
      return 1;
    }
  }
  std::vector<std::unique_ptr<SimAgent>> agents;
  for (int i = 0; i < n; ++i) agents.push_back(std::make_unique<SimAgent>(&fleet, fleet.stubs[i % nchan].get(), i));

  const auto t0 = Clock::now();
  for (auto& a : agents) a->Join();
  const bool formed = fleet.round1.WaitFor(n, 300);
  const double rendezvous_s = Since(t0);

  Counter hb_failed;
  const double cpu0 = CpuSeconds(master->pid());
  const auto w0 = Clock::now();
  if (formed) Heartbeats(agents, window_s, &hb_failed);
  const double heartbeat_cores = (CpuSeconds(master->pid()) - cpu0) / Since(w0);

  double push_s = -1;
  if (formed) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::FailureReport report;
    report.set_node_id(agents[0]->id());
    report.set_round(1);
    report.set_global_rank(0);
    report.set_exit_code(1);
    report.set_cause("exit code 1");
    v1::Ack ack;
    const auto t1 = Clock::now();
    grpc::Status s = fleet.stubs[0]->ReportFailure(&ctx, report, &ack);
    if (s.ok() && fleet.round2.WaitFor(n, 300)) push_s = Since(t1);
  }
  const double rss_mb = RssMb(master->pid());
  std::printf("agents=%d rendezvous_s=%.3f heartbeat_cores=%.3f push_s=%.3f rss_mb=%.1f\n", n,
              formed ? rendezvous_s : -1.0, heartbeat_cores, push_s, rss_mb);
  std::fflush(stdout);
  if (!formed || hb_failed.Get() > 0 || fleet.errors.Get() > 0) {
    std::fprintf(stderr, "agents=%d: %d of %d in round 1, %d join errors, %d heartbeats failed\n", n,
                 fleet.round1.Get(), n, fleet.errors.Get(), hb_failed.Get());
  }
  master->Signal(SIGKILL);
  master->Wait(10);
  for (auto& a : agents) {
    if (a->watching()) a->WaitDone();  // the master is gone: every stream ends
  }
  return formed && push_s >= 0 ? 0 : 1;
}

}  // namespace
}  // namespace ballast

int main(int argc, char** argv) {
  std::string ballast = "build/bin/ballast";
  std::string sizes = "100,1000,10000";
  double window_s = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--ballast") {
      ballast = argv[i + 1];
    } else if (flag == "--agents") {
      sizes = argv[i + 1];
    } else if (flag == "--heartbeat-window-s") {
      window_s = std::atof(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s\nusage: %s [--ballast PATH] [--agents 100,1000,10000] "
                           "[--heartbeat-window-s 10]\n", flag.c_str(), argv[0]);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "usage: %s [--ballast PATH] [--agents 100,1000,10000] [--heartbeat-window-s 10]\n", argv[0]);
    return 2;
  }
  int rc = 0;
  for (absl::string_view s : absl::StrSplit(sizes, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      std::fprintf(stderr, "--agents: %s is not a positive count\n", std::string(s).c_str());
      return 2;
    }
    rc |= ballast::RunSize(ballast, n, window_s);
  }
  return rc;
}
