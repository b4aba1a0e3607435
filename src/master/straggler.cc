#include "master/straggler.h"

#include <algorithm>
#include <vector>

namespace ballast::master {

double MedianStepTime(const std::map<NodeId, double>& step_times) {
  std::vector<double> v;
  for (const auto& [node, t] : step_times)
    if (t > 0) v.push_back(t);
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
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
