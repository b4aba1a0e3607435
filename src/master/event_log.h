// EventLog: the job's timeline (rounds, failures, nodes joining and lost, the
// end), numbered so a reader asks for what came after the last entry it saw
// and waits for the next (GET /api/v1/events long-polls here).
//
// Thread safety: all methods are thread-safe. It has its own lock, so a
// waiting reader never holds the job master's; JobMaster appends under its
// lock (the EventLog lock nests inside it, never the other way round).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "ballast/v1/master.pb.h"
#include "common/clock.h"

namespace ballast::master {

class EventLog {
 public:
  static constexpr size_t kMaxEvents = 10000;  // the oldest are dropped beyond this

  // `start` is the job's start on `clock` (at_s counts from it).
  EventLog(ClockInterface* clock, double start);

  // Appends an event stamped now; returns its seq.
  int64_t Append(std::string kind, int64_t round, std::string node_id, std::string message);
  // Events with seq > after (at most max_events), waiting up to wait_s for the
  // first when there is none yet. Empty when none came (or Close()).
  std::vector<v1::Event> After(int64_t after, double wait_s, size_t max_events = 1000) const;
  int64_t last_seq() const;
  // Wakes and ends every waiting After (the master is stopping).
  void Close();

 private:
  ClockInterface* clock_;
  const double start_;
  mutable absl::Mutex mu_;
  std::deque<v1::Event> events_ ABSL_GUARDED_BY(mu_);
  int64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ballast::master
