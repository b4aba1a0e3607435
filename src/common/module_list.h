// Python module lists users give (--warm-modules, an ElasticJob's
// spec.warmModules): "a,b.c" -> {"a", "b.c"}, each checked to be a module name.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ballast {

// Empty entries are skipped; anything that is not a dotted Python identifier
// is refused (kInvalidArgument naming it).
absl::StatusOr<std::vector<std::string>> ParseModuleList(const std::string& value);

}  // namespace ballast
