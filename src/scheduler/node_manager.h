// NodeManager: the one replacement policy, for every scheduler backend.
//
// It keeps one live node per node rank (ranks 0..initial_nodes-1: MAX plus
// spares) and replaces a node when it is gone: its agent exited, the
// scheduler lost it (pod deleted or evicted, host down), or the master lost
// it (agent silent or disconnected, left) or excluded it (failed the
// pre-flight check). A replacement is the rank's next incarnation, placed
// away from every host where a node was excluded, as long as the replacement
// budget lasts; a node the master lost while its agent still runs is released
// first (no two agents of one rank). An excluded node's agent exits by itself
// once it has dropped the steps a rollback discards and written the rollback
// target (the replacement reads it from disk): it is released only if it still
// runs excluded_exit_s after the exclusion (hung, or cut off from the master),
// so that a stop cannot overtake that write; its replacement starts once it
// exited (or was released), so that the replacement's ranks cannot look for
// the target before it is written. Once the job finished nothing is
// replaced, nor is a node whose agent exited 0 (an agent does that only when
// the job succeeded). Nodes pending past the backend's timeout are reported, and kept:
// the job goes on with the nodes it has (the master scales down to >= MIN) and
// the late node joins when it starts (scale up).
//
// Early replacements (NodeManagerOptions::early_replacement; `ballast ray
// run`): when the master says a node's agent hung up its stream, the node is
// probably gone (its host died with every process on it), but the master
// declares it lost only after the backend's death notice or its reconnect
// grace. The rank's next incarnation starts at once, so that its placement,
// agent and warm interpreters overlap that wait; it joins the master as a
// waiting node. If the node is then lost, the early one is its replacement
// (counted then) and the master takes it into the next world at once; if the
// node is still there early_keep_s later (it reconnected), the early one is
// released. An early one that ends before it is needed is forgotten.
//
// Threading: Poll() and Start() run on one thread (the launcher's loop), which
// also drives the scheduler. OnNodeLost / OnNodeExcluded / OnNodeDisconnected may be called from
// any thread, including with the master's lock held: they only queue.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "scheduler/scheduler.h"

namespace ballast::scheduler {

struct NodeManagerOptions {
  int initial_nodes = 1;     // node ranks 0..initial_nodes-1
  int max_replacements = 3;  // nodes replaced before giving up
  double release_grace_s = 5;
  // How long an excluded node's agent has to exit by itself before it is
  // released (see the file comment).
  double excluded_exit_s = 10;
  // Seconds on a monotonic clock (tests pass their own).
  std::function<double()> now = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  };
  // The node's name (and agent node id) for an incarnation of a rank.
  std::function<std::string(int node_rank, int incarnation)> name = [](int rank, int inc) {
    return "node-" + std::to_string(rank) + (inc > 1 ? "-" + std::to_string(inc) : "");
  };
  // Told about what the manager did, for the user (Kubernetes events):
  // reason is a CamelCase word (NodeReplaced, ReplacementsUsedUp, NodePending,
  // NodeExcluded), warning selects the event type.
  std::function<void(const std::string& reason, const std::string& message, bool warning)> on_event;
  // Told when the scheduler reports a node of the job lost (NodeEvent::kLost)
  // while the job runs, before the node is released and replaced: the
  // master hears it at once, not when the node's heartbeats run out.
  std::function<void(const std::string& node_id, const std::string& reason)> on_scheduler_lost;
  // Start a node's replacement when its agent disconnects from the master,
  // ahead of the loss (file comment); released when the node is still there
  // early_keep_s later.
  bool early_replacement = false;
  double early_keep_s = 30;
};

class NodeManager {
 public:
  NodeManager(SchedulerInterface* scheduler, NodeManagerOptions options);

  // Launches the initial nodes. An error when a launch is refused. The ranks
  // of nodes the backend adopted (SchedulerInterface::AdoptedNodes: a master
  // that resumed from its journal) keep their newest incarnation instead, and
  // the replacements those incarnations stand for count against the budget.
  absl::Status Start();

