// RoundAddress with a map standing in for the master's KV store and fake
// port probing: group rank 0 publishes the round's endpoint, the others read
// it or time out, the address check's verdicts, and the store watch.
#include "agent/round_address.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fake_kv.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "health/failure_class.h"

namespace ballast::agent {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kS = 1'000'000'000ull;

google::protobuf::RepeatedPtrField<v1::RoundMember> Members() {
  google::protobuf::RepeatedPtrField<v1::RoundMember> ms;
  const char* hosts[] = {"10.0.0.1", "10.0.0.2", "10.0.0.3"};
  for (int g = 0; g < 3; ++g) {
    v1::RoundMember* m = ms.Add();
    m->set_node_id(absl::StrCat("n", g));
    m->set_group_rank(g);
    m->set_local_world_size(2);
    m->set_rank_offset(2 * g);
    m->set_host(hosts[g]);
  }
  return ms;
}

// Round 3 of Members(), seen from group rank `group_rank`.
v1::StartRound Round(int group_rank) {
  v1::StartRound s;
  s.set_round(3);
  s.set_group_rank(group_rank);
  s.set_group_world_size(3);
  s.set_rank_offset(2 * group_rank);
  s.set_world_size(6);
  *s.mutable_members() = Members();
  return s;
}

// What the fake network answers and what was asked of it.
struct FakeNet {
  absl::StatusOr<int> free_port = 29511;
  bool probe_opens = true;
  absl::Status connect_status;
  absl::Status resolve_status;
  absl::StatusOr<TcpPortUse> port_use = TcpPortUse{};
  std::vector<std::string> connects;  // "host:port timeout"
  int port_use_calls = 0;
};

class RoundAddressTest : public ::testing::Test {
 protected:
  RoundAddress Make(int node_rank = 1, double kv_wait_s = 1.0) {
    RoundAddressOptions o;
    o.node_id = "n1";
    o.host = "10.0.0.2";
    o.node_rank = node_rank;
    o.kv_wait_s = kv_wait_s;
    o.reconnect_timeout_s = 1.0;
    o.addr_check_timeout_s = 2.5;
    o.store_connect_timeout_s = 2.0;
    RoundAddressHooks h;
    h.kv_set = kv_.Setter();
    h.kv_get = [get = kv_.Getter()](const std::string& k, double) { return get(k); };  // answers at once
    h.pick_port = [this] { return net_.free_port; };
    h.open_probe = [this]() -> absl::StatusOr<std::unique_ptr<ProbeListener>> {
      if (!net_.probe_opens) return absl::UnavailableError("no sockets today");
      return ProbeListener::Start();
    };
    h.connect = [this](const std::string& host, int port, double timeout_s) {
      net_.connects.push_back(absl::StrCat(host, ":", port, " ", timeout_s));
      return net_.connect_status;
    };
    h.resolve = [this](const std::string&) { return net_.resolve_status; };
    h.port_use = [this](int) {
      ++net_.port_use_calls;
      return net_.port_use;
    };
    return RoundAddress(o, std::move(h), [] { return std::string("node=n1 round=3"); });
  }
  static bool NotSuperseded() { return false; }

  FakeKv kv_;
  FakeNet net_;
};

TEST(RoundEndpoint, KvValueRoundTripsAndOldValuesHaveNoProbe) {
  RoundEndpoint ep{"10.0.0.2", 29500, 41000};
  EXPECT_EQ(ep.ToKvValue(), "10.0.0.2:29500 probe=41000");
  auto back = RoundEndpoint::FromKvValue(ep.ToKvValue());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->host, "10.0.0.2");
  EXPECT_EQ(back->port, 29500);
  EXPECT_EQ(back->probe_port, 41000);
  auto old = RoundEndpoint::FromKvValue("host2:29500");
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->probe_port, 0);
  EXPECT_FALSE(RoundEndpoint::FromKvValue("h:1 probe=x").ok());
}

