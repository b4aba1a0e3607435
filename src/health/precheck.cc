#include "health/precheck.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ballast::health {

Groups GroupInOrder(int n) {
  Groups g;
  for (int i = 0; i + 1 < n; i += 2) g.push_back({i, i + 1});
  if (n % 2 == 1) {
    if (g.empty()) g.push_back({});
    g.back().push_back(n - 1);
  }
  return g;
}

Groups GroupFastestWithSlowest(const std::vector<double>& times) {
  const int n = static_cast<int>(times.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return times[a] < times[b]; });
  Groups g;
  for (int i = 0; i < n / 2; ++i) g.push_back({order[i], order[n - 1 - i]});
  if (n % 2 == 1) {
    if (g.empty()) g.push_back({});
    g.back().push_back(order[n / 2]);
  }
  return g;
}

std::vector<NodeResult> ApplyGroupFailure(const Groups& groups, std::vector<NodeResult> results) {
  for (const auto& group : groups) {
    bool failed = std::any_of(group.begin(), group.end(), [&](int i) { return !results[i].ok; });
    if (!failed) continue;
    for (int i : group) results[i] = NodeResult{};
  }
  return results;
}

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string Nodes(const std::vector<int>& v) { return absl::StrJoin(v, ", "); }

}  // namespace

Groups GroupSuspectsWithHealthy(const Verdict& verdict, const std::vector<double>& best_times) {
  std::vector<int> healthy;
  for (int i = 0; i < static_cast<int>(best_times.size()); ++i) {
    bool bad = std::find(verdict.faulty.begin(), verdict.faulty.end(), i) != verdict.faulty.end();
    if (!bad && std::isfinite(best_times[i])) healthy.push_back(i);
  }
  std::stable_sort(healthy.begin(), healthy.end(), [&](int a, int b) { return best_times[a] < best_times[b]; });
  Groups g;
  for (size_t i = 0; i < verdict.suspects.size() && i < healthy.size(); ++i)
    g.push_back({healthy[i], verdict.suspects[i]});
  return g;
}

Verdict RefineWithSuspectRound(Verdict v, const Groups& groups, const std::vector<NodeResult>& round3) {
  std::vector<int> cleared;
  for (const auto& group : groups) {
    for (int node : group) {
      bool suspect = std::find(v.suspects.begin(), v.suspects.end(), node) != v.suspects.end();
      if (suspect && round3[node].ok) cleared.push_back(node);
    }
  }
  std::vector<int> still;
  for (int s : v.suspects) {
    bool grouped = false;
    for (const auto& group : groups) grouped |= std::find(group.begin(), group.end(), s) != group.end();
    bool is_cleared = std::find(cleared.begin(), cleared.end(), s) != cleared.end();
    if (!grouped) still.push_back(s);
    if (is_cleared) std::erase(v.faulty, s);
  }
  v.suspects = still;
  v.message = absl::StrCat(v.message, cleared.empty() ? "" : absl::StrCat("; round 3 cleared node(s) ", Nodes(cleared)));
  return v;
}

namespace {

// The groups implied by results: nodes that failed together. Returns, for
// each node that failed both rounds, whether another such node failed in the
// same group both times (then the two cannot be told apart).
std::vector<int> Suspects(const std::vector<int>& faulty, const Groups& g1, const Groups& g2) {
  auto group_of = [](const Groups& groups, int node) -> int {
    for (size_t i = 0; i < groups.size(); ++i)
      if (std::find(groups[i].begin(), groups[i].end(), node) != groups[i].end()) return static_cast<int>(i);
    return -1;
  };
  std::vector<int> out;
  for (int a : faulty) {
    for (int b : faulty) {
      if (a != b && group_of(g1, a) == group_of(g1, b) && group_of(g2, a) == group_of(g2, b)) {
        out.push_back(a);
        break;
      }
    }
  }
  return out;
}

}  // namespace

