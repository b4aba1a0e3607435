// KvStore: the job's key-value store (round endpoints, replica records, check
// endpoints) and the KvGet waiters of the callback server: each waiter is
// answered exactly once - by the Set of its key, its deadline, a cancel or
// the end of the store.
//
// Bounded (common/limits.h): keys and values have a maximum size and the
// store a maximum number of keys.
//
// Ownership: owns its entries and waiters. Thread safety: none; the JobMaster
// serializes access under its lock and runs the answers (TakeX fills a list)
// after releasing it, so a waiter's callback never runs under the lock.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ballast::master {

class KvStore {
 public:
  using Callback = std::function<void(absl::StatusOr<std::string>)>;
  // Answers to run (outside the lock): RunAnswers.
  using Answers = std::vector<std::pair<Callback, absl::StatusOr<std::string>>>;
  static void RunAnswers(Answers* answers);

  // INVALID_ARGUMENT for an empty or oversized key or value.
  static absl::Status CheckEntry(const std::string& key, const std::string& value);
  // RESOURCE_EXHAUSTED for a new key when the store is full.
  absl::Status CanSet(const std::string& key) const;
  // Sets the key (CanSet first) and takes its waiters' answers.
  absl::Status Set(const std::string& key, std::string value, Answers* woken);
  const std::string* Find(const std::string& key) const;
  const std::map<std::string, std::string>& entries() const { return entries_; }

  // Registers a waiter for a key that is not set; returns its id (> 0).
  uint64_t AddWaiter(const std::string& key, absl::Time deadline, Callback done);
  // The waiter's callback, taken out (nullptr when it was answered already).
  Callback TakeWaiter(uint64_t id);
  // Answers of the waiters whose deadline passed (DEADLINE_EXCEEDED).
  void TakeExpired(absl::Time now, Answers* out);
  // Answers of every waiter (`why`, e.g. UNAVAILABLE at shutdown).
  void TakeAll(const absl::Status& why, Answers* out);
  size_t waiters() const { return waiters_.size(); }

 private:
  struct Waiter {
    std::string key;
    absl::Time deadline;
    Callback done;
  };
  // Removes the waiter from every index; returns it.
  Waiter Remove(std::map<uint64_t, Waiter>::iterator it);

  std::map<std::string, std::string> entries_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Waiter> waiters_;                   // by id
  std::multimap<std::string, uint64_t> by_key_;          // key -> ids
  std::set<std::pair<absl::Time, uint64_t>> deadlines_;  // (deadline, id)
};

}  // namespace ballast::master
