#include "common/module_list.h"

#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ballast {

absl::StatusOr<std::vector<std::string>> ParseModuleList(const std::string& value) {
  static const std::regex kModule(R"([A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)");
  std::vector<std::string> out;
  for (absl::string_view m : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::string name(m);
    if (!std::regex_match(name, kModule)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", name, "' is not a Python module name (e.g. numpy,transformers)"));
    }
    out.push_back(std::move(name));
  }
  return out;
}

}  // namespace ballast
