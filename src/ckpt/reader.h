// Reading checkpoint files: `<dir>/step-<N>/rank-<R>.ballast` (format.h) and
// `<dir>/latest` (the decimal step of the newest globally complete step).
//
// Everything read from disk is validated (magic, version, sizes, bounds,
// header/index/data checksums). A corrupt or truncated file is kDataLoss with
// a message that names the file and says what to do; a missing file or no
// complete step is kNotFound. Never crashes on bad input (fuzzed by
// reader_fuzz.cc).
//
// Ownership: a returned Snapshot keeps the file mapped read-only until its last
// copy is destroyed. Thread safety: all functions are thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/snapshot.h"

namespace ballast::ckpt {

struct ReadOptions {
  // Verify the data checksum (one pass over the file's data).
  bool verify_data = true;
};

// "<dir>/step-<N>" and "<dir>/step-<N>/rank-<R>.ballast".
std::string StepDir(const std::string& dir, uint64_t step);
std::string ShardPath(const std::string& dir, uint64_t step, int rank);
std::string LatestPath(const std::string& dir);

// Opens, maps and validates one shard file.
absl::StatusOr<Snapshot> ReadCheckpointFile(const std::string& path, const ReadOptions& options = {});

// The step named by <dir>/latest. kNotFound when there is none yet;
// kDataLoss when it is unreadable.
absl::StatusOr<uint64_t> ReadLatestStep(const std::string& dir);

// Rank `rank`'s shard of the latest complete step.
absl::StatusOr<Snapshot> ReadLatest(const std::string& dir, int rank,
                                    const ReadOptions& options = {});

}  // namespace ballast::ckpt
