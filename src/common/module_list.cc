#include "common/module_list.h"

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/net.h"

namespace ballast {
namespace {

constexpr char kHeader[] = "# ballast warm modules v1";
constexpr char kPythonKey[] = "# python: ";
constexpr char kTargetKey[] = "# target: ";

// FNV-1a: a file name that stays the same from one build to the next
// (std::hash need not).
uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// A name sys.modules may hold for a module of a file: a dotted identifier,
// or such a name with '-' (CPython's _sysconfigdata__x86_64-linux-gnu).
bool IsFileModuleName(const std::string& name) {
  static const std::regex kName(R"([A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*)");
  return std::regex_match(name, kName);
}

}  // namespace

bool IsModuleName(const std::string& name) {
  static const std::regex kModule(R"([A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)");
  return std::regex_match(name, kModule);
}

absl::StatusOr<std::vector<std::string>> ParseModuleList(const std::string& value) {
  std::vector<std::string> out;
  for (absl::string_view m : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::string name(m);
    if (!IsModuleName(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", name, "' is not a Python module name (e.g. numpy,transformers)"));
    }
    out.push_back(std::move(name));
  }
  return out;
}

std::string BallastCacheDir() {
  if (std::string d = Env("BALLAST_CACHE"); !d.empty()) return d;
  if (std::string d = Env("XDG_CACHE_HOME"); !d.empty()) return (std::filesystem::path(d) / "ballast").string();
  if (std::string d = Env("HOME"); !d.empty()) return (std::filesystem::path(d) / ".cache" / "ballast").string();
  return "";
}

std::string ModuleListFile(const std::string& cache_dir, const std::string& python, const std::string& target) {
  if (cache_dir.empty()) return "";
  const std::string name = absl::StrFormat("%016x.txt", Fnv1a(absl::StrCat(python, std::string(1, '\0'), target)));
  return (std::filesystem::path(cache_dir) / "warm-modules" / name).string();
}

absl::StatusOr<std::vector<std::string>> ReadModuleListFile(const std::string& path, const std::string& python,
                                                            const std::string& target) {
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no module list at ", path));
    return absl::UnavailableError(absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::string line;
  if (!std::getline(in, line) || line != kHeader) {
    return absl::NotFoundError(absl::StrCat(path, " is not a ballast module list"));
  }
  std::vector<std::string> out;
  bool python_ok = false, target_ok = false;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, kPythonKey)) {
      python_ok = line.substr(sizeof(kPythonKey) - 1) == python;
    } else if (absl::StartsWith(line, kTargetKey)) {
      target_ok = line.substr(sizeof(kTargetKey) - 1) == target;
    } else if (IsFileModuleName(line)) {
      out.push_back(line);
    }
  }
  if (!python_ok || !target_ok) {
    return absl::NotFoundError(absl::StrCat(path, " was written for another python or script"));
  }
  return out;
}

absl::Status WriteModuleListFile(const std::string& path, const std::string& python, const std::string& target,
                                 const std::vector<std::string>& modules) {
  namespace fs = std::filesystem;
  const fs::path dest(path);
  std::error_code ec;
  fs::create_directories(dest.parent_path(), ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", dest.parent_path().string(), ": ", ec.message()));
  const fs::path tmp = dest.parent_path() / absl::StrCat(".", dest.filename().string(), ".", getpid(), ".",
                                                         RandomHex(4), ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kHeader << "\n" << kPythonKey << python << "\n" << kTargetKey << target << "\n";
    for (const std::string& m : modules) out << m << "\n";
    out.flush();
    if (!out) {
      fs::remove(tmp, ec);
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp.string()));
    }
  }
  fs::rename(tmp, dest, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp.string(), " to ", path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace ballast
