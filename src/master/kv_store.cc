#include "master/kv_store.h"

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/status_macros.h"

namespace ballast::master {

void KvStore::RunAnswers(Answers* answers) {
  for (auto& [fn, answer] : *answers) fn(std::move(answer));
  answers->clear();
}

absl::Status KvStore::CheckEntry(const std::string& key, const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("KvSet needs a non-empty key");
  if (key.size() > kMaxKvKeyBytes || value.size() > kMaxKvValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("KvSet of a ", key.size(), "-byte key and a ", value.size(),
                                                   "-byte value: keys are at most ", kMaxKvKeyBytes,
                                                   " bytes, values at most ", kMaxKvValueBytes));
  }
  return absl::OkStatus();
}

absl::Status KvStore::CanSet(const std::string& key) const {
  if (entries_.size() >= kMaxKvKeys && entries_.count(key) == 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the master's KV store holds ", entries_.size(), " keys, its limit: KvSet of a new key refused"));
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(const std::string& key, std::string value, Answers* woken) {
  RETURN_IF_ERROR(CanSet(key));
  const std::string& stored = entries_[key] = std::move(value);
  std::vector<uint64_t> ids;
  for (auto [it, end] = by_key_.equal_range(key); it != end; ++it) ids.push_back(it->second);
  for (uint64_t id : ids) {
    if (auto it = waiters_.find(id); it != waiters_.end()) woken->emplace_back(Remove(it).done, stored);
  }
  return absl::OkStatus();
}

const std::string* KvStore::Find(const std::string& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : &it->second;
}

uint64_t KvStore::AddWaiter(const std::string& key, absl::Time deadline, Callback done) {
  const uint64_t id = next_id_++;
  waiters_[id] = Waiter{key, deadline, std::move(done)};
  by_key_.emplace(key, id);
  deadlines_.emplace(deadline, id);
  return id;
}

KvStore::Waiter KvStore::Remove(std::map<uint64_t, Waiter>::iterator it) {
  const uint64_t id = it->first;
  Waiter w = std::move(it->second);
  waiters_.erase(it);
  deadlines_.erase({w.deadline, id});
  for (auto [k, end] = by_key_.equal_range(w.key); k != end; ++k) {
    if (k->second == id) {
      by_key_.erase(k);
      break;
    }
  }
  return w;
}

KvStore::Callback KvStore::TakeWaiter(uint64_t id) {
  auto it = waiters_.find(id);
  return it == waiters_.end() ? Callback() : Remove(it).done;
}

void KvStore::TakeExpired(absl::Time now, Answers* out) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    Waiter w = Remove(waiters_.find(deadlines_.begin()->second));
    out->emplace_back(std::move(w.done),
                      absl::DeadlineExceededError(absl::StrCat("key ", w.key, " is not set after waiting")));
  }
}

void KvStore::TakeAll(const absl::Status& why, Answers* out) {
  while (!waiters_.empty()) out->emplace_back(Remove(waiters_.begin()).done, why);
}

}  // namespace ballast::master
