// Suspension fences the job's master, whichever the master sees first: the
// suspension, or the worker pods the operator deletes for it vanishing (and
// their agents leaving). Against a fake API server with real resourceVersion
// semantics (kube/fake_object_store.h) and the real NodeManager over a
// scripted scheduler; the real API server is exercised by
// tests/kubernetes/test_elasticjob.py (the suspend scenario).
#include "scheduler/kubernetes/job_fence.h"

#include <set>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kube/fake_object_store.h"

namespace ballast::scheduler::kubernetes {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const char kJobPath[] = "/apis/ballast.dev/v1alpha1/namespaces/ns/elasticjobs/job";

ElasticJobSpec Spec() {
  ElasticJobSpec j;
  j.ns = "ns";
  j.name = "job";
  j.uid = "uid-1";
  j.min_nodes = j.max_nodes = 2;
  return j;
}

kube::Json JobObject(bool suspend, const std::string& uid = "uid-1", const std::string& phase = "Running") {
  return kube::Json{{"apiVersion", "ballast.dev/v1alpha1"},
                    {"kind", "ElasticJob"},
                    {"metadata", {{"name", "job"}, {"namespace", "ns"}, {"uid", uid}}},
                    {"spec", {{"nodes", "2"}, {"nprocPerNode", 1}, {"suspend", suspend}}},
                    {"status", {{"phase", phase}}}};
}

// The pods of a job as its scheduler reports them; the test scripts what
// happens to them.
class ScriptedScheduler : public SchedulerInterface {
 public:
  std::string Kind() const override { return "scripted"; }
  absl::Status LaunchNode(const NodeRequest& r) override {
    launched.push_back(r.name);
    return absl::OkStatus();
  }
  absl::Status ReleaseNode(const std::string& name, const std::string&, double) override {
    released.push_back(name);
    return absl::OkStatus();
  }
  std::vector<NodeEvent> Poll() override { return std::exchange(events, {}); }
  std::vector<std::string> RunningNodes() const override { return {}; }
  void StopAll(double) override {}

  void Push(NodeEvent::Kind kind, const std::string& name, const std::string& reason = "") {
    NodeEvent e;
    e.kind = kind;
    e.name = name;
    e.reason = reason;
    e.host = "host-" + name;
    events.push_back(e);
  }
  std::vector<std::string> launched, released;
  std::vector<NodeEvent> events;
};

// The master's side of it: the NodeManager over the FencedScheduler, as
// RunKubernetesJob wires them.
struct Master {
  double clock = 0;  // NodeManagerOptions::now
  explicit Master(kube::KubeClient* client) : fence(client, Spec()) {
    fenced = std::make_unique<FencedScheduler>(&pods, &fence, ForwardTo(&slot), /*retry_s=*/0);
    NodeManagerOptions o;
    o.initial_nodes = 2;
    o.max_replacements = 5;
    o.name = [](int rank, int inc) { return Spec().WorkerPodName(rank, inc); };
    o.on_event = [this](const std::string& reason, const std::string&, bool) { events.push_back(reason); };
    o.now = [this] { return clock; };
    nodes = std::make_unique<NodeManager>(fenced.get(), o);
    slot.store(nodes.get());
    EXPECT_TRUE(nodes->Start().ok());
    pods.Push(NodeEvent::Kind::kStarted, "job-worker-0-1");
    pods.Push(NodeEvent::Kind::kStarted, "job-worker-1-1");
    nodes->Poll(false);
    EXPECT_THAT(pods.launched, ElementsAre("job-worker-0-1", "job-worker-1-1"));
  }
  // The operator deleted both worker pods (their informer events), and their
  // agents left the master.
  void PodsDeleted() {
    pods.Push(NodeEvent::Kind::kLost, "job-worker-0-1", "its pod is being deleted");
    pods.Push(NodeEvent::Kind::kLost, "job-worker-1-1", "its pod is being deleted");
  }
  void AgentsLeft() {
    fenced->OnNodeLost("job-worker-0-1", "its agent disconnected");
    fenced->OnNodeLost("job-worker-1-1", "its agent disconnected");
  }

  ScriptedScheduler pods;
  JobFence fence;
  std::atomic<NodeManager*> slot{nullptr};
  std::unique_ptr<FencedScheduler> fenced;
  std::unique_ptr<NodeManager> nodes;
  std::vector<std::string> events;
};

TEST(JobFence, ConfirmReadsTheJobAndASuspensionFencesForGood) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  JobFence fence(&client, Spec());
  auto r = fence.Confirm();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(*r);
  EXPECT_FALSE(fence.fenced());
  EXPECT_EQ(fence.why(), "");

