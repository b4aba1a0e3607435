#include "common/logging.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include "spdlog/details/log_msg_buffer.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace ballast {
namespace {

// This thread's open DeferLogs scopes and the lines they hold, in order.
struct Deferred {
  int depth = 0;
  std::vector<std::pair<std::shared_ptr<spdlog::sinks::sink>, spdlog::details::log_msg_buffer>> lines;
};
thread_local Deferred tl_deferred;

class DeferringSinkImpl final : public spdlog::sinks::sink {
 public:
  explicit DeferringSinkImpl(std::shared_ptr<spdlog::sinks::sink> inner) : inner_(std::move(inner)) {}
  void log(const spdlog::details::log_msg& msg) override {
    if (tl_deferred.depth > 0) {
      tl_deferred.lines.emplace_back(inner_, spdlog::details::log_msg_buffer(msg));
      return;
    }
    inner_->log(msg);
  }
  void flush() override {
    if (tl_deferred.depth == 0) inner_->flush();  // a deferred line is flushed when written
  }
  void set_pattern(const std::string& pattern) override { inner_->set_pattern(pattern); }
  void set_formatter(std::unique_ptr<spdlog::formatter> formatter) override {
    inner_->set_formatter(std::move(formatter));
  }

 private:
  const std::shared_ptr<spdlog::sinks::sink> inner_;
};

}  // namespace

DeferLogs::DeferLogs() { ++tl_deferred.depth; }

DeferLogs::~DeferLogs() {
  if (--tl_deferred.depth > 0 || tl_deferred.lines.empty()) return;
  auto lines = std::move(tl_deferred.lines);
  tl_deferred.lines.clear();
  for (auto& [sink, line] : lines) {
    sink->log(line);
    sink->flush();
  }
}

std::shared_ptr<spdlog::sinks::sink> DeferringSink(std::shared_ptr<spdlog::sinks::sink> inner) {
  return std::make_shared<DeferringSinkImpl>(std::move(inner));
}

void SetupLogging(const std::string& component) {
  auto sink = DeferringSink(std::make_shared<spdlog::sinks::stderr_sink_mt>());
  auto logger = std::make_shared<spdlog::logger>("ballast-" + component, std::move(sink));
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("[ballast " + component + " %H:%M:%S.%e] %^%l%$ %v");
  const char* level = std::getenv("BALLAST_LOG_LEVEL");
  spdlog::set_level(level != nullptr ? spdlog::level::from_str(level) : spdlog::level::info);
  spdlog::flush_on(spdlog::level::trace);
}

}  // namespace ballast
