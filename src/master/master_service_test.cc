// The Master gRPC service over a real loopback channel: token checks, the
// rendezvous seen through Watch streams, the KV store and status.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "ballast/v1/master.grpc.pb.h"
#include "common/grpc_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "master/master_server.h"

namespace ballast::master {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "s3cret";

class MasterServiceTest : public ::testing::Test {
 protected:
  void StartServer(int min_nodes, int max_nodes) {
    MasterOptions o;
    o.bind_host = "127.0.0.1";
    o.advertise_host = "127.0.0.1";
    o.port = 0;
    o.token = kToken;
    o.job_id = "svc-job";
    o.min_nodes = min_nodes;
    o.max_nodes = max_nodes;
    o.last_call_s = 0.2;
    o.heartbeat_interval_s = 1;
    o.heartbeat_timeout_s = 30;  // no heartbeats needed within a test
    auto server = MasterServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    EXPECT_EQ(server_->address(), "127.0.0.1:" + std::to_string(server_->port()));
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Master::NewStub(channel_);
  }

  static std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token = kToken,
                                                  int deadline_s = 10) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    if (!token.empty()) ctx->AddMetadata(kTokenMetadataKey, token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
    return ctx;
  }

  grpc::Status Join(const std::string& id, int lws, const std::string& token = kToken) {
    v1::JoinRequest req;
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_node_rank_hint(-1);
    req.mutable_node()->set_local_world_size(lws);
    req.mutable_node()->set_host(id + ".example");
    v1::JoinResponse resp;
    return stub_->Join(Ctx(token).get(), req, &resp);
  }

  v1::JobStatus Status() {
    v1::JobStatus st;
    grpc::Status s = stub_->GetStatus(Ctx().get(), v1::StatusRequest(), &st);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return st;
  }

  std::unique_ptr<MasterServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Master::Stub> stub_;
};

TEST_F(MasterServiceTest, WrongOrMissingTokenIsUnauthenticatedAndAddsNoNode) {
  StartServer(2, 2);
  grpc::Status wrong = Join("intruder", 1, "not-the-token");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(wrong.error_message(), HasSubstr("missing or wrong job token"));
  EXPECT_EQ(Join("intruder", 1, "").error_code(), grpc::StatusCode::UNAUTHENTICATED);

  v1::JobStatus st;
  EXPECT_EQ(stub_->GetStatus(Ctx("bad").get(), v1::StatusRequest(), &st).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::Ack ack;
  v1::KvSetRequest set;
  set.set_key("k");
  EXPECT_EQ(stub_->KvSet(Ctx("bad").get(), set, &ack).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::WatchRequest wreq;
  wreq.set_node_id("intruder");
  auto ctx = Ctx("bad");
  auto reader = stub_->Watch(ctx.get(), wreq);
  v1::Decision d;
  EXPECT_FALSE(reader->Read(&d));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);

  v1::JobStatus good = Status();
  EXPECT_EQ(good.nodes_size(), 0);
  EXPECT_EQ(good.state(), "rendezvous");
  EXPECT_EQ(good.job_id(), "svc-job");
}

TEST_F(MasterServiceTest, TwoNodesJoinAndEachWatchGetsConsistentStartRound) {
  StartServer(2, 2);
  ASSERT_TRUE(Join("node-a", 2).ok());
  // Open a's stream before the round forms: it first sees its Wait, then the
  // StartRound pushed when b joins.
  v1::WatchRequest wa;
  wa.set_node_id("node-a");
  auto ctx_a = Ctx();
  auto reader_a = stub_->Watch(ctx_a.get(), wa);
  v1::Decision d;
  ASSERT_TRUE(reader_a->Read(&d));
  EXPECT_TRUE(d.has_wait());

  ASSERT_TRUE(Join("node-b", 3).ok());
  v1::WatchRequest wb;
  wb.set_node_id("node-b");
  auto ctx_b = Ctx();
  auto reader_b = stub_->Watch(ctx_b.get(), wb);

  v1::Decision da, db;
  ASSERT_TRUE(reader_a->Read(&da));
  ASSERT_TRUE(reader_b->Read(&db));
  ASSERT_TRUE(da.has_start_round());
  ASSERT_TRUE(db.has_start_round());
  const v1::StartRound& a = da.start_round();
  const v1::StartRound& b = db.start_round();
  EXPECT_EQ(a.round(), 1);
  EXPECT_EQ(b.round(), 1);
  EXPECT_EQ(std::set<int>({a.group_rank(), b.group_rank()}), std::set<int>({0, 1}));
  EXPECT_EQ(a.group_rank(), 0);  // joined first, no hints
  EXPECT_EQ(a.rank_offset(), 0);
  EXPECT_EQ(b.rank_offset(), 2);
  EXPECT_EQ(a.world_size(), 5);
  EXPECT_EQ(b.world_size(), 5);
  EXPECT_EQ(a.group_world_size(), 2);
  EXPECT_EQ(a.run_id(), "svc-job");
  EXPECT_EQ(a.members_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a.members(i).node_id(), b.members(i).node_id());
    EXPECT_EQ(a.members(i).rank_offset(), b.members(i).rank_offset());
  }
  EXPECT_EQ(a.members(1).host(), "node-b.example");

  // A stale report passes its code through unchanged.
  v1::FailureReport stale;
  stale.set_node_id("node-a");
  stale.set_round(0);
  v1::Ack ack;
  grpc::Status s = stub_->ReportFailure(Ctx().get(), stale, &ack);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(s.error_message(), "stale round 0 (current is 1)");
  v1::HeartbeatRequest hb;
  hb.set_node_id("ghost");
  v1::HeartbeatResponse hb_resp;
  s = stub_->Heartbeat(Ctx().get(), hb, &hb_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "unknown node ghost: join again");

  // Both nodes finish: each stream gets JobFinished and then ends cleanly.
  for (const char* id : {"node-a", "node-b"}) {
    v1::WorkersDoneRequest done;
    done.set_node_id(id);
    done.set_round(1);
    ASSERT_TRUE(stub_->ReportWorkersDone(Ctx().get(), done, &ack).ok());
  }
  for (auto* reader : {reader_a.get(), reader_b.get()}) {
    v1::Decision fin;
    ASSERT_TRUE(reader->Read(&fin));
    ASSERT_TRUE(fin.has_job_finished());
    EXPECT_TRUE(fin.job_finished().succeeded());
  }
  auto result = server_->WaitForFinish(5);
  ASSERT_TRUE(result.has_value());
  EXPECT_TRUE(result->succeeded);

  v1::JobStatus st = Status();
  EXPECT_EQ(st.state(), "succeeded");
  EXPECT_EQ(st.round(), 1);
  EXPECT_EQ(st.world_size(), 5);
  ASSERT_EQ(st.nodes_size(), 2);
  EXPECT_EQ(st.nodes(0).node_id(), "node-a");
  EXPECT_EQ(st.nodes(0).state(), "done");
  EXPECT_EQ(st.nodes(1).group_rank(), 1);
  EXPECT_EQ(st.spec().min_nodes(), 2);
  EXPECT_GE(st.uptime_s(), 0);
  // Both streams already carry JobFinished: the linger ends at once, and the
  // streams end with the server.
  auto t0 = std::chrono::steady_clock::now();
  server_->Shutdown(5);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  for (auto* reader : {reader_a.get(), reader_b.get()}) {
    v1::Decision none;
    EXPECT_FALSE(reader->Read(&none));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
}

TEST_F(MasterServiceTest, KvSetGetRoundTripAndWait) {
  StartServer(1, 1);
  v1::Ack ack;
  v1::KvSetRequest set;
  set.set_key("round/1/master_endpoint");
  set.set_value("10.0.0.1:29500");
  ASSERT_TRUE(stub_->KvSet(Ctx().get(), set, &ack).ok());
  v1::KvGetRequest get;
  get.set_key("round/1/master_endpoint");
  v1::KvGetResponse resp;
  ASSERT_TRUE(stub_->KvGet(Ctx().get(), get, &resp).ok());
  EXPECT_EQ(resp.value(), "10.0.0.1:29500");

  get.set_key("absent");
  EXPECT_EQ(stub_->KvGet(Ctx().get(), get, &resp).error_code(), grpc::StatusCode::NOT_FOUND);

  // A waiting get returns once another client sets the key.
  get.set_key("round/2/master_endpoint");
  get.set_wait_ms(5000);
  std::thread setter([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    v1::KvSetRequest later;
    later.set_key("round/2/master_endpoint");
    later.set_value("h:2");
    v1::Ack a;
    EXPECT_TRUE(stub_->KvSet(Ctx().get(), later, &a).ok());
  });
  grpc::Status s = stub_->KvGet(Ctx().get(), get, &resp);
  setter.join();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.value(), "h:2");
}