TEST_F(RoundAddressTest, GroupRankZeroPublishesItsEndpointWithAProbe) {
  RoundAddress ra = Make(/*node_rank=*/0);
  auto ep = ra.Resolve(Round(0), NotSuperseded);
  ASSERT_TRUE(ep.ok()) << ep.status();
  EXPECT_EQ(ep->host, "10.0.0.2");
  EXPECT_EQ(ep->port, 29511);
  EXPECT_GT(ep->probe_port, 0);
  EXPECT_TRUE(ra.probe_open());
  EXPECT_EQ(kv_.Get("round/3/master_endpoint"), absl::StrCat("10.0.0.2:29511 probe=", ep->probe_port));
  // The probe accepts the members' checks while the round runs.
  EXPECT_TRUE(CheckTcpConnect("127.0.0.1", ep->probe_port, 2.0).ok());
  ra.RoundEnded();
  EXPECT_FALSE(ra.probe_open());
}

TEST_F(RoundAddressTest, WithoutAProbeGroupRankZeroPublishesProbeZero) {
  net_.probe_opens = false;
  RoundAddress ra = Make(/*node_rank=*/0);
  auto ep = ra.Resolve(Round(0), NotSuperseded);
  ASSERT_TRUE(ep.ok()) << ep.status();
  EXPECT_EQ(ep->probe_port, 0);
  EXPECT_FALSE(ra.probe_open());
  EXPECT_EQ(kv_.Get("round/3/master_endpoint"), "10.0.0.2:29511 probe=0");
}

TEST_F(RoundAddressTest, GroupRankZeroFailsWhenNoPortOrTheKvStoreRefuses) {
  net_.free_port = absl::ResourceExhaustedError("no free port");
  EXPECT_TRUE(absl::IsResourceExhausted(Make(0).Resolve(Round(0), NotSuperseded).status()));
  // Not retryable: returned at once.
  RoundAddressHooks h;
  RoundAddressOptions o;
  o.host = "10.0.0.2";
  h.kv_set = [](const std::string&, const std::string&) { return absl::PermissionDeniedError("bad token"); };
  h.pick_port = [] { return 29511; };
  h.open_probe = []() -> absl::StatusOr<std::unique_ptr<ProbeListener>> { return absl::UnavailableError("x"); };
  RoundAddress refused(o, std::move(h), [] { return std::string(); });
  EXPECT_TRUE(absl::IsPermissionDenied(refused.Resolve(Round(0), NotSuperseded).status()));
}

TEST_F(RoundAddressTest, OtherRanksReadTheEndpoint) {
  kv_.kv["round/3/master_endpoint"] = "10.0.0.1:29511 probe=41000";
  auto ep = Make().Resolve(Round(1), NotSuperseded);
  ASSERT_TRUE(ep.ok()) << ep.status();
  EXPECT_EQ(ep->host, "10.0.0.1");
  EXPECT_EQ(ep->port, 29511);
  EXPECT_EQ(ep->probe_port, 41000);
}

TEST_F(RoundAddressTest, OtherRanksTimeOutWithAClearMessage) {
  const auto t0 = std::chrono::steady_clock::now();
  auto ep = Make(/*node_rank=*/1, /*kv_wait_s=*/1.0).Resolve(Round(1), NotSuperseded);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(900));
  EXPECT_TRUE(absl::IsDeadlineExceeded(ep.status())) << ep.status();
  EXPECT_THAT(std::string(ep.status().message()),
              HasSubstr("group rank 0 did not publish round/3/master_endpoint within 1 s (round/3/master_endpoint)"));
}

TEST_F(RoundAddressTest, ANewerEventAbortsTheWait) {
  auto ep = Make().Resolve(Round(1), [] { return true; });
  EXPECT_TRUE(absl::IsAborted(ep.status())) << ep.status();
}

