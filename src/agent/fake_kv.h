// Tests only: a thread-safe map standing in for the master's KV store, with
// the setter and getter shapes the agent's components take.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast::agent {

struct FakeKv {
  std::mutex mu;
  std::map<std::string, std::string> kv;
  std::function<absl::Status(const std::string&, const std::string&)> Setter() {
    return [this](const std::string& k, const std::string& v) {
      std::lock_guard<std::mutex> lock(mu);
      kv[k] = v;
      return absl::OkStatus();
    };
  }
  std::function<absl::StatusOr<std::string>(const std::string&)> Getter() {
    return [this](const std::string& k) -> absl::StatusOr<std::string> {
      std::lock_guard<std::mutex> lock(mu);
      auto it = kv.find(k);
      if (it == kv.end()) return absl::NotFoundError(k);
      return it->second;
    };
  }
  // "" when unset.
  std::string Get(const std::string& k) {
    std::lock_guard<std::mutex> lock(mu);
    return kv.count(k) ? kv[k] : "";
  }
};

}  // namespace ballast::agent
