// The MIN:MAX node range of --nnodes / --nodes, shared by every subcommand.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace ballast {

struct NodeRange {
  int min = 1;
  int max = 1;
};

// "N" or "MIN:MAX" with 1 <= MIN <= MAX; kInvalidArgument naming `flag` and
// showing the accepted form otherwise.
absl::StatusOr<NodeRange> ParseNodeRange(const std::string& text, const std::string& flag);

}  // namespace ballast