  api.Put(kJobPath, JobObject(true));
  r = fence.Confirm();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(*r);
  EXPECT_TRUE(fence.fenced());
  EXPECT_THAT(fence.why(), HasSubstr("ElasticJob ns/job is suspended (spec.suspend)"));

  // Resumed: this master stays fenced (the operator starts a new one).
  api.Put(kJobPath, JobObject(false));
  r = fence.Confirm();
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r);
}

TEST(JobFence, ADeletedOrReplacedJobFencesAndAnUnreadableOneIsNotKnown) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  {
    api.Put(kJobPath, JobObject(false));
    JobFence fence(&client, Spec());
    api.unavailable = true;
    auto r = fence.Confirm();
    EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
    EXPECT_FALSE(fence.fenced()) << "not known is not suspended";
    api.unavailable = false;
  }
  {
    api.Put(kJobPath, JobObject(false, "uid-2"));
    JobFence fence(&client, Spec());
    auto r = fence.Confirm();
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(*r);
    EXPECT_THAT(fence.why(), HasSubstr("was deleted and created again (uid uid-2"));
  }
  {
    kube::testing::FakeObjectStore empty;
    kube::KubeClient c2(empty.Config());
    JobFence fence(&c2, Spec());
    auto r = fence.Confirm();
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(*r);
    EXPECT_THAT(fence.why(), HasSubstr("ElasticJob ns/job was deleted"));
  }
  {
    JobFence fence(&client, Spec());
    fence.Observe(JobObject(true));  // what the watch delivers
    EXPECT_TRUE(fence.fenced());
  }
}

TEST(JobFence, TheMasterNeverWritesItsStatusOverASuspension) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false, "uid-1", "Pending"));
  JobFence fence(&client, Spec());
  kube::Json body = {{"apiVersion", "ballast.dev/v1alpha1"},
                     {"kind", "ElasticJob"},
                     {"metadata", {{"name", "job"}, {"namespace", "ns"}}},
                     {"status", {{"phase", "Running"}, {"round", 1}}}};
  ASSERT_TRUE(fence.ApplyStatus(body, "ballast-master").ok());
  EXPECT_EQ(api.Object(kJobPath)["status"]["phase"], "Running");
  EXPECT_EQ(api.Object(kJobPath)["status"]["round"], 1);

  // The user suspends the job and the operator marks it Suspended between the
  // master's read and its write: the write is refused (Conflict), the read
  // made again sees the suspension, and nothing is written.
  int raced = 0;
  api.before_patch = [&](const std::string&) {
    if (raced++ == 0) api.Put(kJobPath, JobObject(true, "uid-1", "Suspended"));
  };
  body["status"]["round"] = 2;
  absl::Status s = fence.ApplyStatus(body, "ballast-master");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(raced, 1) << "one write tried, refused";
  EXPECT_EQ(api.Object(kJobPath)["status"]["phase"], "Suspended");
  EXPECT_TRUE(fence.fenced());
  // And none from now on (not even tried).
  s = fence.ApplyStatus(body, "ballast-master");
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_EQ(raced, 1);
}

TEST(FencedScheduler, PodsTheSuspensionDeletedAreNotReplacedWhenThePodWatchIsFirst) {
  // The race the real cluster showed: the operator marks the job suspended and
  // deletes its pods; the master's pod watch sees them go before its job
  // watch sees the suspension (not started here: it never comes).
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  Master m(&client);
  api.Put(kJobPath, JobObject(true, "uid-1", "Suspended"));
  m.PodsDeleted();
  m.AgentsLeft();
  m.nodes->Poll(false);
  EXPECT_THAT(m.pods.launched, ElementsAre("job-worker-0-1", "job-worker-1-1")) << "nothing replaced";
  EXPECT_THAT(m.pods.released, IsEmpty());
  EXPECT_THAT(m.events, IsEmpty()) << "no NodeReplaced";
  EXPECT_EQ(m.nodes->replacements(), 0);
  EXPECT_TRUE(m.fence.fenced()) << "the master's loop stops";
  // Nor later.
  m.nodes->Poll(false);
  EXPECT_EQ(m.pods.launched.size(), 2u);
}

