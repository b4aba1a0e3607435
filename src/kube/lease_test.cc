// LeaderLease against a fake API server that keeps objects with real
// resourceVersion semantics (fake_object_store.h): one holder at a time,
// release hands over at once, a silent holder's Lease is taken after its
// duration, and a holder that loses it (taken, or cannot renew) knows.
#include "kube/lease.h"

#include <unistd.h>

#include <chrono>

#include "gtest/gtest.h"
#include "kube/fake_object_store.h"

namespace ballast::kube {
namespace {

const char kPath[] = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/job-master";

LeaseOptions Options(const std::string& identity) {
  LeaseOptions o;
  o.ns = "ns";
  o.name = "job-master";
  o.identity = identity;
  o.lease_duration_s = 1.0;
  o.renew_deadline_s = 0.6;
  o.retry_s = 0.1;
  o.annotations["ballast.dev/master-endpoint"] = identity + ":29400";
  o.what = "the test lease";
  return o;
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(LeaderLease, OneHolderAtATimeAndReleaseHandsOverAtOnce) {
  testing::FakeObjectStore api;
  KubeClient client(api.Config());
  LeaderLease a(&client, Options("pod-a"));
  ASSERT_TRUE(a.Acquire(nullptr, 5).ok());
  EXPECT_TRUE(a.held());
  EXPECT_EQ(Str(api.Object(kPath), {"spec", "holderIdentity"}), "pod-a");
  EXPECT_EQ(*LeaseAnnotation(&client, "ns", "job-master", "ballast.dev/master-endpoint"), "pod-a:29400");

  // b waits while a renews: well past the lease duration.
  LeaderLease b(&client, Options("pod-b"));
  std::string told;
  absl::Status s = b.Acquire(nullptr, 2.0, [&](const std::string& holder) { told = holder; });
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_FALSE(b.held());
  EXPECT_EQ(told, "pod-a");
  EXPECT_TRUE(a.held());

  a.Release();
  EXPECT_FALSE(a.held());
  EXPECT_EQ(*LeaseAnnotation(&client, "ns", "job-master", "ballast.dev/master-endpoint"), "")
      << "a released Lease names no master";
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(b.Acquire(nullptr, 5).ok());
  EXPECT_LT(Since(t0), 0.5) << "a released Lease is taken at once";
  const Json lease = api.Object(kPath);
  EXPECT_EQ(Str(lease, {"spec", "holderIdentity"}), "pod-b");
  EXPECT_EQ(Int(lease, {"spec", "leaseTransitions"}), 1);
  EXPECT_EQ(*LeaseAnnotation(&client, "ns", "job-master", "ballast.dev/master-endpoint"), "pod-b:29400");
}

TEST(LeaderLease, ASilentHoldersLeaseIsTakenAfterItsDuration) {
  testing::FakeObjectStore api;
  KubeClient client(api.Config());
  {
    LeaderLease a(&client, Options("pod-a"));
    ASSERT_TRUE(a.Acquire(nullptr, 5).ok());
  }  // gone without releasing (its pod's node died)
  LeaderLease b(&client, Options("pod-b"));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(b.Acquire(nullptr, 5).ok());
  EXPECT_GE(Since(t0), 0.9) << "not before the lease duration (1 s) as b saw it";
  EXPECT_LT(Since(t0), 2.5);
}

TEST(LeaderLease, AHolderWhoseLeaseWasTakenStopsHoldingIt) {
  testing::FakeObjectStore api;
  KubeClient client(api.Config());
  LeaderLease a(&client, Options("pod-a"));
  ASSERT_TRUE(a.Acquire(nullptr, 5).ok());
  Json lease = api.Object(kPath);
  lease["spec"]["holderIdentity"] = "pod-b";
  api.Put(kPath, lease);
  for (int i = 0; i < 50 && a.held(); ++i) usleep(20000);
  EXPECT_FALSE(a.held());
  EXPECT_NE(a.lost_reason(), "");
  EXPECT_EQ(Str(api.Object(kPath), {"spec", "holderIdentity"}), "pod-b") << "the loser never writes it back";
}

TEST(LeaderLease, AHolderThatCannotRenewStepsDownBeforeOthersMayTakeIt) {
  testing::FakeObjectStore api;
  KubeClient client(api.Config());
  LeaderLease a(&client, Options("pod-a"));
  ASSERT_TRUE(a.Acquire(nullptr, 5).ok());
  api.unavailable = true;
  const auto t0 = std::chrono::steady_clock::now();
  while (a.held() && Since(t0) < 5) usleep(20000);
  EXPECT_FALSE(a.held());
  // Stepped down after the renew deadline (0.6 s), before the lease
  // duration (1 s) in which no one else may take it.
  EXPECT_LT(Since(t0), 1.0);
  EXPECT_NE(a.lost_reason().find("not renewed"), std::string::npos) << a.lost_reason();
}

TEST(LeaderLease, AcquireStopsOnASignal) {
  testing::FakeObjectStore api;
  KubeClient client(api.Config());
  LeaderLease a(&client, Options("pod-a"));
  ASSERT_TRUE(a.Acquire(nullptr, 5).ok());
  LeaderLease b(&client, Options("pod-b"));
  std::atomic<int> signal{15};
  EXPECT_TRUE(absl::IsCancelled(b.Acquire(&signal, -1)));
}

}  // namespace
}  // namespace ballast::kube
