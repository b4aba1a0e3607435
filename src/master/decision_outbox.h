// DecisionOutboxes: every node's decisions and the Watch stream that drains
// them; one component of the JobMaster (job_master.h).
//
// A node's outbox keeps its current decision (the last one that is a state,
// not a transition: StartRound, Wait, RunCheck, Excluded, JobFinished; not
// StopWorkers), which a reconnecting agent's new stream gets first. While a
// Watch stream is open, each new decision goes to it: to its Sink (the
// callback server: Deliver only queues an asynchronous write, no I/O here) or
// to a queue that Next() drains (the blocking API, tests). A newer Watch for
// the node ends the older stream (CANCELLED); a node that is gone ends its
// stream with NOT_FOUND; Shutdown() ends every stream with UNAVAILABLE.
//
// Ownership: the outboxes own their state; a Handle shares ownership of its
// outbox, so it stays valid after the node is gone (its stream then ends).
//
// Threading: no lock of its own. Every call runs under the owner's lock (the
// JobMaster's mu_), and Next() releases that lock while it waits.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ballast/v1/master.pb.h"
#include "common/ids.h"

namespace ballast::master {

class DecisionOutboxes {
 public:
  // The receiving end of a Watch stream on the callback server. Both calls
  // come with the owner's lock held: they must only queue (start an
  // asynchronous write), never block or call back into the master.
  class Sink {
   public:
    virtual ~Sink() = default;
    virtual void Deliver(const v1::Decision& decision) = 0;
    // The stream must end with `status`: CANCELLED (a newer Watch replaced
    // it), NOT_FOUND (the node is gone), UNAVAILABLE (shutdown).
    virtual void End(const absl::Status& status) = 0;
  };
  struct Outbox;
  // A Watch stream's hold on its node's outbox; a newer Open for the same
  // node makes older handles stale.
  struct Handle {
    NodeId node_id;
    std::shared_ptr<Outbox> outbox;
    uint64_t generation = 0;
  };

  // A fresh outbox for a node that joined (replacing any it had).
  void Add(const NodeId& node_id);
  bool Contains(const NodeId& node_id) const { return outboxes_.count(node_id) > 0; }
  // Every node with an outbox, in id order.
  std::vector<NodeId> Nodes() const;

  // Queues `d` for the node's stream and makes it the node's current
  // decision unless it is a transition (StopWorkers). No-op for a node
  // without an outbox; returns whether it had one.
  bool Push(const NodeId& node_id, v1::Decision d);
  // The node is gone: its open stream ends with NOT_FOUND naming `reason`,
  // and its outbox is dropped.
  void Remove(const NodeId& node_id, const std::string& reason);
  // A node restored from the journal: `current` is what its agent gets when
  // it reconnects; until then it counts as a stream yet to be sent JobFinished.
  void Restore(const NodeId& node_id, v1::Decision current);

  // Starts a stream for the node (replacing, and ending, an older one): its
  // current decision goes first, to `sink` (nullptr: the queue Next reads).
  // NOT_FOUND for a node without an outbox. *replaced tells whether an older
  // stream was open.
  absl::StatusOr<Handle> Open(const NodeId& node_id, std::shared_ptr<Sink> sink, bool* replaced);
  // The stream's next decision, or nullopt after timeout_s (real time)
  // without one; waits on `mu` (the owner's lock, held by the caller). An
  // error means the stream must end with it: CANCELLED (replaced), NOT_FOUND
  // (gone), UNAVAILABLE (shutdown).
  absl::StatusOr<std::optional<v1::Decision>> Next(const Handle& handle, double timeout_s, absl::Mutex* mu);
  // The stream wrote the final JobFinished to its agent.
  void MarkFinalSent(const Handle& handle);
  // The stream ended (a no-op for a stale handle): the node counts as
  // disconnected from `now` until it opens another. True when this close
  // made it disconnected (its current outbox, not removed, not already).
  bool Close(const Handle& handle, double now);
  // Ends every stream with UNAVAILABLE; later Next calls return it too.
  void Shutdown();

  // True when every open stream (and every restored node yet to reconnect)
  // has been sent JobFinished; vacuously true with none.
  bool AllFinalSent() const;
  // Whether the node's last stream closed and no newer one opened.
  bool Disconnected(const NodeId& node_id) const;
  // Whether any node is Disconnected(): O(1) (a failure report asks about
  // every other member of the round).
  bool AnyDisconnected() const { return disconnected_ > 0; }
  // Nodes disconnected for at least grace_s at `now`, in id order.
  std::vector<NodeId> DisconnectedFor(double now, double grace_s) const;
  // Decisions pushed so far (any node).
  uint64_t pushed() const { return pushed_; }

 private:
  static void EndStream(Outbox* ob, const absl::Status& status);
  static absl::Status GoneStatus(const NodeId& node_id, const Outbox& ob);

  // By hash: a push, a take and a connection check per node and decision (a
  // tree's string compares were much of a round's cost at 10,000 nodes);
  // what lists nodes sorts them.
  absl::flat_hash_map<NodeId, std::shared_ptr<Outbox>> outboxes_;
  uint64_t pushed_ = 0;
  size_t disconnected_ = 0;  // outboxes with disconnected_since set
  bool shutdown_ = false;
};

// One node's outbox. Its fields are guarded by the owner's lock.
struct DecisionOutboxes::Outbox {
  std::deque<v1::Decision> queue;        // not yet taken by the open stream (without a sink)
  std::shared_ptr<Sink> sink;            // the open stream's, when it has one
  std::optional<v1::Decision> current;   // the node's state: what a new stream gets first
  uint64_t generation = 0;               // bumped by every Open
  bool watcher_active = false;
  bool final_sent = false;               // the open stream wrote JobFinished
  bool closed = false;                   // the node is gone
  std::optional<double> disconnected_since;  // when the open stream closed
  std::string closed_reason;
  bool awaiting_reconnect = false;       // restored from the journal; no stream opened yet
  absl::CondVar cv;
};

}  // namespace ballast::master
