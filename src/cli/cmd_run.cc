// ballast run: parse torchrun-compatible flags and run the agent.
#include <cstdio>
#include <string>

#include "agent/run_options.h"
#include "cli/commands.h"

namespace ballast::cli {

int RunCommand(const Args& args) {
  auto options = agent::ParseRunArgs(args);
  if (!options.ok()) {
    if (options.status().code() == absl::StatusCode::kCancelled) {  // --help
      std::fputs(agent::RunUsage().c_str(), stdout);
      return 0;
    }
    std::fprintf(stderr, "ballast run: %s\n", std::string(options.status().message()).c_str());
    return kUsageExit;
  }
  return agent::RunAgent(*options);
}

}  // namespace ballast::cli