namespace {

// Stragglers among the nodes with a finite best time (faulty ones are +inf),
// measured against the median over them and the reference times, and the
// verdict's message.
void JudgeStragglersAndSummarize(const std::vector<double>& best, double straggler_factor,
                                 const std::vector<double>& reference_times, Verdict* v) {
  const int n = static_cast<int>(best.size());
  std::vector<double> finite;
  for (double t : best)
    if (std::isfinite(t)) finite.push_back(t);
  for (double t : reference_times)
    if (std::isfinite(t)) finite.push_back(t);
  if (finite.empty()) {
    v->message = absl::StrCat("pre-flight check: every node failed (", Nodes(v->faulty), ")");
    return;
  }
  double median = Median(finite);
  for (int i = 0; i < n; ++i) {
    if (std::isfinite(best[i]) && best[i] > straggler_factor * median) v->stragglers.push_back(i);
  }
  if (v->faulty.empty() && v->stragglers.empty()) {
    v->message = absl::StrCat("all ", n, " nodes passed the pre-flight check (median ", median, " s)");
    return;
  }
  std::vector<std::string> parts;
  if (!v->faulty.empty()) parts.push_back(absl::StrCat("faulty node(s) ", Nodes(v->faulty), " failed in both rounds"));
  if (!v->stragglers.empty())
    parts.push_back(absl::StrCat("straggler(s) ", Nodes(v->stragglers), " took more than ", straggler_factor,
                                 "x the median ", median, " s"));
  v->message = absl::StrCat("pre-flight check: ", absl::StrJoin(parts, "; "));
}

}  // namespace

Verdict Judge(const std::vector<NodeResult>& round1, const std::vector<NodeResult>& round2,
              double straggler_factor, const std::vector<double>& reference_times) {
  Verdict v;
  const int n = static_cast<int>(round1.size());
  bool any_failed = std::any_of(round1.begin(), round1.end(), [](const NodeResult& r) { return !r.ok; });
  if (any_failed && n <= 3) {
    v.all_failed = true;
    for (int i = 0; i < n; ++i) v.faulty.push_back(i);
    v.message = absl::StrCat("the pre-flight check failed, and with ", n,
                             " nodes a failure cannot be localized to one node (every grouping pairs it "
                             "with the others): all nodes fail the check; run with at least 4 nodes to "
                             "find the faulty one, or check the nodes by hand");
    return v;
  }
  // Best time of each node over the rounds it passed.
  std::vector<double> best(n, std::numeric_limits<double>::infinity());
  for (int i = 0; i < n; ++i) {
    bool failed1 = !round1[i].ok;
    bool failed2 = !round2.empty() && !round2[i].ok;
    if (failed1 && (round2.empty() || failed2)) {
      v.faulty.push_back(i);
      continue;
    }
    if (round1[i].ok) best[i] = std::min(best[i], round1[i].time_s);
    if (!round2.empty() && round2[i].ok) best[i] = std::min(best[i], round2[i].time_s);
  }
  if (static_cast<int>(v.faulty.size()) == n) {
    // Nothing passed anywhere: not one bad node, but the check program, the
    // software environment or the network of all of them. Excluding every
    // node would only start the same failure on replacements.
    v.all_failed = true;
    v.message = absl::StrCat("every one of the ", n,
                             " nodes failed the pre-flight check in every round: the fault is not in one node "
                             "but in what they share (the check program, the Python/torch installation, the "
                             "network); see each node's error, fix it and start the job again");
    return v;
  }
  if (!round2.empty() && v.faulty.size() > 1) {
    std::vector<double> t1;
    for (const auto& r : round1) t1.push_back(r.time_s);
    v.suspects = Suspects(v.faulty, GroupInOrder(n), GroupFastestWithSlowest(t1));
  }
  JudgeStragglersAndSummarize(best, straggler_factor, reference_times, &v);
  return v;
}

Groups GroupAlone(const std::vector<int>& nodes) {
  Groups g;
  for (int i : nodes) g.push_back({i});
  return g;
}

Verdict JudgeWithAloneRound(const std::vector<NodeResult>& round1, const std::vector<NodeResult>& alone,
                            double straggler_factor, const std::vector<double>& reference_times) {
  Verdict v;
  const int n = static_cast<int>(round1.size());
  std::vector<int> failed1;
  std::vector<double> best(n, std::numeric_limits<double>::infinity());
  for (int i = 0; i < n; ++i) {
    if (!round1[i].ok) {
      failed1.push_back(i);
      if (i < static_cast<int>(alone.size()) && !alone[i].ok) v.faulty.push_back(i);
    } else {
      best[i] = round1[i].time_s;
    }
  }
  bool together = v.faulty.empty() && !failed1.empty();
  if (together) v.faulty = failed1;
  // A node cleared by its alone round is not timed: a check alone skips the
  // network, so its time is not comparable.
  JudgeStragglersAndSummarize(best, straggler_factor, reference_times, &v);
  if (together) {
    v.note = absl::StrCat("node(s) ", Nodes(failed1),
                          " failed together and passed alone: the fault lies on the network path between them, "
                          "so none of them joins");
  } else if (!v.faulty.empty()) {
    v.note = "a node that failed when checked alone is faulty";
  }
  if (!v.note.empty()) v.message = absl::StrCat(v.message, "; ", v.note);
  return v;
}

}  // namespace ballast::health
