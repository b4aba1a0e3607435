// libFuzzer entry point for the master's journal: arbitrary bytes as the body
// of journal.log must parse to a prefix of good records (never past the end),
// and applying those records to a state image must not crash, whatever they
// say. Built as a fuzzer with clang (-DBALLAST_FUZZ=ON); the gtest
// journal_fuzz_replay_test links the same function and replays thousands of
// deterministic mutations of a real job's journal in every build.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "master/journal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ballast::master;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ParsedJournal p = ParseJournalRecords(bytes);
  if (p.good_bytes > size) __builtin_trap();
  ballast::v1::MasterSnapshot state;
  CkptCommitTracker ckpt;
  for (const auto& r : p.records) ApplyJournalRecord(r, &state, &ckpt);
  (void)ckpt.ToProto();
  // The same bytes as a snapshot payload (what Journal::Open parses after the checksum).
  ballast::v1::MasterSnapshot snap;
  if (snap.ParseFromArray(data, static_cast<int>(size))) {
    CkptCommitTracker t;
    t.FromProto(snap.ckpt_dirs());
  }
  return 0;
}