TEST_F(MasterServiceTest, ReportShardDurableIsTokenCheckedAndCommitsOnce) {
  StartServer(1, 1);
  v1::ShardDurableReport r;
  r.set_node_id("n");
  r.set_dir("/ckpt");
  r.set_step(3);
  r.set_world_size(2);
  v1::ShardDurableResponse resp;
  EXPECT_EQ(stub_->ReportShardDurable(Ctx("bad").get(), r, &resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(stub_->ReportShardDurable(Ctx().get(), r, &resp).ok());
  EXPECT_FALSE(resp.commit());
  r.set_rank(1);
  ASSERT_TRUE(stub_->ReportShardDurable(Ctx().get(), r, &resp).ok());
  EXPECT_TRUE(resp.commit());
  EXPECT_EQ(resp.committed_step(), 3);
  r.set_rank(5);
  EXPECT_EQ(stub_->ReportShardDurable(Ctx().get(), r, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(MasterServiceTest, ShutdownEndsOpenWatchStreams) {
  StartServer(2, 2);
  ASSERT_TRUE(Join("node-a", 1).ok());
  v1::WatchRequest wa;
  wa.set_node_id("node-a");
  auto ctx = Ctx();
  auto reader = stub_->Watch(ctx.get(), wa);
  v1::Decision d;
  ASSERT_TRUE(reader->Read(&d));
  auto t0 = std::chrono::steady_clock::now();
  server_->Shutdown(5);  // unfinished job: nothing to linger for
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_FALSE(reader->Read(&d));
  EXPECT_FALSE(reader->Finish().ok());
  server_->Shutdown(0);  // idempotent
}

TEST(MasterServerStart, RejectsBadOptionsSayingWhatToFix) {
  MasterOptions o;
  o.bind_host = "127.0.0.1";
  auto r = MasterServer::Start(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--token"));
  o.token = "t";
  o.min_nodes = 3;
  o.max_nodes = 2;
  r = MasterServer::Start(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("MIN <= MAX"));
  o.max_nodes = 3;
  o.node_unit = 0;
  EXPECT_EQ(MasterServer::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.node_unit = 1;
  o.max_restarts = -1;
  EXPECT_EQ(MasterServer::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ballast::master
