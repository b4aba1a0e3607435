#include "cli/cli_util.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"

namespace ballast::cli {

absl::StatusOr<NodeRange> ParseNodeRange(const std::string& text, const std::string& flag) {
  NodeRange r;
  auto colon = text.find(':');
  bool ok = colon == std::string::npos
                ? absl::SimpleAtoi(text, &r.min) && (r.max = r.min, true)
                : absl::SimpleAtoi(text.substr(0, colon), &r.min) &&
                      absl::SimpleAtoi(text.substr(colon + 1), &r.max);
  if (!ok || r.min < 1 || r.max < r.min) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " '", text, "' is not valid: use N or MIN:MAX with 1 <= MIN <= MAX (e.g. ", flag, " 2:4)"));
  }
  return r;
}

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
