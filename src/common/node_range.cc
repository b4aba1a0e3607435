#include "common/node_range.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ballast {

absl::StatusOr<NodeRange> ParseNodeRange(const std::string& text, const std::string& flag) {
  NodeRange r;
  auto colon = text.find(':');
  bool ok = colon == std::string::npos
                ? absl::SimpleAtoi(text, &r.min) && (r.max = r.min, true)
                : absl::SimpleAtoi(text.substr(0, colon), &r.min) &&
                      absl::SimpleAtoi(text.substr(colon + 1), &r.max);
  if (!ok || r.min < 1 || r.max < r.min) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " '", text, "' is not valid: use N or MIN:MAX with 1 <= MIN <= MAX (e.g. ", flag, " 2:4)"));
  }
  return r;
}

}  // namespace ballast
