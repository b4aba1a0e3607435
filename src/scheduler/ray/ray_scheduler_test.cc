// RayScheduler against a stand-in bridge (a short Python script speaking the
// bridge's protocol on fd 3): the real bridge and a real Ray cluster are
// tests/python/test_ray.py's.
#include "scheduler/ray/ray_scheduler.h"

#include <unistd.h>

#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace ballast::scheduler::ray {
namespace {

// Echoes the protocol: ready; a launch starts on "ray:n<rank>@127.0.0.1" and,
// for node rank 1, exits with code 3 (rank 2: lost); stop_all answers stopped.
constexpr char kFakeBridge[] = R"PY(
import json, os, socket, sys
s = socket.socket(fileno=3)
f = s.makefile("rwb", buffering=0)
def send(**e): f.write((json.dumps(e) + "\n").encode())
if os.environ.get("FAKE_FAIL"):
    send(ev="error", message="cannot connect to a Ray cluster at auto: no cluster")
    sys.exit(1)
send(ev="ready", nodes=3, address="auto", ip="10.0.0.7")
for line in f:
    op = json.loads(line)
    if op["op"] == "launch":
        host = "ray:n%d@127.0.0.1" % op["node_rank"]
        assert op["env"]["BALLAST_NODE_ID"] == op["name"], op
        assert op["argv"][0] == "ballast" and op["env"]["X"] == "1", op
        send(ev="started", name=op["name"], host=host)
        if op["node_rank"] == 1:
            send(ev="exited", name=op["name"], host=host, code=3, signal=0)
        if op["node_rank"] == 2:
            send(ev="lost", name=op["name"], host=host, reason="Ray node " + host + " died")
    elif op["op"] == "stop_all":
        send(ev="stopped")
    elif op["op"] == "master_start":
        assert op["argv"][:2] == ["ballast", "master"] and op["journal"] == "/j" and op["node"] == "head", op
        send(ev="master_started", host="ray:h@10.0.0.1", ip="10.0.0.1", port=4000, pid=7, incarnation=1)
    elif op["op"] == "master_kill":
        send(ev="master_died", reason="ActorDiedError: killed")
        send(ev="master_started", host="ray:h@10.0.0.1", ip="10.0.0.1", port=4000, pid=8, incarnation=2)
    elif op["op"] == "master_stop":
        send(ev="master_stopped", code=0, signal=0)
)PY";

RaySchedulerOptions Options(bool fail = false) {
  RaySchedulerOptions o;
  o.bridge_argv = {"/usr/bin/python3", "-c", kFakeBridge};
  if (fail) o.bridge_env["FAKE_FAIL"] = "1";
  o.connect_timeout_s = 30;
  o.command_for = [](const NodeRequest& r) {
    return LocalCommand{{"ballast", "run", "--node-rank", std::to_string(r.node_rank)}, {{"X", "1"}}};
  };
  return o;
}

std::vector<NodeEvent> PollFor(RayScheduler& s, size_t n) {
  std::vector<NodeEvent> all;
  for (int i = 0; i < 200 && all.size() < n; ++i) {
    for (NodeEvent& e : s.Poll()) all.push_back(std::move(e));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return all;
}

TEST(RayScheduler, ReportsWhatTheBridgeSaw) {
  auto s = RayScheduler::Start(Options());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->cluster(), "Ray cluster at auto: 3 alive node(s)");
  EXPECT_EQ((*s)->driver_ip(), "10.0.0.7");
  for (int rank : {0, 1, 2}) {
    ASSERT_TRUE((*s)->LaunchNode(NodeRequest{"node-" + std::to_string(rank), rank, 1, {}}).ok());
  }
  EXPECT_TRUE(absl::IsAlreadyExists((*s)->LaunchNode(NodeRequest{"node-0", 0, 1, {}})));
  std::vector<NodeEvent> ev = PollFor(**s, 5);
  ASSERT_EQ(ev.size(), 5u);
  EXPECT_EQ(ev[0].kind, NodeEvent::Kind::kStarted);
  EXPECT_EQ(ev[0].host, "ray:n0@127.0.0.1");
  EXPECT_EQ(ev[2].kind, NodeEvent::Kind::kExited);
  EXPECT_EQ(ev[2].name, "node-1");
  EXPECT_EQ(ev[2].status.exit_code, 3);
  EXPECT_EQ(ev[4].kind, NodeEvent::Kind::kLost);
  EXPECT_EQ(ev[4].reason, "Ray node ray:n2@127.0.0.1 died");
  EXPECT_EQ((*s)->RunningNodes(), std::vector<std::string>{"node-0"});
  // A released node is not reported again.
  ASSERT_TRUE((*s)->ReleaseNode("node-0", "replaced", 1).ok());
  EXPECT_TRUE(absl::IsNotFound((*s)->ReleaseNode("node-0", "again", 1)));
  EXPECT_TRUE((*s)->RunningNodes().empty());
  (*s)->StopAll(1);
}

