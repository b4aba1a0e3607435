// Fault injection for chaos drills and tests: a spec names faults by kind and
// the node they hit, e.g.
//   "check-fail:node=1"                     node 1 fails the pre-flight check
//   "check-slow:node=2,factor=5"            node 2's check takes 5x as long
//   "check-fail:node=1;check-slow:node=3,factor=4"   several faults, ';'-separated
//   "kill-agent:node=0,after=5"             node 0's agent SIGKILLs itself 5 s after
//                                           its workers first start (a lost node)
//   "check-fail:node=1,incarnation=2"       the first replacement of node 1 fails
//   "kill-agent:node=1,at_step=20"          node 1's agent SIGKILLs itself when its workers reach step 20
//   "kill-worker:rank=2,at_step=7"          the agent SIGKILLs worker rank 2 when it reaches step 7
//   "hang:rank=1,after=3"                   the agent SIGSTOPs worker rank 1 3 s after the round starts
//   "kill-master:at_step=10"                launch --journal SIGKILLs its master process at step 10
//   "nan:rank=3,at_step=40"                 worker rank 3 reports a NaN loss at step 40
//                                           (applied by the worker: python/ballast/health.py)
// `ballast launch --chaos SPEC` hands the spec to its agents as BALLAST_CHAOS
// and numbers the agents of a node rank in BALLAST_CHAOS_INCARNATION (1 for
// the first, 2 for its first replacement, ...); an agent applies the faults
// whose `node` is its --node-rank and whose `incarnation` (default 1) is its
// own. Every kind takes the optional incarnation key.
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
inline constexpr char kChaosIncarnationEnv[] = "BALLAST_CHAOS_INCARNATION";

struct ChaosFault {
  std::string kind;                           // e.g. "check-fail"
  int node = -1;                              // the node rank it hits
  int incarnation = 1;                        // ... and which agent of that rank
  std::map<std::string, std::string> params;  // other key=value pairs, as given

  // A numeric parameter, or `fallback` when absent (parsing validated it).
  double Number(const std::string& key, double fallback) const;
};

struct ChaosSpec {
  std::vector<ChaosFault> faults;
  int incarnation = 1;  // the incarnation of the agent applying the spec
  bool empty() const { return faults.empty(); }
  // The first fault of `kind` aimed at `node` and this incarnation, or nullptr.
  const ChaosFault* Find(const std::string& kind, int node) const;
  // Every fault of `kind` for this incarnation (rank-keyed kinds such as
  // kill-worker, and kill-master).
  std::vector<const ChaosFault*> All(const std::string& kind) const;
};

// Parses "kind:key=val,key=val;kind2:...". Empty or blank text is an empty
// spec. kInvalidArgument naming the bad part for an unknown kind or key, a
// missing required key, or a malformed value.
absl::StatusOr<ChaosSpec> ParseChaosSpec(const std::string& text);

// The spec of this agent: BALLAST_CHAOS parsed, incarnation from
// BALLAST_CHAOS_INCARNATION (default 1). kInvalidArgument naming the variable
// when either is malformed.
absl::StatusOr<ChaosSpec> ChaosSpecFromEnv();

// The known kinds, for help texts: "check-fail:node=R; check-slow:node=R,factor=F".
std::string ChaosKindsHelp();

}  // namespace ballast
