#include "master/straggler.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace ballast::master {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t n = v.size();
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(n / 2);
  std::nth_element(v.begin(), mid, v.end());
  // For an even count the other middle one is the largest below it.
  return n % 2 == 1 ? *mid : (*std::max_element(v.begin(), mid) + *mid) / 2;
}

double MedianStepTime(const std::map<NodeId, double>& step_times) {
  std::vector<double> v;
  for (const auto& [node, t] : step_times)
    if (t > 0) v.push_back(t);
  return Median(std::move(v));
}

std::set<NodeId> FindStragglers(const std::map<NodeId, double>& step_times, double factor) {
  std::set<NodeId> out;
  if (factor <= 0) return out;
  size_t reporting = std::count_if(step_times.begin(), step_times.end(), [](const auto& kv) { return kv.second > 0; });
  if (reporting < 2) return out;
  const double limit = factor * MedianStepTime(step_times);
  for (const auto& [node, t] : step_times)
    if (t > limit) out.insert(node);
  return out;
}

}  // namespace ballast::master