  // Thread-safe, non-blocking (see the file comment).
  void OnNodeLost(const std::string& node_id, const std::string& reason);
  void OnNodeExcluded(const std::string& node_id, const std::string& reason);
  void OnNodeDisconnected(const std::string& node_id);

  // Takes the scheduler's events and the queued notices and acts on them.
  // With job_finished, ended nodes are not replaced any more.
  void Poll(bool job_finished);

  int replacements() const { return replacements_; }
  // No node runs or is launching, and none will be replaced: the job cannot
  // go on (every agent ended, and the budget is used up or a launch failed).
  bool Exhausted() const;
  // Where nodes were excluded (replacements avoid these hosts).
  const std::set<std::string>& avoid_hosts() const { return avoid_hosts_; }
  // "node-3 (node rank 3, host h)": how messages name a node.
  std::string Describe(const std::string& name) const;

 private:
  struct Slot {
    int node_rank = 0;
    int incarnation = 0;
    std::string name;  // the current node of this rank; "" when none
    std::string host;
    bool ended = false;  // the current node is gone (and was not replaced)
    // An early replacement of the current node (file comment): its name, its
    // incarnation and when it was started; "" when none.
    std::string early;
    int early_incarnation = 0;
    double early_since = 0;
  };
  enum class NoticeKind { kLost, kExcluded, kDisconnected };
  struct Notice {
    std::string node_id;
    std::string reason;
    NoticeKind kind = NoticeKind::kLost;
  };
  // The node is gone: release it if it may still run (after release_after_s,
  // unless it exits by then), then replace it.
  void Gone(const std::string& name, const std::string& cause, bool still_running, bool job_finished,
            double release_after_s = 0);
  // Starts the replacement of `slot`'s node `name` (gone: cause) while the budget lasts.
  void Replace(Slot& slot, const std::string& name, const std::string& cause);
  // Stops a node that may still run (a gone one is fine).
  void Release(const std::string& name, const std::string& cause);
  // Releases the deferred nodes whose time came; forgets those that exited;
  // replaces both (unless the job finished).
  void ReleaseDeferred(const std::vector<NodeEvent>& events, bool job_finished);
  absl::Status Launch(Slot* slot);
  // The launch request of `slot`'s rank at `incarnation` (its name now known as the rank's).
  NodeRequest Request(const Slot& slot, int incarnation);
  // The incarnation `slot`'s next launch gets (past any early one's).
  static int NextIncarnation(const Slot& slot);
  // Releases `slot`'s early replacement and forgets it.
  void DropEarly(Slot& slot, const std::string& why);
  // Starts `slot`'s next incarnation as an early replacement of its node.
  void StartEarly(Slot* slot, const std::string& why);
  // Releases early replacements whose node is still there after early_keep_s.
  void ExpireEarly();
  void Event(const std::string& reason, const std::string& message, bool warning);

  SchedulerInterface* const scheduler_;
  const NodeManagerOptions options_;
  std::map<int, Slot> slots_;                 // by node rank
  std::map<std::string, int> rank_of_;        // every node name ever launched -> rank
  std::map<std::string, std::string> hosts_;  // node name -> host it ran on
  std::set<std::string> handled_;             // nodes already released / replaced
  struct Deferred {
    double at = 0;  // options_.now() when it is released
    std::string cause;
    bool replace = false;  // replace it once it exited or was released
  };
  std::map<std::string, Deferred> deferred_;  // excluded nodes given time to exit by themselves
  std::set<std::string> avoid_hosts_;
  int replacements_ = 0;
  std::mutex mu_;
  std::vector<Notice> notices_;  // guarded by mu_
};

// The master's node callbacks (MasterOptions::on_node_lost, on_node_excluded),
// forwarding to the NodeManager in *slot once it is set: the manager is made
// after the master (it needs the master's address), before any agent starts,
// so nothing is lost in between.
struct NodeCallbacks {
  std::function<void(const std::string& node_id, const std::string& reason)> lost;
  std::function<void(const std::string& node_id, const std::string& reason)> excluded;
  std::function<void(const std::string& node_id)> disconnected;
};
NodeCallbacks ForwardTo(std::atomic<NodeManager*>* slot);

}  // namespace ballast::scheduler
