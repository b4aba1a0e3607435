#include "master/decision_outbox.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ballast::master {

void DecisionOutboxes::Add(const NodeId& node_id) {
  std::shared_ptr<Outbox>& ob = outboxes_[node_id];
  if (ob != nullptr && ob->disconnected_since.has_value()) --disconnected_;
  ob = std::make_shared<Outbox>();
}

std::vector<NodeId> DecisionOutboxes::Nodes() const {
  std::vector<NodeId> ids;
  ids.reserve(outboxes_.size());
  for (const auto& [id, ob] : outboxes_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

bool DecisionOutboxes::Push(const NodeId& node_id, v1::Decision d) {
  auto it = outboxes_.find(node_id);
  if (it == outboxes_.end()) return false;
  Outbox& ob = *it->second;
  ++pushed_;
  // StopWorkers is a transition, not a state: a reconnecting agent needs the
  // Wait or StartRound that follows it, not the stop itself.
  const bool state = !d.has_stop_workers();
  // Without an open stream there is nothing to queue: Open starts the next
  // stream from `current`. A decision is copied only when both the queue and
  // `current` keep it (a round pushes one per node).
  if (!ob.watcher_active) {
    if (state) ob.current = std::move(d);
    return true;
  }
  if (ob.sink != nullptr) {
    ob.sink->Deliver(d);  // queues an asynchronous write
    if (state) ob.current = std::move(d);
    return true;
  }
  if (state) ob.current = d;
  ob.queue.push_back(std::move(d));
  ob.cv.SignalAll();
  return true;
}

void DecisionOutboxes::EndStream(Outbox* ob, const absl::Status& status) {
  if (ob->sink != nullptr) {
    ob->sink->End(status);
    ob->sink.reset();
  }
  ob->cv.SignalAll();
}

absl::Status DecisionOutboxes::GoneStatus(const NodeId& node_id, const Outbox& ob) {
  return absl::NotFoundError(
      absl::StrCat("node ", node_id.str(), " is no longer part of the job (", ob.closed_reason, "): join again"));
}

void DecisionOutboxes::Remove(const NodeId& node_id, const std::string& reason) {
  auto it = outboxes_.find(node_id);
  if (it == outboxes_.end()) return;
  Outbox& ob = *it->second;
  ob.closed = true;
  ob.closed_reason = reason;
  EndStream(&ob, GoneStatus(node_id, ob));
  if (ob.disconnected_since.has_value()) --disconnected_;
  outboxes_.erase(it);
}

void DecisionOutboxes::Restore(const NodeId& node_id, v1::Decision current) {
  auto it = outboxes_.find(node_id);
  if (it == outboxes_.end()) return;
  it->second->current = std::move(current);
  it->second->awaiting_reconnect = true;
}

absl::StatusOr<DecisionOutboxes::Handle> DecisionOutboxes::Open(const NodeId& node_id,
                                                                 std::shared_ptr<Sink> sink, bool* replaced) {
  if (shutdown_) return absl::UnavailableError("the job master is shutting down");
  auto it = outboxes_.find(node_id);
  if (it == outboxes_.end()) return absl::NotFoundError(absl::StrCat("unknown node ", node_id.str(), ": join again"));
  Outbox& ob = *it->second;
  *replaced = ob.watcher_active;
  // The older stream ends: a sink is told, a Next sees the new generation.
  EndStream(&ob, absl::CancelledError(absl::StrCat("replaced by a newer Watch for node ", node_id.str())));
  ++ob.generation;
  ob.watcher_active = true;
  if (ob.disconnected_since.has_value()) --disconnected_;
  ob.disconnected_since.reset();
  ob.awaiting_reconnect = false;
  ob.final_sent = false;
  ob.queue.clear();
  ob.sink = std::move(sink);
  if (ob.current.has_value()) {
    if (ob.sink != nullptr) {
      ob.sink->Deliver(*ob.current);
    } else {
      ob.queue.push_back(*ob.current);
    }
  }
  return Handle{node_id, it->second, ob.generation};
}

absl::StatusOr<std::optional<v1::Decision>> DecisionOutboxes::Next(const Handle& handle, double timeout_s,
                                                                   absl::Mutex* mu) {
  Outbox& ob = *handle.outbox;
  std::optional<absl::Time> deadline;  // taken once there is something to wait for
  while (true) {
    if (shutdown_) return absl::UnavailableError("the job master is shutting down");
    if (ob.generation != handle.generation) {
      return absl::CancelledError(absl::StrCat("replaced by a newer Watch for node ", handle.node_id.str()));
    }
    if (ob.closed) return GoneStatus(handle.node_id, ob);
    if (!ob.queue.empty()) {
      v1::Decision d = std::move(ob.queue.front());
      ob.queue.pop_front();
      return std::optional<v1::Decision>(std::move(d));
    }
    if (timeout_s <= 0) return std::optional<v1::Decision>();
    const absl::Time now = absl::Now();
    if (!deadline.has_value()) deadline = now + absl::Seconds(timeout_s);
    if (now >= *deadline) return std::optional<v1::Decision>();
    ob.cv.WaitWithTimeout(mu, *deadline - now);
  }
}

void DecisionOutboxes::MarkFinalSent(const Handle& handle) {
  if (handle.outbox->generation == handle.generation) handle.outbox->final_sent = true;
}

bool DecisionOutboxes::Close(const Handle& handle, double now) {
  Outbox& ob = *handle.outbox;
  if (ob.generation != handle.generation) return false;
  ob.watcher_active = false;
  ob.queue.clear();
  ob.sink.reset();
  if (ob.closed) return false;
  // Counted while it is the node's outbox (a re-join's Add replaced an older one).
  auto it = outboxes_.find(handle.node_id);
  const bool newly = !ob.disconnected_since.has_value() && it != outboxes_.end() && it->second.get() == &ob;
  if (newly) ++disconnected_;
  ob.disconnected_since = now;
  return newly;
}

void DecisionOutboxes::Shutdown() {
  shutdown_ = true;
  for (auto& [id, ob] : outboxes_) EndStream(ob.get(), absl::UnavailableError("the job master is shutting down"));
}

bool DecisionOutboxes::AllFinalSent() const {
  for (const auto& [id, ob] : outboxes_) {
    // (A node restored from the journal counts until its agent reconnected.)
    if ((ob->watcher_active || ob->awaiting_reconnect) && !ob->final_sent) return false;
  }
  return true;
}

bool DecisionOutboxes::Disconnected(const NodeId& node_id) const {
  auto it = outboxes_.find(node_id);
  return it != outboxes_.end() && it->second->disconnected_since.has_value();
}

std::vector<NodeId> DecisionOutboxes::DisconnectedFor(double now, double grace_s) const {
  std::vector<NodeId> ids;
  if (disconnected_ == 0) return ids;
  for (const auto& [id, ob] : outboxes_) {
    if (ob->disconnected_since.has_value() && now - *ob->disconnected_since >= grace_s) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace ballast::master
