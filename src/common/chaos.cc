#include "common/chaos.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ballast {
namespace {

enum class ValueType { kInt, kNumber };

struct KeyDef {
  const char* name;
  ValueType type;
  bool required;
  double min_value;  // kInt: value >= min; kNumber: value > min
};

struct KindDef {
  const char* kind;
  const char* doc;
  std::vector<KeyDef> keys;
  // Needs exactly one trigger: after=T (seconds after the round's workers
  // start) or at_step=S (when the step reaches S).
  bool trigger = false;
};

constexpr KeyDef kAfter{"after", ValueType::kNumber, false, 0};
constexpr KeyDef kAtStep{"at_step", ValueType::kInt, false, 0};
constexpr KeyDef kRestart{"restart", ValueType::kInt, false, 0};

// One row per fault kind. `node` is the node rank the fault hits, `rank` the
// worker's global rank.
const std::vector<KindDef>& Kinds() {
  static const auto* kinds = new std::vector<KindDef>{
      {"check-fail", "the node's pre-flight check workers exit non-zero",
       {{"node", ValueType::kInt, true, 0}}},
      {"check-slow", "the node's pre-flight check time is multiplied by factor (> 0)",
       {{"node", ValueType::kInt, true, 0}, {"factor", ValueType::kNumber, true, 0}}},
      {"kill-agent",
       "the node's agent SIGKILLs itself `after` seconds after its workers first start, or when its workers "
       "reach step at_step (a lost node: its workers die with it)",
       {{"node", ValueType::kInt, true, 0}, kAfter, kAtStep},
       true},
      {"kill-worker",
       "the agent SIGKILLs worker rank `rank` `after` seconds after the round's workers start, or when it "
       "reaches step at_step, in the attempt with TORCHELASTIC_RESTART_COUNT `restart` (default 0)",
       {{"rank", ValueType::kInt, true, 0}, kAfter, kAtStep, kRestart},
       true},
      {"hang",
       "the agent SIGSTOPs worker rank `rank` (a hang: its steps stop; --hang-timeout finds it) `after` seconds "
       "after the round's workers start, or when it reaches step at_step, in the attempt `restart`",
       {{"rank", ValueType::kInt, true, 0}, kAfter, kAtStep, kRestart},
       true},
      {"disk-full",
       "the node's agent fails `writes` (default 3) checkpoint shard writes with ENOSPC (No space left on device), "
       "from `after` seconds after it joined or from the first persist of a step >= at_step",
       {{"node", ValueType::kInt, true, 0}, kAfter, kAtStep, {"writes", ValueType::kInt, false, 1}},
       true},
      {"disk-error",
       "as disk-full, with EIO (Input/output error): a failing disk",
       {{"node", ValueType::kInt, true, 0}, kAfter, kAtStep, {"writes", ValueType::kInt, false, 1}},
       true},
      {"partition",
       "the node's agent takes down the network interface of its address for `for` seconds (a network "
       "partition: heartbeats, the workers' collectives and the replicas stop), `after` seconds after its "
       "workers first start or when they reach step at_step; the node must have its own interface (hosts or "
       "network namespaces: not loopback) and CAP_NET_ADMIN",
       {{"node", ValueType::kInt, true, 0}, kAfter, kAtStep, {"for", ValueType::kNumber, true, 0}},
       true},
      {"kill-master",
       "the job's master process is SIGKILLed `after` seconds after it starts, or when every node reached step "
       "at_step (needs --journal DIR: the master restarts from it)",
       {kAfter, kAtStep},
       true},
      {"nan", "worker rank `rank` reports a NaN loss (ballast.step(step, loss=)) at step at_step, in the attempt "
              "with TORCHELASTIC_RESTART_COUNT `restart` (default 0)",
       {{"rank", ValueType::kInt, true, 0}, {"at_step", ValueType::kInt, true, 0}, kRestart}},
      {"slow",
       "worker rank `rank`'s forward passes take `factor` times as long (ballast.step(step, model=)) from `after` "
       "seconds after it first reports a model, or from step at_step: a runtime straggler (--exclude-stragglers "
       "replaces its node)",
       {{"rank", ValueType::kInt, true, 0}, {"factor", ValueType::kNumber, true, 1}, kAfter, kAtStep, kRestart},
       true},
      {"bitflip", "worker rank `rank` flips one bit of its first parameter at step at_step (ballast.step(step, "
                  "model=)): silent data corruption, found by the fingerprint checks",
       {{"rank", ValueType::kInt, true, 0}, {"at_step", ValueType::kInt, true, 0}, kRestart}},
  };
  return *kinds;
}

// Keys every kind takes.
const std::vector<KeyDef>& CommonKeys() {
  static const auto* keys = new std::vector<KeyDef>{{"incarnation", ValueType::kInt, false, 1}};
  return *keys;
}

std::string KindNames() {
  std::vector<std::string> names;
  for (const auto& k : Kinds()) names.push_back(k.kind);
  return absl::StrJoin(names, ", ");
}

}  // namespace

double ChaosFault::Number(const std::string& key, double fallback) const {
  auto it = params.find(key);
  double v = 0;
  if (it == params.end() || !absl::SimpleAtod(it->second, &v)) return fallback;
  return v;
}

