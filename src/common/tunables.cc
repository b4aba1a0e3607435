#include "common/tunables.h"

#include <cctype>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "spdlog/spdlog.h"

namespace ballast {
namespace {

std::string EnvName(const char* name) {
  std::string env = "BALLAST_";
  for (const char* p = name; *p; ++p) env += static_cast<char>(std::toupper(*p));
  return env;
}

bool ParseValue(const char* s, double* out) { return absl::SimpleAtod(s, out); }
bool ParseValue(const char* s, int* out) { return absl::SimpleAtoi(s, out); }

}  // namespace

Tunables Tunables::FromEnv(std::vector<std::string>* errors) {
  Tunables t;
#define BALLAST_TUNABLE_ENV(type, name, def, doc)                                                      \
  if (const char* v = std::getenv(EnvName(#name).c_str()); v != nullptr && *v != '\0') {              \
    type parsed{};                                                                                     \
    if (ParseValue(v, &parsed) && parsed >= 0) {                                                       \
      t.name = parsed;                                                                                 \
    } else if (errors != nullptr) {                                                                    \
      errors->push_back(EnvName(#name) + "='" + v + "' is not " +                                     \
                        (ParseValue(v, &parsed) ? std::string("a value >= 0") : "a valid " #type) +   \
                        " (" doc "); set it to one, or unset it for the default " #def);              \
    }                                                                                                  \
  }
  BALLAST_TUNABLES(BALLAST_TUNABLE_ENV)
#undef BALLAST_TUNABLE_ENV
  return t;
}

std::vector<std::string> Tunables::Validate() {
  std::vector<std::string> errors;
  FromEnv(&errors);
  return errors;
}

const Tunables& Tunables::Get() {
  static const Tunables tunables = [] {
    std::vector<std::string> errors;
    Tunables t = FromEnv(&errors);
    for (const auto& e : errors) spdlog::warn("{}", e);
    return t;
  }();
  return tunables;
}

}  // namespace ballast