TEST_F(RoundAddressTest, CheckConnectsToTheProbePort) {
  RoundAddress ra = Make();
  EXPECT_EQ(ra.Check(Round(1), RoundEndpoint{"10.0.0.1", 29511, 41000}), "");
  EXPECT_THAT(net_.connects, ::testing::ElementsAre("10.0.0.1:41000 2.5"));

  net_.connect_status = absl::DeadlineExceededError("connect timed out");
  std::string cause = ra.Check(Round(1), RoundEndpoint{"10.0.0.1", 29511, 41000});
  EXPECT_EQ(cause,
            "node rank 1 (node n1, host 10.0.0.2, group rank 1) cannot reach the round's MASTER_ADDR 10.0.0.1:29511, "
            "announced by group rank 0 (node n0): connect timed out. The workers would hang in init_process_group. "
            "Pass `--local-addr ADDR` to the `ballast run` of group rank 0 (node n0) with an address of its host "
            "that every node reaches (e.g. its IP), or make '10.0.0.1' resolve on every node");
}

TEST_F(RoundAddressTest, GroupRankZeroThatCannotReachItselfIsToldToPassLocalAddr) {
  net_.connect_status = absl::NotFoundError("name does not resolve");
  std::string cause = Make(0).Check(Round(0), RoundEndpoint{"10.0.0.2", 29511, 41000});
  EXPECT_THAT(cause, HasSubstr("node rank 0 (node n1, host 10.0.0.2, group rank 0) cannot reach the round's "
                               "MASTER_ADDR 10.0.0.2:29511 (its own announced address): name does not resolve."));
  EXPECT_THAT(cause, HasSubstr("Pass `--local-addr ADDR` to this node's `ballast run`"));
}

// An endpoint from an agent that published no probe: only a name that does
// not resolve fails the check.
TEST_F(RoundAddressTest, WithoutAProbePortOnlyTheNameIsChecked) {
  RoundAddress ra = Make();
  net_.resolve_status = absl::UnavailableError("no route");
  EXPECT_EQ(ra.Check(Round(1), RoundEndpoint{"10.0.0.1", 29511, 0}), "");
  net_.resolve_status = absl::NotFoundError("host2 does not resolve");
  EXPECT_THAT(ra.Check(Round(1), RoundEndpoint{"host2", 29511, 0}),
              HasSubstr("cannot reach the round's MASTER_ADDR host2:29511, announced by group rank 0 (node n0): "
                        "host2 does not resolve."));
  EXPECT_TRUE(net_.connects.empty());
}

TEST(JudgeStore, NamesTheNodesWithNoConnectionOnceTheTimeoutPassed) {
  StoreWatch w{29500, 10.0, std::nullopt, false};
  TcpPortUse use{true, {"10.0.0.1", "10.0.0.1", "10.0.0.3"}};
  EXPECT_EQ(JudgeStore(&w, TcpPortUse{}, 100.0, Members(), "10.0.0.1"), "");  // not listening yet
  EXPECT_EQ(JudgeStore(&w, use, 101.0, Members(), "10.0.0.1"), "");
  EXPECT_EQ(JudgeStore(&w, use, 110.5, Members(), "10.0.0.1"), "");  // 9.5 s of 10
  std::string cause = JudgeStore(&w, use, 111.5, Members(), "10.0.0.1");
  EXPECT_THAT(cause, HasSubstr("the process group did not form: no rank of group rank 1 (node n1, host 10.0.0.2, "
                               "ranks 2-3) reached the torch store at MASTER_ADDR 10.0.0.1:29500 within 10 s"));
  EXPECT_TRUE(w.done);
  EXPECT_EQ(JudgeStore(&w, use, 200.0, Members(), "10.0.0.1"), "");  // judged once
}

