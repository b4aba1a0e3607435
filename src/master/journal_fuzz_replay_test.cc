// Replays deterministic mutations of a real job's journal through the fuzz
// entry point (journal_fuzz.cc) and through Journal::Open + a JobMaster that
// resumes from whatever survived. Passing means: no crash, the journal opens
// (a damaged tail is cut, never an error), and the master resumes the good
// prefix. Run it under ASan for the full effect.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "common/fuzz_seed.h"
#include "gtest/gtest.h"
#include "master/job_master.h"
#include "master/journal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace ballast::master {
namespace {

// The job both the recording and the resuming master run.
JobMasterOptions FuzzJob(FakeClock* clock, Journal* journal) {
  JobMasterOptions o;
  o.job_id = "fuzz";
  o.min_nodes = 1;
  o.max_nodes = 2;
  o.clock = clock;
  o.journal = journal;
  return o;
}

// A job's journal: two nodes, a round, a failure and restart, commits, KV.
std::string RealJournal(const std::string& dir) {
  FakeClock clock;
  {
    auto journal = Journal::Open(Journal::Options{dir});
    EXPECT_TRUE(journal.ok());
    JobMaster jm(FuzzJob(&clock, journal->get()));
    for (const char* id : {"a", "b"}) {
      v1::JoinRequest req;
      req.mutable_node()->set_node_id(id);
      req.mutable_node()->set_local_world_size(2);
      req.mutable_node()->set_host(std::string(id) + ".host");
      EXPECT_TRUE(jm.Join(req).ok());
    }
    EXPECT_TRUE(jm.KvSet("round/1/master_endpoint", "a.host:1").ok());
    for (int rank = 0; rank < 4; ++rank) {
      v1::ShardDurableReport sh;
      sh.set_dir("/c");
      sh.set_step(3);
      sh.set_rank(rank);
      sh.set_world_size(4);
      EXPECT_TRUE(jm.ReportShardDurable(sh).ok());
    }
    v1::FailureReport f;
    f.set_node_id("b");
    f.set_round(1);
    f.set_global_rank(2);
    f.set_exit_code(1);
    EXPECT_TRUE(jm.ReportFailure(f).ok());
    clock.Advance(3);
    jm.Tick();
  }
  std::ifstream in(dir + "/journal.log", std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(JournalFuzzReplayTest, MutatedJournalsOpenAndResumeWithoutCrashing) {
  const std::string dir = std::filesystem::temp_directory_path() / ("ballast-jfuzz-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::string good = RealJournal(dir);
  ASSERT_GT(good.size(), 200u);
  WriteFuzzSeed("master_journal_fuzz", "real_job", std::string_view(good).substr(kJournalMagic.size()));
  std::mt19937 rng(12345);
  int resumed = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string m = good;
    switch (i % 4) {
      case 0:  // flip bytes
        for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) m[rng() % m.size()] ^= static_cast<char>(1 + rng() % 255);
        break;
      case 1:  // cut anywhere
        m.resize(rng() % m.size());
        break;
      case 2:  // garbage appended
        for (int k = 0; k < 1 + static_cast<int>(rng() % 40); ++k) m.push_back(static_cast<char>(rng()));
        break;
      case 3:  // a chunk duplicated (a replayed write)
        if (size_t at = rng() % m.size(); true) m.insert(at, m.substr(at, rng() % 64));
        break;
    }
    const std::string_view body = std::string_view(m).substr(std::min(m.size(), kJournalMagic.size()));
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(body.data()), body.size());
    if (i % 25 != 0) continue;  // the full path (files, a master resuming) on a sample
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    {
      std::ofstream out(dir + "/journal.log", std::ios::binary);
      out << m;
    }
    auto journal = Journal::Open(Journal::Options{dir});
    ASSERT_TRUE(journal.ok()) << "mutation " << i << ": " << journal.status();
    if (!(*journal)->recovered()) continue;
    FakeClock clock;
    const JobMasterOptions o = FuzzJob(&clock, journal->get());
    if (!CheckJournalMatches(o, (*journal)->job()).ok()) continue;
    JobMaster jm(o);
    (void)jm.Status();
    clock.Advance(20);
    jm.Tick();  // every restored node times out
    (void)jm.Status();
    ++resumed;
  }
  EXPECT_GT(resumed, 20);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ballast::master
