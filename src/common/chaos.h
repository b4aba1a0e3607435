// Fault injection for chaos drills and tests: a spec names faults by kind and
// the node they hit, e.g.
//   "check-fail:node=1"                     node 1 fails the pre-flight check
//   "check-slow:node=2,factor=5"            node 2's check takes 5x as long
//   "check-fail:node=1;check-slow:node=3,factor=4"   several faults, ';'-separated
// `ballast launch --chaos SPEC` hands the spec to its agents as BALLAST_CHAOS;
// an agent applies the faults whose `node` is its --node-rank.
//
// New kinds are one row in the table in chaos.cc (name, allowed keys,
// required keys); the code that injects a fault asks FindFault(kind, node).
// Thread safety: stateless free functions; ChaosSpec is a plain value.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ballast {

inline constexpr char kChaosEnv[] = "BALLAST_CHAOS";

struct ChaosFault {
  std::string kind;                           // e.g. "check-fail"
  int node = -1;                              // the node rank it hits
  std::map<std::string, std::string> params;  // other key=value pairs, as given

  // A numeric parameter, or `fallback` when absent (parsing validated it).
  double Number(const std::string& key, double fallback) const;
};

struct ChaosSpec {
  std::vector<ChaosFault> faults;
  bool empty() const { return faults.empty(); }
  // The first fault of `kind` aimed at `node`, or nullptr.
  const ChaosFault* Find(const std::string& kind, int node) const;
};

// Parses "kind:key=val,key=val;kind2:...". Empty or blank text is an empty
// spec. kInvalidArgument naming the bad part for an unknown kind or key, a
// missing required key, or a malformed value.
absl::StatusOr<ChaosSpec> ParseChaosSpec(const std::string& text);

// The known kinds, for help texts: "check-fail:node=R; check-slow:node=R,factor=F".
std::string ChaosKindsHelp();

}  // namespace ballast
