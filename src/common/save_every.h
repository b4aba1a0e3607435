// --save-every and --mtbf, shared by `ballast run`, `ballast launch` and
// `ballast slurm`: the agents hand them to the workers (BALLAST_SAVE_EVERY,
// BALLAST_MTBF_S), whose Checkpointer picks the saves that copy
// (python/ballast/save_policy.py).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast {

inline constexpr char kSaveEveryEnv[] = "BALLAST_SAVE_EVERY";
inline constexpr char kMtbfEnv[] = "BALLAST_MTBF_S";
// --ckpt-copy-share: the share of the time the agent's writes of persist=True
// steps may take (python/ballast/save_policy.py, PersistPace).
inline constexpr char kCopyShareEnv[] = "BALLAST_CKPT_COPY_SHARE";
// Unix seconds when the job's first round started on this agent (the job's
// age for the failure rate the workers estimate).
inline constexpr char kJobStartEnv[] = "BALLAST_JOB_START";

// "N" (N >= 1), "auto" or "auto:MAX" (MAX >= 1); kInvalidArgument naming `flag` otherwise.
absl::Status ValidateSaveEvery(const std::string& text, const std::string& flag);

// A duration: seconds, or a number with s, m, h or d ("90", "90s", "30m",
// "1.5h", "2d"); > 0. kInvalidArgument naming `flag` otherwise.
absl::StatusOr<double> ParseDurationSeconds(const std::string& text, const std::string& flag);

}  // namespace ballast