TEST(JudgeStore, EveryNodeConnectedOrStoreGoneIsNoFailure) {
  StoreWatch ok{29500, 1.0, std::nullopt, false};
  TcpPortUse all{true, {"10.0.0.1", "10.0.0.2", "10.0.0.3"}};
  EXPECT_EQ(JudgeStore(&ok, all, 0.0, Members(), "10.0.0.1"), "");
  EXPECT_EQ(JudgeStore(&ok, all, 5.0, Members(), "10.0.0.1"), "");
  EXPECT_TRUE(ok.done);
  StoreWatch gone{29500, 1.0, std::nullopt, false};
  EXPECT_EQ(JudgeStore(&gone, TcpPortUse{true, {}}, 0.0, Members(), "10.0.0.1"), "");
  EXPECT_EQ(JudgeStore(&gone, TcpPortUse{}, 5.0, Members(), "10.0.0.1"), "");  // rank 0's worker died
  EXPECT_TRUE(gone.done);
}

TEST_F(RoundAddressTest, TheNodeOfGlobalRankZeroWatchesTheStoreOnceASecond) {
  RoundAddress ra = Make(0);
  const v1::StartRound start = Round(0);
  ra.WorkersStarted(start, 29511);
  EXPECT_EQ(ra.store_watch().port, 29511);
  EXPECT_EQ(ra.store_watch().timeout_s, 2.0);
  net_.port_use = TcpPortUse{true, {"10.0.0.1", "10.0.0.3"}};  // none from 10.0.0.2
  EXPECT_FALSE(ra.WatchStore(10 * kS, start).has_value());         // listening since 10 s
  EXPECT_FALSE(ra.WatchStore(10 * kS + kS / 2, start).has_value());  // within the second: not looked at
  EXPECT_EQ(net_.port_use_calls, 1);
  EXPECT_FALSE(ra.WatchStore(11 * kS, start).has_value());
  std::optional<v1::FailureReport> report = ra.WatchStore(12 * kS + kS / 2, start);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->node_id(), "n1");
  EXPECT_EQ(report->round(), 3);
  EXPECT_EQ(report->global_rank(), 0);
  EXPECT_EQ(report->local_rank(), 0);
  EXPECT_THAT(report->cause(), HasSubstr("the process group did not form: no rank of group rank 1 (node n1, host "
                                         "10.0.0.2, ranks 2-3) reached the torch store at MASTER_ADDR "
                                         "10.0.0.2:29511 within 2 s"));
  health::FailureEvidence evidence;
  evidence.store_timeout = true;
  const health::FailureClass fc = health::Classify(evidence);
  EXPECT_EQ(report->kind(), health::FailureKindName(fc.kind));
  EXPECT_EQ(report->max_retries(), fc.max_retries);
  EXPECT_TRUE(ra.store_watch().done);
  EXPECT_FALSE(ra.WatchStore(20 * kS, start).has_value());  // judged once
  ra.RoundEnded();
  EXPECT_EQ(ra.store_watch().port, 0);
}

TEST_F(RoundAddressTest, OnlyTheNodeOfGlobalRankZeroInAWorldOfSeveralWatches) {
  RoundAddress member = Make();
  member.WorkersStarted(Round(1), 29511);
  EXPECT_EQ(member.store_watch().port, 0);
  EXPECT_FALSE(member.WatchStore(10 * kS, Round(1)).has_value());
  v1::StartRound alone = Round(0);
  alone.set_world_size(1);
  RoundAddress single = Make(0);
  single.WorkersStarted(alone, 29511);
  EXPECT_EQ(single.store_watch().port, 0);
  EXPECT_EQ(net_.port_use_calls, 0);
}

TEST_F(RoundAddressTest, AStoreWatchThatCannotReadTheSocketsSaysNothing) {
  net_.port_use = absl::PermissionDeniedError("/proc/net/tcp");
  RoundAddress ra = Make(0);
  ra.WorkersStarted(Round(0), 29511);
  EXPECT_FALSE(ra.WatchStore(10 * kS, Round(0)).has_value());
  EXPECT_TRUE(ra.store_watch().done);
  EXPECT_FALSE(ra.WatchStore(20 * kS, Round(0)).has_value());
  EXPECT_EQ(net_.port_use_calls, 1);
}

}  // namespace
}  // namespace ballast::agent
