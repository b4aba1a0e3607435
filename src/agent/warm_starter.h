// When an agent prepares the warm interpreters for its next (re)start
// (warm_pool.h), what they preload, and what the log says about them.
//
// - Join: prepared at once (they import torch while the rendezvous
//   completes), preloading the modules other nodes' workers imported, which
//   the master's KV store holds (kWarmModulesKey): a replacement node's first
//   start is as warm as the survivors'; and those the workers of an earlier
//   run of the same script and python imported (a file in the user's cache,
//   module_list.h), so a job's first restart does not wait to learn them.
//   Every interpreter also imports the pool's hints (what DDP/FSDP import).
// - A round's workers started (they took the interpreters): the next ones
//   are prepared at once when they wait at SCHED_IDLE (they take no CPU
//   from this start, and a fault soon after it, at a job's start or on a
//   flapping node, finds them as far as they got); without SCHED_IDLE once
//   every worker made its first step or has its process group up, or
//   kPrepareFallbackNs after the start, whichever comes first, so their
//   imports do not slow this start. A restart that takes an interpreter
//   still preloading uses what it has loaded (warm_pool.h).
// - Learning: the running warm workers are asked which library modules they
//   imported (when the interpreters are prepared, at the first step, and
//   kLearnAgainNs after it); new names go to the waiting interpreters, to
//   the KV store and, once the workers stepped (or 10 s on), to the cache
//   file.
//
// Threading: not thread-safe; the agent's main loop owns it (as it owns the
// pool and the worker group it points to).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agent/warm_pool.h"
#include "agent/worker_group.h"

namespace ballast::agent {

// The master's KV store, as the starter uses it (best effort).
struct WarmKv {
  std::function<absl::StatusOr<std::string>(const std::string& key)> get;  // kNotFound when unset
  std::function<absl::Status(const std::string& key, const std::string& value)> set;
};

class WarmStarter {
 public:
  static constexpr char kWarmModulesKey[] = "warm/modules";
  static constexpr uint64_t kPrepareFallbackNs = 3'000'000'000ull;
  static constexpr uint64_t kLearnAgainNs[] = {2'000'000'000ull, 8'000'000'000ull, 20'000'000'000ull};
  // A node without running workers (a hot spare, a node waiting for a
  // round) reads the published module list again this often.
  static constexpr uint64_t kKvAgainNs = 2'000'000'000ull;

  // pool and workers are not owned and outlive the starter; log_keys gives
  // the "node=... round=..." suffix of its log lines.
  WarmStarter(WarmPool* pool, WorkerGroup* workers, int local_world_size, WarmKv kv,
              std::function<std::string()> log_keys);

  // Keeps the modules the workers import between runs in
  // ModuleListFile(BallastCacheDir(), python, target): read at the first
  // PrepareNow, written as the list grows once the workers stepped. The
  // target is the script (its canonical path) or, with `module`, "-m NAME
  // in CWD".
  void KeepModulesBetweenRuns(const std::string& python, const std::string& script, bool module);
  // The same with the file named (tests); "" keeps nothing.
  void set_module_file(std::string path, std::string python, std::string target);

  // Prepares one interpreter per local rank now (after Join).
  void PrepareNow();
  // A round's workers were started at now_ns (they took the waiting
  // interpreters: logs what those had imported).
  void WorkersStarted(uint64_t now_ns);
  // Every running worker's process group is up / made its first step.
  void ProcessGroupsUp(uint64_t now_ns);
  void FirstStep(uint64_t now_ns);
  // Every agent poll, with or without a round: learns from running workers
  // (without them: from the list the other nodes publish, every
  // kKvAgainNs), polls the pool, prepares when due, logs when the pool turns
  // off or every interpreter is ready.
  void Poll(uint64_t now_ns, bool workers_running);

 private:
  void Learn(uint64_t now_ns);
  // Preloads what the KV store's list names that the pool does not have yet.
  void PreloadPublished();
  // Preloads the module file's list (an earlier run's).
  void PreloadPersisted();
  // Adds names workers of this run imported (here or on other nodes);
  // whether any was new.
  bool Report(const std::vector<std::string>& names);
  // Writes the module file when the list grew and the workers stepped.
  void Persist();

  WarmPool* pool_;
  WorkerGroup* workers_;
  const int local_world_size_;
  WarmKv kv_;
  std::function<std::string()> log_keys_;
  uint64_t due_ns_ = 0;          // when to prepare the next interpreters (0: done for this round)
  uint64_t learn_again_ns_ = 0;  // when to ask the workers again (0: not)
  size_t learn_asks_ = 0;
  bool kv_read_ = false;
  uint64_t kv_again_ns_ = 0;     // when a node without workers reads the list again
  bool disabled_logged_ = false;
  bool ready_logged_ = true;  // false from a Prepare or a preload until all say ready
  bool hints_logged_ = true;  // false from a Prepare until all have the hints (DDP/FSDP modules)
  // What this run's workers imported (learned here or published by other
  // nodes): what the KV store and the module file get. The pool may
  // preload more (the file's list from an earlier run).
  std::vector<std::string> reported_;
  std::set<std::string> reported_set_;
  std::string module_file_, module_python_, module_target_;
  bool file_dirty_ = false;  // reported_ grew since the file was written
  // The workers made a first step (or ran 10 s: scripts that never call
  // ballast.step()): what they imported is worth keeping (a run that fails
  // before it would leave a list without what DDP's first step imports in
  // place of a whole one).
  bool stepped_ = false;
};

}  // namespace ballast::agent
