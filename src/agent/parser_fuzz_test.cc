// Every parser of user input, fed deterministic mutations of valid inputs
// and random bytes: the chaos spec (--chaos / BALLAST_CHAOS), node ranges
// (--nnodes), endpoints (--rdzv-endpoint), rdzv-conf and every other
// `ballast run` flag value (ParseRunArgs). Passing means: no crash, and
// every input is either accepted or refused with kInvalidArgument and a
// message (the CLI prints it and exits 2). The journal's parser has its own
// (master/journal_fuzz_replay_test.cc), the checkpoint reader too.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "agent/run_options.h"
#include "common/chaos.h"
#include "common/fuzz_seed.h"
#include "common/net.h"
#include "common/node_range.h"
#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace ballast::agent {
namespace {

std::string Mutate(std::mt19937& rng, std::string s) {
  static const std::string kAlphabet = "0123456789:,=.-_ abcxyz@[]%\x01\xff";
  switch (rng() % 5) {
    case 0:  // replace a byte
      if (!s.empty()) s[rng() % s.size()] = kAlphabet[rng() % kAlphabet.size()];
      break;
    case 1:  // insert
      s.insert(s.begin() + static_cast<long>(s.empty() ? 0 : rng() % (s.size() + 1)),
               kAlphabet[rng() % kAlphabet.size()]);
      break;
    case 2:  // cut
      if (!s.empty()) s.resize(rng() % s.size());
      break;
    case 3:  // duplicate a chunk
      if (!s.empty()) {
        const size_t at = rng() % s.size();
        s.insert(at, s.substr(at, rng() % 8));
      }
      break;
    default:  // random bytes
      s.clear();
      for (int i = 0, n = static_cast<int>(rng() % 24); i < n; ++i) s.push_back(static_cast<char>(rng()));
  }
  return s;
}

template <typename T>
void ExpectAcceptedOrInvalid(const absl::StatusOr<T>& r, const std::string& input) {
  if (r.ok()) return;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << "input: " << input << ": " << r.status();
  EXPECT_FALSE(r.status().message().empty()) << "input: " << input;
}

TEST(ParserFuzz, ChaosNodeRangeAndEndpointNeverCrashAndRefuseClearly) {
  std::mt19937 rng(7);
  const std::vector<std::string> chaos_seeds = {"check-fail:node=1", "kill-agent:node=0,after=2.5",
                                                "check-fail:node=1,incarnation=2;check-slow:node=3,factor=4"};
  const std::vector<std::string> range_seeds = {"2", "2:4", "1:1000"};
  const std::vector<std::string> endpoint_seeds = {"127.0.0.1:29400", "[::1]:80", "master.example:1"};
  for (int i = 0; i < 4000; ++i) {
    std::string c = Mutate(rng, chaos_seeds[rng() % chaos_seeds.size()]);
    ExpectAcceptedOrInvalid(ParseChaosSpec(c), c);
    std::string n = Mutate(rng, range_seeds[rng() % range_seeds.size()]);
    auto range = ParseNodeRange(n, "--nnodes");
    ExpectAcceptedOrInvalid(range, n);
    if (range.ok()) {
      EXPECT_LE(range->min, range->max) << n;
    }
    std::string e = Mutate(rng, endpoint_seeds[rng() % endpoint_seeds.size()]);
    ExpectAcceptedOrInvalid(ParseEndpoint(e), e);
  }
}

TEST(ParserFuzz, RunFlagValuesNeverCrashAndRefuseClearly) {
  std::mt19937 rng(11);
  const std::vector<std::pair<std::string, std::string>> flags = {
      {"--nnodes", "1:2"},         {"--nproc-per-node", "2"},      {"--max-restarts", "3"},
      {"--rdzv-endpoint", "h:1"},  {"--rdzv-conf", "last_call_timeout=1,join_timeout=5"},
      {"--node-rank", "0"},        {"--master-port", "29500"},     {"--monitor-interval", "0.05"},
      {"--hang-timeout", "30"},    {"--ckpt-replicas", "1"},       {"--redirects", "0:1,1:2"},
      {"--tee", "3"},              {"--node-unit", "2"},           {"--http-port", "8080"},
      {"--warm-modules", "a,b"},   {"--precheck", "1"}};
  for (int i = 0; i < 4000; ++i) {
    const auto& [flag, seed] = flags[rng() % flags.size()];
    const std::string value = Mutate(rng, seed);
    const bool joined = rng() % 2 == 0;  // --flag=value or --flag value
    std::vector<std::string> args = joined ? std::vector<std::string>{flag + "=" + value}
                                           : std::vector<std::string>{flag, value};
    args.push_back("train.py");
    ExpectAcceptedOrInvalid(ParseRunArgs(args), flag + " " + value);
  }
}

// The libFuzzer target's entry point (parser_fuzz.cc, `make fuzz`) over the
// same kind of mutations: it aborts on a refusal without a clear message.
TEST(ParserFuzz, FuzzEntryPointReplaysMutations) {
  std::mt19937 rng(13);
  const std::vector<std::string> seeds = {"check-fail:node=1", "2:4", "127.0.0.1:29400", "1:2", "2", "3",
                                          "h:1", "last_call_timeout=1,join_timeout=5", "0", "29500", "0.05",
                                          "30", "1", "0:1,1:2", "3", "2", "8080", "a,b", "1"};
  for (size_t p = 0; p < seeds.size(); ++p) {
    WriteFuzzSeed("parser_fuzz", "seed" + std::to_string(p), std::string(1, static_cast<char>(p)) + seeds[p]);
  }
  for (int i = 0; i < 6000; ++i) {
    const size_t parser = rng() % seeds.size();
    std::string input = std::string(1, static_cast<char>(parser)) + Mutate(rng, seeds[parser]);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  }
}

}  // namespace
}  // namespace ballast::agent
