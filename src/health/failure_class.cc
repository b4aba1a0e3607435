#include "health/failure_class.h"

#include <signal.h>

#include <regex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/subprocess.h"

namespace ballast::health {
namespace {

// Out-of-memory failures: one retry (a transient spike) and then the job fails.
constexpr int kOomRetries = 1;
// Addresses that do not work: one retry (a node or link that was just coming
// up), then the job fails with the message that says what to pass.
constexpr int kNetworkRetries = 1;

struct Rule {
  const char* name;
  FailureKind kind;
  // Matches when every given condition holds.
  bool (*flag)(const FailureEvidence&);  // nullptr: no flag condition
  int signal;                            // 0: any (or none)
  const char* stderr_pattern;            // ECMAScript regex; nullptr: none
  const char* what;                      // the cause's wording ("": the exit status says it all)
  int max_retries;
};

bool Hang(const FailureEvidence& e) { return e.hang; }
bool CheckFailed(const FailureEvidence& e) { return e.check_failed; }
bool OomKilled(const FailureEvidence& e) { return e.oom_killed; }
bool Unreachable(const FailureEvidence& e) { return e.master_addr_unreachable; }
bool StoreTimeout(const FailureEvidence& e) { return e.store_timeout; }

// Checked in order; the first match wins. Evidence from the supervisor comes
// first, then what the program said (a CUDA OOM also says "CUDA error"), then
// the terminating signal.
const Rule kRules[] = {
    {"hang", FailureKind::kHang, Hang, 0, nullptr, "hung (no progress)", -1},
    {"check-failed", FailureKind::kCheckFailed, CheckFailed, 0, nullptr, "failed the pre-flight check", -1},
    {"unreachable", FailureKind::kUnreachable, Unreachable, 0, nullptr, "cannot reach the round's MASTER_ADDR",
     kNetworkRetries},
    {"store-timeout", FailureKind::kStoreTimeout, StoreTimeout, 0, nullptr, "the process group did not form",
     kNetworkRetries},
    // Training would silently start over (python/ballast/checkpoint.py):
    // a restart finds the same checkpoints, so the job stops and says why.
    {"checkpoint-lost", FailureKind::kCheckpointLost, nullptr, 0, R"(CheckpointLostError: )",
     "the training state is lost", 0},
    {"oom-killer", FailureKind::kOomKilled, OomKilled, 0, nullptr, "killed by the kernel's OOM killer",
     kOomRetries},
    {"cuda-oom", FailureKind::kOutOfMemory, nullptr, 0,
     R"(CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation)", "out of GPU memory",
     kOomRetries},
    {"host-oom", FailureKind::kOutOfMemory, nullptr, 0,
     R"(MemoryError|DefaultCPUAllocator: can't allocate memory|std::bad_alloc|Cannot allocate memory)",
     "out of host memory", kOomRetries},
    {"nccl", FailureKind::kNcclError, nullptr, 0,
     R"(NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclRemoteError|NCCL WARN)",
     "NCCL error", -1},
    {"cuda", FailureKind::kCudaError, nullptr, 0,
     R"(CUDA error|CUDA driver error|cudaError|device-side assert|CUBLAS_STATUS_|CUDNN_STATUS_)", "CUDA error",
     -1},
    {"sigsegv", FailureKind::kSegfault, nullptr, SIGSEGV, nullptr, "segmentation fault", -1},
    {"sigbus", FailureKind::kSegfault, nullptr, SIGBUS, nullptr, "bus error", -1},
    {"sigill", FailureKind::kSegfault, nullptr, SIGILL, nullptr, "illegal instruction", -1},
    {"sigfpe", FailureKind::kSegfault, nullptr, SIGFPE, nullptr, "floating-point exception", -1},
    {"sigabrt", FailureKind::kAbort, nullptr, SIGABRT, nullptr, "aborted", -1},
    {"sigkill", FailureKind::kKilled, nullptr, SIGKILL, nullptr, "", -1},
    {"sigterm", FailureKind::kKilled, nullptr, SIGTERM, nullptr, "", -1},
};

// The first stderr line that matches `re`, trimmed, for the cause.
std::string MatchingLine(std::string_view text, const std::regex& re) {
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string line(text.substr(start, end - start));
    if (std::regex_search(line, re)) {
      if (line.size() > 160) line = line.substr(0, 157) + "...";
      return line;
    }
    start = end + 1;
  }
  return "";
}

std::string How(const FailureEvidence& e) {
  return ExitStatus{e.exit_code, e.signal}.Describe();
}

}  // namespace

