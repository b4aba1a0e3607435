// Runtime straggler detection: from each node's step time (its agent's
// progress reports), the nodes slower than factor x the median of the round.
//
// Thread safety: stateless; all functions are thread-safe.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/ids.h"

namespace ballast::master {

// The median of the positive values (the mean of the two middle ones for an
// even count); 0 when there is none.
double MedianStepTime(const std::map<NodeId, double>& step_times);
// The median of `values` (the mean of the two middle ones for an even
// count); 0 when empty. O(n): no sort.
double Median(std::vector<double> values);

// The time a straggler's exceeds: factor x the median of the positive times
// (0 = unknown, left out); nullopt with fewer than 2 positive times (one node
// has nothing to be compared with) or factor <= 0.
std::optional<double> StragglerLimit(std::vector<double> times, double factor);

// The nodes whose step time exceeds StragglerLimit of them all.
std::set<NodeId> FindStragglers(const std::map<NodeId, double>& step_times, double factor);

}  // namespace ballast::master
