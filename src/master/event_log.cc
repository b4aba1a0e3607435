#include "master/event_log.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ballast::master {

EventLog::EventLog(ClockInterface* clock, double start) : clock_(clock), start_(start) {}

int64_t EventLog::Append(std::string kind, int64_t round, std::string node_id, std::string message) {
  v1::Event e;
  e.set_at_s(clock_->Now() - start_);
  e.set_unix_ms(absl::ToUnixMillis(absl::Now()));
  e.set_kind(std::move(kind));
  e.set_round(round);
  e.set_node_id(std::move(node_id));
  e.set_message(std::move(message));
  absl::MutexLock lock(&mu_);
  e.set_seq(next_seq_++);
  events_.push_back(std::move(e));
  if (events_.size() > kMaxEvents) events_.pop_front();
  return events_.back().seq();
}

std::vector<v1::Event> EventLog::After(int64_t after, double wait_s, size_t max_events) const {
  absl::MutexLock lock(&mu_);
  auto has_new = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_ || next_seq_ - 1 > after; };
  if (wait_s > 0) {
    mu_.AwaitWithTimeout(absl::Condition(&has_new), absl::Seconds(wait_s));
  }
  std::vector<v1::Event> out;
  // Seqs are consecutive: the first wanted one is at a computable index.
  int64_t first_seq = events_.empty() ? next_seq_ : events_.front().seq();
  size_t i = after + 1 > first_seq ? static_cast<size_t>(after + 1 - first_seq) : 0;
  for (; i < events_.size() && out.size() < max_events; ++i) out.push_back(events_[i]);
  return out;
}

int64_t EventLog::last_seq() const {
  absl::MutexLock lock(&mu_);
  return next_seq_ - 1;
}

void EventLog::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

}  // namespace ballast::master
