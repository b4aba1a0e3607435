// Runtime straggler detection: from each node's step time (its agent's
// progress reports), the nodes slower than factor x the median of the round.
//
// Thread safety: stateless; all functions are thread-safe.
#pragma once

#include <map>
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

// The nodes whose step time exceeds factor x the median of the positive step
// times. Empty with fewer than 2 positive step times (one node has nothing to
// be compared with) or factor <= 0.
std::set<NodeId> FindStragglers(const std::map<NodeId, double>& step_times, double factor);

}  // namespace ballast::master
