#include "health/oom.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ballast::health {
namespace {

// The N of a "oom_kill N" line in the file, nullopt without one.
std::optional<int64_t> OomKillLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "oom_kill ")) continue;
    int64_t n = 0;
    if (absl::SimpleAtoi(rest, &n)) return n;
  }
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> CgroupOomKills(const std::string& proc_cgroup, const std::string& cgroup_root) {
  std::ifstream in(proc_cgroup);
  std::string line;
  std::optional<std::string> v2, v1;
  while (std::getline(in, line)) {
    // "hierarchy-ID:controller-list:path"
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) v2 = f[2];
    for (absl::string_view c : absl::StrSplit(f[1], ',')) {
      if (c == "memory") v1 = f[2];
    }
  }
  if (v1.has_value()) {
    if (auto n = OomKillLine(cgroup_root + "/memory" + *v1 + "/memory.oom_control")) return n;
  }
  if (v2.has_value()) {
    if (auto n = OomKillLine(cgroup_root + *v2 + "/memory.events")) return n;
  }
  return std::nullopt;
}

}  // namespace ballast::health
