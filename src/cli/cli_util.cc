#include "cli/cli_util.h"

#include <algorithm>
#include <cstdlib>

#include "cli/commands.h"

namespace ballast::cli {

int ParseOrExit(CLI::App& app, const std::vector<std::string>& args) {
  // CLI11 wants the arguments in reverse order.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "ballast %s: %s\nsee `ballast %s --help`\n", app.get_name().c_str(), e.what(),
                 app.get_name().c_str());
    return kUsageExit;
  }
  return -1;
}

std::string TokenFromFlagOrEnv(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  const char* env = std::getenv("BALLAST_TOKEN");
  return env != nullptr ? env : "";
}

}  // namespace ballast::cli
