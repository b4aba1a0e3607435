// The job master's state outside its pod, against a fake API server with
// real resourceVersion semantics: a new master claims what the last one
// stored and resumes from it (Journal::Seed), the last one is fenced from
// then on, and the mirror keeps the store current.
#include "scheduler/kubernetes/master_state.h"

#include <unistd.h>

#include <filesystem>

#include "gtest/gtest.h"
#include "kube/fake_object_store.h"
#include "master/journal.h"

namespace ballast::scheduler::kubernetes {
namespace {

const char kPath[] = "/api/v1/namespaces/ns/configmaps/job-master-state";

ElasticJobSpec Job() {
  ElasticJobSpec j;
  j.ns = "ns";
  j.name = "job";
  j.uid = "uid-1";
  return j;
}

v1::MasterSnapshot State(int64_t round, uint64_t seq) {
  v1::MasterSnapshot s;
  s.set_last_seq(seq);
  s.mutable_job()->set_job_id("job");
  s.mutable_round()->set_round(round);
  s.mutable_round()->set_state("running");
  s.mutable_round()->set_restart_count(1);
  v1::JournalMember* m = s.mutable_round()->add_members();
  m->set_node_id("job-worker-0-1");
  m->set_local_world_size(2);
  return s;
}

TEST(MasterStateStore, ANewMasterResumesFromTheLastOnesStateWhichIsFencedFromThen) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  MasterStateStore first(&client, Job(), "job-master-1");
  auto none = first.Claim();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value()) << "a new job has no state";
  ASSERT_TRUE(first.Save(State(3, 40)).ok());
  const kube::Json cm = api.Object(kPath);
  EXPECT_EQ(kube::Str(cm, {"data", "holder"}), "job-master-1");
  EXPECT_EQ(kube::Str(cm, {"data", "seq"}), "40");
  EXPECT_EQ(cm["metadata"]["ownerReferences"][0]["uid"], "uid-1") << "deleted with its ElasticJob";

  MasterStateStore second(&client, Job(), "job-master-2");
  auto claimed = second.Claim();
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  ASSERT_TRUE(claimed->has_value());
  EXPECT_EQ((*claimed)->round().round(), 3);
  EXPECT_EQ((*claimed)->round().members(0).node_id(), "job-worker-0-1");
  EXPECT_EQ(second.claimed_from(), "job-master-1");
  EXPECT_EQ(kube::Str(api.Object(kPath), {"data", "holder"}), "job-master-2");

  // The first master, still running somewhere, is refused from now on.
  absl::Status s = first.Save(State(4, 41));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("job-master-2"), std::string::npos) << s;
  EXPECT_EQ(kube::Str(api.Object(kPath), {"data", "seq"}), "40") << "the claim wrote the state back as it was";
  ASSERT_TRUE(second.Save(State(5, 50)).ok());
  EXPECT_EQ(kube::Str(api.Object(kPath), {"data", "seq"}), "50");
}

TEST(MasterStateStore, TheStateOfAnEarlierJobOfTheSameNameIsNotResumed) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  MasterStateStore old_job(&client, Job(), "job-master-4");
  ASSERT_TRUE(old_job.Claim().ok());
  ASSERT_TRUE(old_job.Save(State(9, 99)).ok());
  // Deleted and created again: a new uid; the garbage collector has not run yet.
  ElasticJobSpec again = Job();
  again.uid = "uid-2";
  MasterStateStore fresh(&client, again, "job-master-1");
  auto claimed = fresh.Claim();
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_FALSE(claimed->has_value());
  EXPECT_EQ(kube::Str(api.Object(kPath), {"data", "job-uid"}), "uid-2");
}

TEST(MasterStateStore, TheClaimedStateSeedsAnEmptyJournalButNeverOverwritesOne) {
  const std::string dir = std::filesystem::temp_directory_path() / ("ballast-seed-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  auto seeded = master::Journal::Seed(dir, State(7, 90));
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  EXPECT_TRUE(*seeded);
  {
    auto j = master::Journal::Open(master::Journal::Options{dir});
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_TRUE((*j)->recovered());
    EXPECT_EQ((*j)->state().round().round(), 7);
    EXPECT_EQ((*j)->last_seq(), 90u);
  }
  // This pod's own journal (a master process restarted in its pod) is newer.
  auto again = master::Journal::Seed(dir, State(2, 10));
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);
  auto j = master::Journal::Open(master::Journal::Options{dir});
  ASSERT_TRUE(j.ok());
  EXPECT_EQ((*j)->state().round().round(), 7);
  std::filesystem::remove_all(dir);
}

TEST(MasterStateMirror, SavesAtOnceOnANewRoundAtMostEveryIntervalElseAndStopsWhenFenced) {
  kube::testing::FakeObjectStore api;
  kube::KubeClient client(api.Config());
  MasterStateStore store(&client, Job(), "job-master-1");
  ASSERT_TRUE(store.Claim().ok());
  std::mutex mu;
  v1::MasterSnapshot state = State(1, 1);
  auto state_after = [&](uint64_t seq) -> std::optional<v1::MasterSnapshot> {
    std::lock_guard<std::mutex> lock(mu);
    if (state.last_seq() <= seq) return std::nullopt;
    return state;
  };
  MasterStateMirror mirror(&store, state_after, /*interval_s=*/30);
  mirror.NoteRound(1);
  mirror.Start();
  auto seq_stored = [&] { return kube::Str(api.Object(kPath), {"data", "seq"}); };
  for (int i = 0; i < 50 && seq_stored() != "1"; ++i) usleep(20000);
  EXPECT_EQ(seq_stored(), "1");
  {
    std::lock_guard<std::mutex> lock(mu);
    state = State(1, 2);  // same round: waits for the interval (30 s)
  }
  usleep(400000);
  EXPECT_EQ(seq_stored(), "1");
  {
    std::lock_guard<std::mutex> lock(mu);
    state = State(2, 3);  // a new round: at once
  }
  mirror.NoteRound(2);
  for (int i = 0; i < 50 && seq_stored() != "3"; ++i) usleep(20000);
  EXPECT_EQ(seq_stored(), "3");
  // Another master claims the store: the next save is refused, the mirror stops.
  MasterStateStore other(&client, Job(), "job-master-2");
  ASSERT_TRUE(other.Claim().ok());
  {
    std::lock_guard<std::mutex> lock(mu);
    state = State(3, 4);
  }
  mirror.NoteRound(3);
  for (int i = 0; i < 50 && !mirror.fenced(); ++i) usleep(20000);
  EXPECT_TRUE(mirror.fenced());
  EXPECT_NE(mirror.fenced_why().find("job-master-2"), std::string::npos);
  const int writes = api.writes.load();
  mirror.Stop(/*final_save=*/true);
  EXPECT_EQ(api.writes.load(), writes) << "a fenced mirror writes nothing more";
}

}  // namespace
}  // namespace ballast::scheduler::kubernetes
