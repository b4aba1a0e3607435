#include "agent/warm_starter.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <vector>

#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace ballast::agent {

WarmStarter::WarmStarter(WarmPool* pool, WorkerGroup* workers, int local_world_size, WarmKv kv,
                         std::function<std::string()> log_keys)
    : pool_(pool), workers_(workers), local_world_size_(local_world_size), kv_(std::move(kv)),
      log_keys_(std::move(log_keys)) {}

void WarmStarter::PreloadPublished() {
  absl::StatusOr<std::string> v = kv_.get(kWarmModulesKey);
  if (!v.ok()) return;
  nlohmann::json names = nlohmann::json::parse(*v, nullptr, /*allow_exceptions=*/false);
  std::vector<std::string> modules;
  if (names.is_array()) {
    for (const nlohmann::json& n : names) {
      if (n.is_string()) modules.push_back(n.get<std::string>());
    }
  }
  const size_t before = pool_->preloaded().size();
  pool_->Preload(modules);
  if (pool_->preloaded().size() != before) ready_logged_ = false;
}

void WarmStarter::PrepareNow() {
  if (pool_->disabled()) return;
  if (!kv_read_) {
    kv_read_ = true;
    PreloadPublished();
  }
  ready_logged_ = false;
  const std::map<std::string, std::string> env = workers_->InterpreterEnvironment();
  for (int lr = 0; lr < local_world_size_; ++lr) {
    if (absl::Status s = pool_->Prepare(lr, env); !s.ok()) {
      spdlog::warn("cannot start a warm interpreter for local rank {}: {} {}", lr, std::string(s.message()),
                   log_keys_());
      return;
    }
  }
}

void WarmStarter::WorkersStarted(uint64_t now_ns) { due_ns_ = now_ns + kPrepareFallbackNs; }

void WarmStarter::ProcessGroupsUp(uint64_t now_ns) {
  if (due_ns_ != 0) due_ns_ = std::min(due_ns_, now_ns);
}

void WarmStarter::FirstStep(uint64_t now_ns) {
  if (due_ns_ != 0) due_ns_ = now_ns;
  workers_->RequestModules();
}

void WarmStarter::Learn(uint64_t now_ns) {
  if (learn_again_ns_ != 0 && now_ns >= learn_again_ns_) {
    workers_->RequestModules();
    ++learn_asks_;
    learn_again_ns_ = learn_asks_ < std::size(kLearnAgainNs) ? now_ns + kLearnAgainNs[learn_asks_] : 0;
  }
  workers_->ReadControl();
  std::vector<std::string> learned = workers_->TakeLearnedModules();
  const size_t before = pool_->preloaded().size();
  if (!learned.empty()) pool_->Preload(learned);
  if (pool_->preloaded().size() == before) return;
  ready_logged_ = false;
  // For the nodes that join later (replacements). Best effort.
  const nlohmann::json names = pool_->preloaded();
  if (absl::Status s = kv_.set(kWarmModulesKey, names.dump()); !s.ok()) {
    spdlog::debug("cannot publish the learned warm modules: {} {}", s.ToString(), log_keys_());
  }
}

void WarmStarter::Poll(uint64_t now_ns, bool workers_running) {
  if (workers_running) {
    Learn(now_ns);
  } else if (!pool_->disabled() && now_ns >= kv_again_ns_) {
    // A hot spare's interpreters were prepared at its join, before the
    // training workers imported what their first steps need (torch 2.x: DDP
    // brings torch._dynamo, seconds of imports): take those in as the
    // others publish them, so a promoted spare starts as warm as they would.
    kv_again_ns_ = now_ns + kKvAgainNs;
    PreloadPublished();
  }
  pool_->Poll();
  if (pool_->disabled() && !disabled_logged_) {
    disabled_logged_ = true;
    spdlog::warn("warm restart off for this node: {}; workers start cold {}", pool_->disabled_reason(), log_keys_());
  }
  if (due_ns_ != 0 && now_ns >= due_ns_) {
    due_ns_ = 0;
    PrepareNow();
    // What the workers imported so far, and again later for what their
    // first steps bring (the first step itself asks too).
    workers_->RequestModules();
    learn_asks_ = 0;
    learn_again_ns_ = now_ns + kLearnAgainNs[0];
  }
  if (!ready_logged_ && !pool_->disabled()) {
    bool all = true;
    for (int lr = 0; lr < local_world_size_; ++lr) all = all && pool_->ready(lr);
    if (all) {
      ready_logged_ = true;
      spdlog::info("warm interpreters ready for the next (re)start ({} local ranks, {} modules the workers "
                   "imported preloaded) {}",
                   local_world_size_, pool_->preloaded().size(), log_keys_());
    }
  }
}

}  // namespace ballast::agent
