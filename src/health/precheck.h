// Pre-flight check planning and verdicts (pure logic; the master drives it).
//
// Nodes run a short matmul + allreduce benchmark in groups. A group fails as a
// whole when any member fails (the collective breaks for everyone), so one
// round cannot tell which member is bad. Two rounds with different groupings
// can:
//   round 1 groups nodes in order: {0,1}, {2,3}, ... (an odd node joins the
//           last group);
//   round 2 pairs the fastest with the slowest of round 1 (failed nodes count
//           as slowest), so a bad node meets new partners.
// A node whose group failed in both rounds is faulty. Groups of 2 cannot
// always separate a failed group of 3 (5 nodes, the bad one among the last
// three): when two nodes failed both rounds *together*, the verdict asks for a
// third round that checks each such suspect with a healthy node
// (GroupSuspectsWithHealthy, RefineWithSuspectRound). A node whose time is
// more than `straggler_factor` x the median time is a straggler. With 3 nodes
// or fewer a failure cannot be localized (every grouping contains the bad
// node's partners), so then every node fails the check, and the verdict says
// why.
//
// Nodes are indices 0..n-1 in node-rank order. Thread safety: stateless.
#pragma once

#include <limits>
#include <string>
#include <vector>

namespace ballast::health {

using Groups = std::vector<std::vector<int>>;

// Round 1: {0,1}, {2,3}, ...; an odd node joins the last group. n >= 2.
Groups GroupInOrder(int n);

// Round 2: node order by round-1 time ascending (failed = +inf; ties by
// index); the i-th fastest with the i-th slowest; with an odd count the middle
// node joins the last group.
Groups GroupFastestWithSlowest(const std::vector<double>& round1_times);

// One node's result in one round. time_s is +inf for a failed node.
struct NodeResult {
  bool ok = false;
  double time_s = std::numeric_limits<double>::infinity();
};

// Applies group failure: every member of a group with a failed member failed.
std::vector<NodeResult> ApplyGroupFailure(const Groups& groups, std::vector<NodeResult> results);

struct Verdict {
  std::vector<int> faulty;      // failed both rounds (see suspects)
  // Faulty nodes that shared a failed group with another faulty node in both
  // rounds: one of them may be healthy. Empty when the verdict is final.
  std::vector<int> suspects;
  std::vector<int> stragglers;  // time > factor x median (and not faulty)
  bool all_failed = false;      // the job fails: <= 3 nodes with a failure (nothing could
                                // be localized), or every node failed every round
  std::string message;          // human summary, says why
  std::string note;             // extra explanation, also at the end of message
};

// round1/round2: per node, after ApplyGroupFailure. round2 may be empty when
// round 1 passed everywhere (no second round is needed for faults; stragglers
// are judged on round 1 alone). `reference_times` are best times of nodes
// checked earlier (a check of joining nodes); they count toward the median
// that stragglers are measured against.
Verdict Judge(const std::vector<NodeResult>& round1, const std::vector<NodeResult>& round2,
              double straggler_factor = 2.0, const std::vector<double>& reference_times = {});

// A check of nodes that join a running job (the members are busy training,
// so the joiners are checked among themselves). With 3 joiners or fewer a
// failed group cannot be split by regrouping, so the nodes that failed round 1
// are checked alone in round 2: GroupAlone gives one group per node.
Groups GroupAlone(const std::vector<int>& nodes);

// Verdict of such a check: a node that failed alone is faulty. When every node
// that failed round 1 passed alone, the fault lies between them (the network
// path), and all of them are faulty: none of them may join. round1/alone as in
// Judge (alone holds results only for the nodes that ran alone).
Verdict JudgeWithAloneRound(const std::vector<NodeResult>& round1, const std::vector<NodeResult>& alone,
                            double straggler_factor, const std::vector<double>& reference_times);

// Round 3 groups: each suspect with its own healthy node (not faulty, not a
// suspect), fastest healthy first. Suspects left without a healthy partner
// (too few healthy nodes) stay unresolved and are not grouped.
Groups GroupSuspectsWithHealthy(const Verdict& verdict, const std::vector<double>& best_times);

// Applies round 3 (per node, after ApplyGroupFailure; only grouped nodes
// matter): a suspect whose group passed is healthy after all.
Verdict RefineWithSuspectRound(Verdict verdict, const Groups& round3_groups,
                               const std::vector<NodeResult>& round3);

}  // namespace ballast::health
