#include "common/logging.h"

#include <cstdlib>

#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace ballast {

void SetupLogging(const std::string& component) {
  auto logger = spdlog::stderr_logger_mt("ballast-" + component);
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("[ballast " + component + " %H:%M:%S.%e] %^%l%$ %v");
  const char* level = std::getenv("BALLAST_LOG_LEVEL");
  spdlog::set_level(level != nullptr ? spdlog::level::from_str(level) : spdlog::level::info);
  spdlog::flush_on(spdlog::level::trace);
}

}  // namespace ballast
