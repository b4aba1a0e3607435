#include "common/save_every.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ballast {

absl::Status ValidateSaveEvery(const std::string& text, const std::string& flag) {
  const std::string t(absl::StripAsciiWhitespace(text));
  std::string count = t;
  if (t == "auto") return absl::OkStatus();
  if (absl::StartsWith(t, "auto:")) count = t.substr(5);
  int n = 0;
  if (!count.empty() && absl::SimpleAtoi(count, &n) && n >= 1 && count.find_first_not_of("0123456789") == std::string::npos)
    return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      flag, " ", text, ": give a step count >= 1 (1: every save copies), auto (the interval that loses the least "
      "training time, from the measured save cost, step time and failure rate), or auto:MAX (auto, at most MAX steps), "
      "e.g. ", flag, " auto:200"));
}

absl::StatusOr<double> ParseDurationSeconds(const std::string& text, const std::string& flag) {
  std::string t(absl::StripAsciiWhitespace(text));
  double unit = 1;
  if (!t.empty()) {
    switch (t.back()) {
      case 's': unit = 1; t.pop_back(); break;
      case 'm': unit = 60; t.pop_back(); break;
      case 'h': unit = 3600; t.pop_back(); break;
      case 'd': unit = 86400; t.pop_back(); break;
      default: break;
    }
  }
  double v = 0;
  if (t.empty() || !absl::SimpleAtod(t, &v) || !std::isfinite(v) || v <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", text,
                                                   ": give a duration > 0: seconds, or a number with s, m, h or d "
                                                   "(e.g. ", flag, " 90m, ", flag, " 2d)"));
  }
  return v * unit;
}

}  // namespace ballast
