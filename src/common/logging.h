// Logging setup for the `ballast` binary. Only main() configures logging;
// libraries just call spdlog::info(...) on the default logger. Log lines carry
// `job= node= rank= round=` keys where they apply.
#pragma once

#include <memory>
#include <string>

#include "spdlog/sinks/sink.h"

namespace ballast {

// Configures the default spdlog logger: stderr, pattern
// "[ballast <component> <time>] <level> <msg>", level from BALLAST_LOG_LEVEL
// (trace, debug, info, warn, error; default info). Its sink honours DeferLogs.
void SetupLogging(const std::string& component);

// While a DeferLogs lives on a thread, lines that thread logs through a
// deferring sink (DeferringSink; SetupLogging installs one) are kept in
// memory, and written when the thread's outermost DeferLogs ends. A component
// that logs under its lock takes a DeferLogs before the lock (the JobMaster's
// JobLock does): the line is formatted there, but the write (a system call,
// and the sink's own mutex) happens after the lock is released. Each line
// keeps the time it was logged at. Cheap when nothing is logged.
class DeferLogs {
 public:
  DeferLogs();
  ~DeferLogs();
  DeferLogs(const DeferLogs&) = delete;
  DeferLogs& operator=(const DeferLogs&) = delete;
};

// A sink that writes through `inner`, or keeps the line for later while the
// logging thread is inside a DeferLogs. Thread-safe as `inner` is.
std::shared_ptr<spdlog::sinks::sink> DeferringSink(std::shared_ptr<spdlog::sinks::sink> inner);

}  // namespace ballast
