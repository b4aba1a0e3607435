// MasterClient::Join against a real gRPC server on a local port (the seam is
// the endpoint): a master that starts after the agent is joined as soon as
// it listens, and a master that answers is heard even when the connection
// came up as the join budget ran out.
#include "agent/master_client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"

namespace ballast::agent {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Answers Join with a job id; counts the joins.
class JoinOnlyMaster final : public v1::Master::Service {
 public:
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*, v1::JoinResponse* response) override {
    ++joins;
    response->set_job_id("job-1");
    return grpc::Status::OK;
  }
  std::atomic<int> joins{0};
};

constexpr char kServePortEnv[] = "BALLAST_TEST_SERVE_PORT";

// The master of the test below, in a process of its own: this binary, run
// with BALLAST_TEST_SERVE_PORT, serves joins from its static initialization
// until the test kills it (before gtest's main, so it is no test of its own and
// ctest lists nothing skipped). An in-process server would poll the client's
// connections too (one epoll set per process) and hide what the agent's
// process does alone.
[[maybe_unused]] const bool kServingJoins = [] {
  const char* port = std::getenv(kServePortEnv);
  if (port == nullptr) return false;
  JoinOnlyMaster service;
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (bound == 0) std::_Exit(3);
  server->Wait();  // until the test kills this process
  std::_Exit(0);
}();

TEST(MasterClientJoin, JoinsAMasterThatStartsAfterTheAgentAsSoonAsItListens) {
  // Between the agent's fail-fast attempts, gRPC's own reconnect attempt
  // (started by a timer) was polled by nobody in the agent's process: its
  // TCP connect and handshake waited for gRPC's backup poller (every 5 s) or
  // a lucky attempt, so such an agent often did not join within its budget.
  absl::StatusOr<int> port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok()) << port.status();
  MasterClientOptions o;
  o.endpoint = absl::StrCat("127.0.0.1:", *port);
  o.token = "t";
  MasterClient client(o);
  v1::JoinRequest request;
  request.mutable_node()->set_node_id("node-0");
  auto joined = std::async(std::launch::async, [&] { return client.Join(request, 30); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a few refused attempts
  SpawnOptions so;
  so.argv = {SelfExePath()};
  so.env = CurrentEnvironment();
  so.env[kServePortEnv] = std::to_string(*port);
  absl::StatusOr<Subprocess> master = Subprocess::Spawn(so);
  ASSERT_TRUE(master.ok()) << master.status();
  const auto started = Clock::now();
  ASSERT_EQ(joined.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  absl::StatusOr<v1::JoinResponse> r = joined.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->job_id(), "job-1");
  // The master process starts in well under a second, and gRPC reconnects
  // after at most its 2 s backoff (+20% jitter): nothing waits for the
  // backup poller.
  EXPECT_LT(SecondsSince(started), 4.0);
  master->Terminate(0);
}

TEST(MasterClientJoin, CancelEndsAJoinThatWaitsForTheMaster) {
  absl::StatusOr<int> port = PickFreePort("127.0.0.1");
  ASSERT_TRUE(port.ok()) << port.status();
  MasterClientOptions o;
  o.endpoint = absl::StrCat("127.0.0.1:", *port);
  MasterClient client(o);
  auto joined = std::async(std::launch::async, [&] { return client.Join(v1::JoinRequest(), 60); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto cancelled = Clock::now();
  client.Cancel();
  ASSERT_EQ(joined.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(joined.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(SecondsSince(cancelled), 2.0);
}

TEST(MasterClientJoin, AConnectionTheMasterClosedIsToldApart) {
  EXPECT_TRUE(MasterClosedConnection("failed to connect to all addresses; last error: UNAVAILABLE: "
                                     "ipv4:127.0.0.1:4000: Socket closed"));
  EXPECT_TRUE(MasterClosedConnection("ipv4:10.0.0.1:4000: Connection reset by peer"));
  EXPECT_FALSE(MasterClosedConnection("ipv4:127.0.0.1:4000: Failed to connect to remote host: Connection refused"));
  EXPECT_FALSE(MasterClosedConnection("Deadline Exceeded"));
}

}  // namespace
}  // namespace ballast::agent
