// Failure classification: every worker failure gets a cause that decisions and
// messages use (killed by a signal, the kernel's OOM killer, an out-of-memory
// error, a CUDA or NCCL error found in the last stderr lines, a hang, a failed
// pre-flight check, or an ordinary exit code).
//
// The rules are one table (kRules in failure_class.cc), checked in order; the
// first match wins. Adding a kind of failure is adding a row.
//
// Thread safety: stateless; all functions are thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace ballast::health {

enum class FailureKind {
  kExitCode,     // exited non-zero, nothing more specific known
  kKilled,       // SIGKILL / SIGTERM from someone (not the OOM killer)
  kOomKilled,    // the kernel's OOM killer
  kOutOfMemory,  // the program reported running out of (host or device) memory
  kSegfault,     // SIGSEGV / SIGBUS / SIGILL / SIGFPE
  kAbort,        // SIGABRT (assertions, std::terminate)
  kCudaError,
  kNcclError,
  kHang,         // no progress for the hang timeout
  kCheckFailed,  // the pre-flight check failed on this node
  kUnreachable,  // this node cannot reach the round's MASTER_ADDR
  kStoreTimeout, // the workers' process group did not form in time
  kNodeLost,     // the master lost the whole node (its failure record; no worker reports it)
  kCheckpointLost,  // ballast's Checkpointer.load(): no checkpoint covers some ranks (not retried)
  kNonFiniteLoss,   // a worker reported a NaN/Inf loss (ballast.step(loss=)): a rollback, not a crash
  kLossSpike,       // a worker's loss spiked (--loss-spike): a rollback, not a crash
  kSilentCorruption,  // a rank's parameters diverged from its replicas' (fingerprints): exclude + rollback
  kStraggler,         // a node stayed a runtime straggler (--exclude-stragglers): excluded and replaced
};

// What the supervisor knows about one failure.
struct FailureEvidence {
  int exit_code = 0;            // valid when signal == 0
  int signal = 0;               // terminating signal, 0 if it exited
  std::string_view stderr_tail; // last lines of the worker's stderr
  bool oom_killed = false;      // the OOM killer acted (e.g. cgroup memory.events)
  bool hang = false;            // the worker was stopped because it hung
  bool check_failed = false;    // the node failed the pre-flight check
  bool master_addr_unreachable = false;  // the round's MASTER_ADDR did not resolve or connect
  bool store_timeout = false;   // not every rank reached the torch store in time
};

struct FailureClass {
  FailureKind kind = FailureKind::kExitCode;
  std::string rule;   // the table row that matched, e.g. "cuda-oom"
  std::string cause;  // for messages: "out of memory (CUDA out of memory)"
  // How many restarts a failure of this kind may use: -1 = as many as
  // --max-restarts allows; out-of-memory failures are not retried forever
  // (retrying the same batch on the same memory fails the same way).
  int max_retries = -1;
};

FailureClass Classify(const FailureEvidence& evidence);

// Whether a worker's last stderr lines say a collective lost its peer (gloo's
// "Connection closed by peer" / "Connection reset by peer", a broken pipe,
// NCCL's remote error): the usual consequence of another rank's death or
// kill, so a crash that says so is blamed after one that does not.
bool LooksLikePeerLoss(std::string_view stderr_tail);

// "exit-code", "killed", "oom-killed", "out-of-memory", "segfault", "abort",
// "cuda-error", "nccl-error", "hang", "check-failed", "unreachable",
// "store-timeout", "node-lost", "checkpoint-lost", "nan", "loss-spike", "sdc".
const char* FailureKindName(FailureKind kind);
// The kind a name stands for (FailureKindName's inverse); nullopt for any
// other text.
std::optional<FailureKind> ParseFailureKind(std::string_view name);

}  // namespace ballast::health
