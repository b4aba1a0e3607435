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

std::optional<double> StragglerLimit(std::vector<double> times, double factor) {
  times.erase(std::remove_if(times.begin(), times.end(), [](double t) { return !(t > 0); }), times.end());
  if (factor <= 0 || times.size() < 2) return std::nullopt;
  return factor * Median(std::move(times));
}

std::set<NodeId> FindStragglers(const std::map<NodeId, double>& step_times, double factor) {
  std::set<NodeId> out;
  std::vector<double> times;
  times.reserve(step_times.size());
  for (const auto& [node, t] : step_times) times.push_back(t);
  const std::optional<double> limit = StragglerLimit(std::move(times), factor);
  if (!limit.has_value()) return out;
  for (const auto& [node, t] : step_times)
    if (t > *limit) out.insert(node);
  return out;
}

}  // namespace ballast::master