TEST(RayScheduler, TheMasterActorsEventsAreKeptApartFromTheNodes) {
  auto s = RayScheduler::Start(Options());
  ASSERT_TRUE(s.ok()) << s.status();
  MasterActorSpec spec;
  spec.argv = {"ballast", "master"};
  spec.journal = "/j";
  ASSERT_TRUE((*s)->StartMaster(spec).ok());
  std::vector<MasterActorEvent> ev;
  for (int i = 0; i < 100 && ev.empty(); ++i) ev = (*s)->MasterEvents(0.1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, MasterActorEvent::Kind::kStarted);
  EXPECT_EQ(ev[0].ip, "10.0.0.1");
  EXPECT_EQ(ev[0].port, 4000);
  EXPECT_EQ(ev[0].incarnation, 1);
  ASSERT_TRUE((*s)->KillMaster().ok());
  ev.clear();
  for (int i = 0; i < 100 && ev.size() < 2; ++i) {
    for (MasterActorEvent& e : (*s)->MasterEvents(0.1)) ev.push_back(std::move(e));
  }
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].kind, MasterActorEvent::Kind::kDied);
  EXPECT_EQ(ev[0].reason, "ActorDiedError: killed");
  EXPECT_EQ(ev[1].kind, MasterActorEvent::Kind::kStarted);
  EXPECT_EQ(ev[1].pid, 8);
  EXPECT_EQ(ev[1].incarnation, 2);
  EXPECT_TRUE((*s)->Poll().empty());  // none of it is a node's
  ASSERT_TRUE((*s)->StopMaster(1).ok());
  ev.clear();
  for (int i = 0; i < 100 && ev.empty(); ++i) ev = (*s)->MasterEvents(0.1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, MasterActorEvent::Kind::kStopped);
  EXPECT_TRUE(ev[0].status.ok());
}

TEST(RayScheduler, TheBridgesErrorIsTheStartsError) {
  auto s = RayScheduler::Start(Options(/*fail=*/true));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "cannot connect to a Ray cluster at auto: no cluster");
}

TEST(RayScheduler, ABridgeThatCannotStartSaysSo) {
  RaySchedulerOptions o = Options();
  o.bridge_argv = {"/usr/bin/python3", "-c", "import sys; sys.exit('no ray here')"};
  auto s = RayScheduler::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.status().message()).find("ended before it connected"), std::string::npos) << s.status();
}

TEST(RayScheduler, EveryNodeIsLostWhenTheBridgeEnds) {
  RaySchedulerOptions o = Options();
  o.bridge_argv = {"/usr/bin/python3", "-c",
                   "import json, socket, sys\n"
                   "s = socket.socket(fileno=3)\n"
                   "s.sendall(b'{\"ev\": \"ready\", \"nodes\": 1, \"address\": \"a\", \"ip\": \"127.0.0.1\"}\\n')\n"
                   "f = s.makefile('rb')\n"
                   "f.readline()\n"
                   "sys.exit(1)\n"};
  auto s = RayScheduler::Start(o);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->LaunchNode(NodeRequest{"node-0", 0, 1, {}}).ok());
  std::vector<NodeEvent> ev = PollFor(**s, 1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, NodeEvent::Kind::kLost);
  EXPECT_NE(ev[0].reason.find("the Ray bridge ended"), std::string::npos);
}

}  // namespace
}  // namespace ballast::scheduler::ray
