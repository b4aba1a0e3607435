// Logging setup for the `ballast` binary. Only main() configures logging;
// libraries just call spdlog::info(...) on the default logger. Log lines carry
// `job= node= rank= round=` keys where they apply.
#pragma once

#include <string>

namespace ballast {

// Configures the default spdlog logger: stderr, pattern
// "[ballast <component> <time>] <level> <msg>", level from BALLAST_LOG_LEVEL
// (trace, debug, info, warn, error; default info).
void SetupLogging(const std::string& component);

}  // namespace ballast
