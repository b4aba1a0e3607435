#include "cli/cli_util.h"

#include <algorithm>
#include <cmath>
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
    std::string what = e.what();
    // CLI11 says "--flag: " + our checks' "must be ...": "--flag must be ...".
    if (size_t at = what.find(": must be "); at != std::string::npos) what.erase(at, 1);
    std::fprintf(stderr, "ballast %s: %s\nsee `ballast %s --help`\n", app.get_name().c_str(), what.c_str(),
                 app.get_name().c_str());
    return kUsageExit;
  }
  return -1;
}

CLI::Validator Port() { return IntegerIn<int>(0, 65535, "a port from 0 to 65535 (0: any free port)", "PORT"); }

CLI::Validator Seconds(bool positive) {
  return CLI::Validator(
      [positive](std::string& input) -> std::string {
        double v = 0;
        if (absl::SimpleAtod(input, &v) && std::isfinite(v) && (positive ? v > 0 : v >= 0)) return "";
        return absl::StrCat("must be a number of seconds ", positive ? "> 0" : ">= 0", " (got ", input, ")");
      },
      "", "SECONDS");
}

CLI::Validator Fraction(std::string what) {
  return CLI::Validator(
      [what](std::string& input) -> std::string {
        double v = 0;
        if (absl::SimpleAtod(input, &v) && std::isfinite(v) && v > 0 && v <= 1) return "";
        return absl::StrCat("must be ", what, " in (0, 1] (got ", input, ")");
      },
      "", "FRACTION");
}

std::string TokenFromFlagOrEnv(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  const char* env = std::getenv("BALLAST_TOKEN");
  return env != nullptr ? env : "";
}

}  // namespace ballast::cli