const ChaosFault* ChaosSpec::Find(const std::string& kind, int node) const {
  for (const auto& f : faults) {
    if (f.kind == kind && f.node == node && f.incarnation == incarnation) return &f;
  }
  return nullptr;
}

std::vector<const ChaosFault*> ChaosSpec::All(const std::string& kind) const {
  std::vector<const ChaosFault*> out;
  for (const auto& f : faults) {
    if (f.kind == kind && f.incarnation == incarnation) out.push_back(&f);
  }
  return out;
}

absl::StatusOr<ChaosSpec> ChaosSpecFromEnv() {
  const char* text = std::getenv(kChaosEnv);
  absl::StatusOr<ChaosSpec> spec = ParseChaosSpec(text != nullptr ? text : "");
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat(kChaosEnv, ": ", spec.status().message()));
  if (const char* inc = std::getenv(kChaosIncarnationEnv); inc != nullptr && *inc != '\0') {
    if (!absl::SimpleAtoi(inc, &spec->incarnation) || spec->incarnation < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(kChaosIncarnationEnv, "=", inc, " is not an integer >= 1 (1 is a node's first agent)"));
    }
  }
  return spec;
}

std::string ChaosKindsHelp() {
  std::vector<std::string> parts;
  for (const auto& k : Kinds()) {
    std::vector<std::string> keys;
    std::vector<std::string> optional;
    for (const auto& key : k.keys) {
      if (k.trigger && (std::string(key.name) == "after" || std::string(key.name) == "at_step")) continue;
      std::string kv = absl::StrCat(key.name, "=", key.type == ValueType::kInt ? "N" : "F");
      (key.required ? keys : optional).push_back(std::move(kv));
    }
    if (k.trigger) keys.push_back("after=F|at_step=N");
    for (auto& o : optional) keys.push_back(absl::StrCat("[", o, "]"));
    parts.push_back(absl::StrCat(k.kind, ":", absl::StrJoin(keys, ",")));
  }
  return absl::StrCat(absl::StrJoin(parts, "; "), " (each also takes incarnation=K: the K-th agent of the node)");
}

absl::StatusOr<ChaosSpec> ParseChaosSpec(const std::string& text) {
  ChaosSpec spec;
  for (absl::string_view item : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits(':', 1));
    absl::string_view kind = absl::StripAsciiWhitespace(kv.first);
    auto def = std::find_if(Kinds().begin(), Kinds().end(), [&](const KindDef& k) { return kind == k.kind; });
    if (def == Kinds().end()) {
      return absl::InvalidArgumentError(absl::StrCat("chaos spec \"", text, "\": unknown fault kind \"", kind,
                                                     "\" (known: ", KindNames(), ")"));
    }
    ChaosFault fault;
    fault.kind = std::string(kind);
    for (absl::string_view pair : absl::StrSplit(kv.second, ',', absl::SkipWhitespace())) {
      std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(pair, absl::MaxSplits('=', 1));
      absl::string_view key = absl::StripAsciiWhitespace(p.first);
      absl::string_view value = absl::StripAsciiWhitespace(p.second);
      const KeyDef* kd = nullptr;
      for (const auto* keys : {&def->keys, &CommonKeys()}) {
        for (const KeyDef& k : *keys) {
          if (kd == nullptr && key == k.name) kd = &k;
        }
      }
      if (kd == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("chaos spec \"", text, "\": ", kind, " has no key \"", key,
                                                       "\" (usage: ", ChaosKindsHelp(), ")"));
      }
      int integer = 0;
      double number = 0;
      bool valid = kd->type == ValueType::kInt
                       ? absl::SimpleAtoi(value, &integer) && integer >= kd->min_value
                       : absl::SimpleAtod(value, &number) && number > kd->min_value;
      if (!valid) {
        return absl::InvalidArgumentError(absl::StrCat("chaos spec \"", text, "\": ", kind, " ", key, "=", value,
                                                       " is not a valid ",
                                                       kd->type == ValueType::kInt
                                                           ? absl::StrCat("integer >= ", kd->min_value)
                                                           : absl::StrCat("number > ", kd->min_value)));
      }
      if (key == "node") {
        fault.node = integer;
      } else if (key == "incarnation") {
        fault.incarnation = integer;
      } else {
        fault.params[std::string(key)] = std::string(value);
      }
    }
    for (const auto& k : def->keys) {
      bool present = std::string(k.name) == "node" ? fault.node >= 0 : fault.params.count(k.name) > 0;
      if (k.required && !present) {
        return absl::InvalidArgumentError(
            absl::StrCat("chaos spec \"", text, "\": ", kind, " needs ", k.name, "= (usage: ", ChaosKindsHelp(), ")"));
      }
    }
    if (def->trigger && fault.params.count("after") + fault.params.count("at_step") != 1) {
      return absl::InvalidArgumentError(absl::StrCat("chaos spec \"", text, "\": ", kind,
                                                     " needs exactly one trigger, after=SECONDS or at_step=STEP (usage: ",
                                                     ChaosKindsHelp(), ")"));
    }
    spec.faults.push_back(std::move(fault));
  }
  return spec;
}

}  // namespace ballast