TEST(FencedScheduler, AgentsLeavingBeforeTheSuspensionIsSeenReplaceNothing) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  Master m(&client);
  api.Put(kJobPath, JobObject(true, "uid-1", "Suspended"));
  m.AgentsLeft();  // only the master's notices: the pod watch is slower still
  m.nodes->Poll(false);
  EXPECT_EQ(m.pods.launched.size(), 2u);
  EXPECT_THAT(m.pods.released, IsEmpty()) << "not even released: the operator deletes them";
  EXPECT_THAT(m.events, IsEmpty());
  EXPECT_TRUE(m.fence.fenced());
}

TEST(FencedScheduler, WhenTheJobWatchIsFirstNothingIsReplacedEither) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  Master m(&client);
  m.fence.Observe(JobObject(true));  // the job watch's event
  api.unavailable = true;             // no read needed any more
  m.PodsDeleted();
  m.AgentsLeft();
  m.nodes->Poll(false);
  EXPECT_EQ(m.pods.launched.size(), 2u);
  EXPECT_THAT(m.events, IsEmpty());
}

TEST(FencedScheduler, ALostPodOfARunningJobIsReplacedAsBefore) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  Master m(&client);
  m.pods.Push(NodeEvent::Kind::kLost, "job-worker-1-1", "its pod was deleted");
  m.nodes->Poll(false);
  EXPECT_THAT(m.pods.launched, ElementsAre("job-worker-0-1", "job-worker-1-1", "job-worker-1-2"));
  EXPECT_THAT(m.events, ElementsAre("NodeReplaced"));
  m.fenced->OnNodeExcluded("job-worker-0-1", "failed the pre-flight check");
  m.nodes->Poll(false);
  // The excluded pod's agent exits by itself (its replacement starts then);
  // its pod is deleted, and replaced, only if it still runs excluded_exit_s later.
  EXPECT_THAT(m.pods.launched, ElementsAre("job-worker-0-1", "job-worker-1-1", "job-worker-1-2"));
  EXPECT_THAT(m.pods.released, ElementsAre("job-worker-1-1"));
  m.clock += 10.5;
  m.nodes->Poll(false);
  EXPECT_THAT(m.pods.released, ElementsAre("job-worker-1-1", "job-worker-0-1"));
  EXPECT_THAT(m.pods.launched, ElementsAre("job-worker-0-1", "job-worker-1-1", "job-worker-1-2", "job-worker-0-2"));
  EXPECT_THAT(m.events, ElementsAre("NodeReplaced", "NodeExcluded", "NodeReplaced"));
  EXPECT_FALSE(m.fence.fenced());
  EXPECT_EQ(m.fenced->held(), 0u);
}

TEST(FencedScheduler, WhileTheJobCannotBeReadReplacementsWaitAndOnlyStartsPass) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  Master m(&client);
  api.unavailable = true;
  m.pods.Push(NodeEvent::Kind::kLost, "job-worker-1-1", "its pod was deleted");
  m.fenced->OnNodeLost("job-worker-0-1", "its agent stopped sending heartbeats");
  m.nodes->Poll(false);
  EXPECT_EQ(m.pods.launched.size(), 2u) << "held";
  EXPECT_EQ(m.fenced->held(), 2u);
  EXPECT_THAT(m.events, IsEmpty());
  // Still unreadable: held; then readable and not suspended: replaced.
  m.nodes->Poll(false);
  EXPECT_EQ(m.pods.launched.size(), 2u);
  api.unavailable = false;
  m.nodes->Poll(false);
  // (The master's notice first: NodeManager takes notices before events.)
  EXPECT_THAT(m.pods.launched, ElementsAre("job-worker-0-1", "job-worker-1-1", "job-worker-0-2", "job-worker-1-2"));
  EXPECT_EQ(m.fenced->held(), 0u);
  EXPECT_THAT(m.events, ElementsAre("NodeReplaced", "NodeReplaced"));
}

TEST(FencedScheduler, SuspendedWhileUnreadableNothingIsReplacedOnceReadable) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  api.Put(kJobPath, JobObject(false));
  Master m(&client);
  api.unavailable = true;
  m.PodsDeleted();
  m.nodes->Poll(false);
  api.unavailable = false;
  api.Put(kJobPath, JobObject(true, "uid-1", "Suspended"));
  m.nodes->Poll(false);
  EXPECT_EQ(m.pods.launched.size(), 2u);
  EXPECT_THAT(m.events, IsEmpty());
  EXPECT_TRUE(m.fence.fenced());
}

}  // namespace
}  // namespace ballast::scheduler::kubernetes
