// libFuzzer entry point for the parsers of user input: the first byte picks
// the parser (chaos spec, node range, endpoint, one `ballast run` flag value
// with rdzv-conf among them), the rest is its input. Every input must be
// accepted or refused with kInvalidArgument and a message (what the CLI
// prints before exiting 2); anything else aborts, so libFuzzer reports it.
// Built as a fuzzer with clang (-DBALLAST_FUZZ=ON, `make fuzz`); the gtest
// parser_fuzz_test links the same function and replays deterministic
// mutations in every build.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "agent/run_options.h"
#include "common/chaos.h"
#include "common/net.h"
#include "common/node_range.h"

namespace {

// The `ballast run` flags whose values are parsed (the selector's index - 3).
const char* const kRunFlags[] = {"--nnodes",       "--nproc-per-node", "--max-restarts", "--rdzv-endpoint",
                                 "--rdzv-conf",    "--node-rank",      "--master-port",  "--monitor-interval",
                                 "--hang-timeout", "--ckpt-replicas",  "--redirects",    "--tee",
                                 "--node-unit",    "--http-port",      "--warm-modules", "--precheck"};
constexpr size_t kParsers = 3 + sizeof(kRunFlags) / sizeof(kRunFlags[0]);

template <typename T>
void Check(const absl::StatusOr<T>& r, const char* what, const std::string& input) {
  if (r.ok()) return;
  if (r.status().code() == absl::StatusCode::kInvalidArgument && !r.status().message().empty()) return;
  std::fprintf(stderr, "%s refused %zu-byte input with %s (want OK or INVALID_ARGUMENT with a message)\n", what,
               input.size(), r.status().ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t parser = data[0] % kParsers;
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (parser) {
    case 0:
      Check(ballast::ParseChaosSpec(input), "ParseChaosSpec", input);
      break;
    case 1: {
      auto range = ballast::ParseNodeRange(input, "--nnodes");
      Check(range, "ParseNodeRange", input);
      if (range.ok() && range->min > range->max) std::abort();
      break;
    }
    case 2:
      Check(ballast::ParseEndpoint(input), "ParseEndpoint", input);
      break;
    default: {
      const std::string flag = kRunFlags[parser - 3];
      // Even inputs as --flag=value, odd ones as --flag value.
      std::vector<std::string> args = input.size() % 2 == 0 ? std::vector<std::string>{flag + "=" + input}
                                                            : std::vector<std::string>{flag, input};
      args.push_back("train.py");
      Check(ballast::agent::ParseRunArgs(args), flag.c_str(), input);
    }
  }
  return 0;
}