bool LooksLikePeerLoss(std::string_view stderr_tail) {
  static const std::regex re(
      R"(Connection closed by peer|Connection reset by peer|Broken pipe|ncclRemoteError|remote process exited)",
      std::regex::ECMAScript | std::regex::optimize);
  return !MatchingLine(stderr_tail, re).empty();
}

FailureClass Classify(const FailureEvidence& e) {
  static const std::vector<std::regex> patterns = [] {
    std::vector<std::regex> v;
    for (const Rule& r : kRules) {
      v.emplace_back(r.stderr_pattern != nullptr ? r.stderr_pattern : "",
                     std::regex::ECMAScript | std::regex::optimize);
    }
    return v;
  }();
  for (size_t i = 0; i < std::size(kRules); ++i) {
    const Rule& r = kRules[i];
    if (r.flag != nullptr && !r.flag(e)) continue;
    if (r.signal != 0 && e.signal != r.signal) continue;
    std::string line;
    if (r.stderr_pattern != nullptr) {
      line = MatchingLine(e.stderr_tail, patterns[i]);
      if (line.empty()) continue;
    }
    FailureClass c;
    c.kind = r.kind;
    c.rule = r.name;
    c.max_retries = r.max_retries;
    c.cause = *r.what == '\0' ? How(e) : absl::StrCat(r.what, " (", How(e), ")");
    if (!line.empty()) absl::StrAppend(&c.cause, ": ", line);
    if (r.flag != nullptr && r.signal == 0 && r.stderr_pattern == nullptr && e.signal == 0 &&
        e.exit_code == 0) {
      c.cause = r.what;  // e.g. a hang: the worker was stopped by us
    }
    return c;
  }
  FailureClass c;
  c.kind = e.signal != 0 ? FailureKind::kKilled : FailureKind::kExitCode;
  c.rule = e.signal != 0 ? "signal" : "exit-code";
  c.cause = How(e);
  return c;
}

const char* FailureKindName(FailureKind kind) {
  switch (kind) {
    case FailureKind::kExitCode: return "exit-code";
    case FailureKind::kKilled: return "killed";
    case FailureKind::kOomKilled: return "oom-killed";
    case FailureKind::kOutOfMemory: return "out-of-memory";
    case FailureKind::kSegfault: return "segfault";
    case FailureKind::kAbort: return "abort";
    case FailureKind::kCudaError: return "cuda-error";
    case FailureKind::kNcclError: return "nccl-error";
    case FailureKind::kHang: return "hang";
    case FailureKind::kCheckFailed: return "check-failed";
    case FailureKind::kUnreachable: return "unreachable";
    case FailureKind::kStoreTimeout: return "store-timeout";
    case FailureKind::kNodeLost: return "node-lost";
    case FailureKind::kCheckpointLost: return "checkpoint-lost";
    case FailureKind::kNonFiniteLoss: return "nan";
    case FailureKind::kLossSpike: return "loss-spike";
    case FailureKind::kSilentCorruption: return "sdc";
    case FailureKind::kStraggler: return "straggler";
  }
  return "unknown";
}

std::optional<FailureKind> ParseFailureKind(std::string_view name) {
  for (int k = 0; k <= static_cast<int>(FailureKind::kStraggler); ++k) {
    if (name == FailureKindName(static_cast<FailureKind>(k))) return static_cast<FailureKind>(k);
  }
  return std::nullopt;
}

}  // namespace ballast::health
