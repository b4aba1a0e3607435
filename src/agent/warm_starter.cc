#include "agent/warm_starter.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/module_list.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace ballast::agent {

WarmStarter::WarmStarter(WarmPool* pool, WorkerGroup* workers, int local_world_size, WarmKv kv,
                         std::function<std::string()> log_keys)
    : pool_(pool), workers_(workers), local_world_size_(local_world_size), kv_(std::move(kv)),
      log_keys_(std::move(log_keys)) {}

void WarmStarter::KeepModulesBetweenRuns(const std::string& python, const std::string& script, bool module) {
  namespace fs = std::filesystem;
  // The interpreter as the workers run it: a bare name resolved on PATH, a
  // venv's bin/python kept as it is (not resolved to the python it links
  // to: another venv is another set of packages).
  std::string py = python;
  if (py.find('/') == std::string::npos) {
    const char* path = std::getenv("PATH");
    for (absl::string_view dir : absl::StrSplit(path == nullptr ? "" : path, ':', absl::SkipEmpty())) {
      fs::path candidate = fs::path(std::string(dir)) / py;
      if (access(candidate.c_str(), X_OK) == 0) {
        py = candidate.string();
        break;
      }
    }
  }
  std::error_code ec;
  if (py.find('/') != std::string::npos) py = fs::absolute(py, ec).lexically_normal().string();
  std::string target = script;
  if (module) {
    // -m resolves the module from the working directory.
    target = absl::StrCat("-m ", script, " in ", fs::current_path(ec).string());
  } else {
    fs::path p = fs::weakly_canonical(fs::absolute(script, ec), ec);
    if (!ec) target = p.string();
  }
  set_module_file(ModuleListFile(BallastCacheDir(), py, target), py, target);
}

void WarmStarter::set_module_file(std::string path, std::string python, std::string target) {
  module_file_ = std::move(path);
  module_python_ = std::move(python);
  module_target_ = std::move(target);
}

bool WarmStarter::Report(const std::vector<std::string>& names) {
  bool grew = false;
  for (const std::string& n : names) {
    if (reported_set_.insert(n).second) {
      reported_.push_back(n);
      grew = true;
    }
  }
  file_dirty_ = file_dirty_ || grew;
  return grew;
}

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
  Report(modules);
  const size_t before = pool_->preloaded().size();
  pool_->Preload(modules);
  if (pool_->preloaded().size() != before) ready_logged_ = false;
}

void WarmStarter::PreloadPersisted() {
  if (module_file_.empty()) return;
  absl::StatusOr<std::vector<std::string>> modules = ReadModuleListFile(module_file_, module_python_, module_target_);
  if (!modules.ok()) {
    if (!absl::IsNotFound(modules.status())) {
      spdlog::debug("warm interpreters: cannot read the modules of an earlier run: {} {}",
                    modules.status().ToString(), log_keys_());
    }
    return;
  }
  spdlog::info("warm interpreters preload the {} modules the workers of an earlier run of {} imported ({}) {}",
               modules->size(), module_target_, module_file_, log_keys_());
  const size_t before = pool_->preloaded().size();
  pool_->Preload(*modules);
  if (pool_->preloaded().size() != before) ready_logged_ = false;
}

void WarmStarter::Persist() {
  if (!file_dirty_ || !stepped_ || module_file_.empty()) return;
  file_dirty_ = false;
  if (absl::Status s = WriteModuleListFile(module_file_, module_python_, module_target_, reported_); !s.ok()) {
    // A cache: the next run learns the list again.
    spdlog::debug("warm interpreters: cannot keep the learned modules for the next run: {} {}", s.ToString(),
                  log_keys_());
  }
}

void WarmStarter::PrepareNow() {
  if (pool_->disabled()) return;
  if (!kv_read_) {
    kv_read_ = true;
    PreloadPersisted();
    PreloadPublished();
  }
  ready_logged_ = false;
  hints_logged_ = false;
  const std::map<std::string, std::string> env = workers_->InterpreterEnvironment();
  for (int lr = 0; lr < local_world_size_; ++lr) {
    if (absl::Status s = pool_->Prepare(lr, env); !s.ok()) {
      spdlog::warn("cannot start a warm interpreter for local rank {}: {} {}", lr, std::string(s.message()),
                   log_keys_());
      return;
    }
  }
}

void WarmStarter::WorkersStarted(uint64_t now_ns) {
  std::vector<std::string> taken;
  for (const WarmPool::TakenState& t : pool_->TakeTakenStates()) {
    taken.push_back(absl::StrCat("local rank ", t.local_rank, " (pid ", t.pid, "): ", t.Describe()));
  }
  if (!taken.empty()) spdlog::info("warm interpreters taken: {} {}", absl::StrJoin(taken, "; "), log_keys_());
  // At SCHED_IDLE the next interpreters take no CPU time from this start:
  // they start now, to be as far as they can when the next fault comes.
  due_ns_ = pool_->low_priority() ? now_ns : now_ns + kPrepareFallbackNs;
}

void WarmStarter::ProcessGroupsUp(uint64_t now_ns) {
  if (due_ns_ != 0) due_ns_ = std::min(due_ns_, now_ns);
}

void WarmStarter::FirstStep(uint64_t now_ns) {
  if (due_ns_ != 0) due_ns_ = now_ns;
  stepped_ = true;
  // What the first steps imported (DDP's construction), and later what the
  // steps after them import.
  workers_->RequestModules();
  learn_asks_ = 0;
  learn_again_ns_ = now_ns + kLearnAgainNs[0];
}

void WarmStarter::Learn(uint64_t now_ns) {
  if (learn_again_ns_ != 0 && now_ns >= learn_again_ns_) {
    workers_->RequestModules();
    ++learn_asks_;
    learn_again_ns_ = learn_asks_ < std::size(kLearnAgainNs) ? now_ns + kLearnAgainNs[learn_asks_] : 0;
    // 10 s on: a script that never calls ballast.step() (no first step
    // seen) has its list kept too.
    if (learn_asks_ >= 2) stepped_ = true;
  }
  workers_->ReadControl();
  std::vector<std::string> learned = workers_->TakeLearnedModules();
  if (!learned.empty()) {
    const size_t before = pool_->preloaded().size();
    pool_->Preload(learned);
    if (pool_->preloaded().size() != before) ready_logged_ = false;
    // For the nodes that join later (replacements). Best effort.
    if (Report(learned)) {
      const nlohmann::json names = reported_;
      if (absl::Status s = kv_.set(kWarmModulesKey, names.dump()); !s.ok()) {
        spdlog::debug("cannot publish the learned warm modules: {} {}", s.ToString(), log_keys_());
      }
    }
  }
  Persist();
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
  if (!hints_logged_ && !pool_->disabled()) {
    bool all = true;
    for (int lr = 0; lr < local_world_size_; ++lr) all = all && pool_->hints_ready(lr);
    if (all) {
      // The part a fault soon after a start needs most: logged before the
      // learned modules are all in (tests and benches wait for it).
      hints_logged_ = true;
      spdlog::info("warm interpreters for the next (re)start have torch and the DDP/FSDP modules ({} local ranks) {}",
                   local_world_size_, log_keys_());
    }
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
