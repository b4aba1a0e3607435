#include "agent/run_options.h"

#include "health/health_policy.h"

#include <regex>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/module_list.h"
#include "common/net.h"
#include "common/node_range.h"
#include "common/save_every.h"
#include "common/status_macros.h"

namespace ballast::agent {
namespace {

// Notes (ignored flags, unknown rdzv-conf keys) go straight to stderr: they
// are for the person who typed the command, and logging may not be set up yet.
void Note(const std::string& text) { std::fprintf(stderr, "ballast run: note: %s\n", text.c_str()); }

absl::Status FlagError(const std::string& flag, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", what, "; see `ballast run --help`"));
}

absl::StatusOr<int> ParseInt(const std::string& flag, const std::string& value) {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v)) return FlagError(flag, absl::StrCat("'", value, "' is not an integer"));
  return v;
}

absl::StatusOr<double> ParseDouble(const std::string& flag, const std::string& value) {
  double v = 0;
  if (!absl::SimpleAtod(value, &v)) return FlagError(flag, absl::StrCat("'", value, "' is not a number"));
  return v;
}

// GPUs visible to this process: /dev/nvidia0, /dev/nvidia1, ...
int CountGpus() {
  int n = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev", ec)) {
    std::string name = entry.path().filename().string();
    if (name.size() > 6 && absl::StartsWith(name, "nvidia")) {
      int idx;
      if (absl::SimpleAtoi(name.substr(6), &idx)) ++n;
    }
  }
  return n;
}

int CpuCount() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

absl::StatusOr<int> ParseNproc(const std::string& flag, const std::string& value) {
  if (value == "cpu") return CpuCount();
  if (value == "gpu" || value == "auto") {
    int gpus = CountGpus();
    if (gpus > 0) return gpus;
    if (value == "gpu")
      return FlagError(flag, "'gpu' asks for one worker per GPU, but this machine has no visible GPU; "
                             "pass an integer or 'cpu'");
    // torchrun's "auto" falls back to one worker per CPU when there is no GPU.
    return CpuCount();
  }
  ASSIGN_OR_RETURN(int n, ParseInt(flag, value));
  if (n < 1) return FlagError(flag, absl::StrCat("must be at least 1 (got ", n, ")"));
  return n;
}

absl::Status ParseNnodes(const std::string& flag, const std::string& value, RunOptions* o) {
  ASSIGN_OR_RETURN(NodeRange range, ParseNodeRange(value, flag));
  o->min_nodes = range.min;
  o->max_nodes = range.max;
  o->nnodes_given = true;
  return absl::OkStatus();
}

// torchrun's redirects/tee: "0".."3" or a per-local-rank map "0:1,1:2".
absl::Status ValidateStdMap(const std::string& flag, const std::string& value) {
  auto check = [&](const std::string& v) -> absl::Status {
    int n;
    if (!absl::SimpleAtoi(v, &n) || n < 0 || n > 3)
      return FlagError(flag, absl::StrCat("'", value, "' is not 0..3 (none, stdout, stderr, both) or LOCAL_RANK:N,..."));
    return absl::OkStatus();
  };
  if (value.find(':') == std::string::npos) return check(value);
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    std::vector<std::string> kv = absl::StrSplit(item, ':');
    int rank;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[0], &rank) || rank < 0)
      return FlagError(flag, absl::StrCat("'", value, "' is not 0..3 or LOCAL_RANK:N,..."));
    RETURN_IF_ERROR(check(kv[1]));
  }
  return absl::OkStatus();
}

absl::Status ParseRdzvConf(const std::string& flag, const std::string& value, RunOptions* o) {
  if (value.empty()) return absl::OkStatus();
  double timeout = -1;
  for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
    std::vector<std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.size() != 2) return FlagError(flag, absl::StrCat("'", item, "' is not KEY=VALUE"));
    std::string key(absl::StripAsciiWhitespace(kv[0]));
    std::string val(absl::StripAsciiWhitespace(kv[1]));
    if (key == "last_call_timeout") {
      ASSIGN_OR_RETURN(o->last_call_s, ParseDouble(absl::StrCat(flag, " last_call_timeout"), val));
      if (o->last_call_s < 0) return FlagError(flag, "last_call_timeout must be >= 0");
    } else if (key == "join_timeout") {
      ASSIGN_OR_RETURN(o->join_timeout_s, ParseDouble(absl::StrCat(flag, " join_timeout"), val));
      if (o->join_timeout_s <= 0) return FlagError(flag, "join_timeout must be > 0");
    } else if (key == "timeout") {
      ASSIGN_OR_RETURN(timeout, ParseDouble(absl::StrCat(flag, " timeout"), val));
      if (timeout <= 0) return FlagError(flag, "timeout must be > 0");
    } else {
      Note(absl::StrCat("--rdzv-conf key '", key,
                        "' is not used by ballast (known: last_call_timeout, join_timeout, timeout); ignored"));
    }
  }
  // torchrun's generic "timeout" bounds the rendezvous join; join_timeout wins when both are given.
  if (o->join_timeout_s < 0 && timeout > 0) o->join_timeout_s = timeout;
  return absl::OkStatus();
}

enum class Arity { kNone, kValue };

struct FlagDef {
  Arity arity;
  std::function<absl::Status(const std::string& flag, const std::string& value, RunOptions* o)> apply;
};

// Canonical (dash) spelling -> definition. Underscore spellings are mapped to
// dashes before the lookup, so every multiword flag has both forms.
const std::map<std::string, FlagDef>& FlagTable() {
  static const auto* table = new std::map<std::string, FlagDef>{
      {"--nnodes", {Arity::kValue, [](auto& f, auto& v, RunOptions* o) { return ParseNnodes(f, v, o); }}},
      {"--nproc-per-node",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->nproc_per_node, ParseNproc(f, v));
          return absl::OkStatus();
        }}},
      {"--max-restarts",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(int n, ParseInt(f, v));
          if (n < 0) return FlagError(f, absl::StrCat("must be >= 0 (got ", n, ")"));
          o->max_restarts = n;
          return absl::OkStatus();
        }}},
      {"--rdzv-endpoint",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          auto ep = ParseEndpoint(v, -1);
          if (!ep.ok()) return FlagError(f, std::string(ep.status().message()));
          if (ep->port == 0) return FlagError(f, "the master's port must not be 0");
          o->rdzv_endpoint = v;
          return absl::OkStatus();
        }}},
      {"--rdzv-id", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->rdzv_id = v; return absl::OkStatus(); }}},
      {"--rdzv-backend",
       {Arity::kValue,
        [](auto&, auto& v, RunOptions* o) {
          o->rdzv_backend = v;
          Note(absl::StrCat("--rdzv-backend ", v, " ignored: ballast always rendezvous through its master"));
          return absl::OkStatus();
        }}},
      {"--rdzv-conf",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) {
          o->rdzv_conf = v;
          return ParseRdzvConf(f, v, o);
        }}},
      {"--standalone", {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->standalone = true; return absl::OkStatus(); }}},
      {"--node-rank",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->node_rank, ParseInt(f, v));
          if (o->node_rank < 0) return FlagError(f, "must be >= 0");
          return absl::OkStatus();
        }}},
      {"--master-addr", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->master_addr = v; return absl::OkStatus(); }}},
      {"--master-port",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->master_port, ParseInt(f, v));
          if (o->master_port < 1 || o->master_port > 65535) return FlagError(f, "must be in 1..65535");
          return absl::OkStatus();
        }}},
      {"--local-addr", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->local_addr = v; return absl::OkStatus(); }}},
      {"--module", {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->module = true; return absl::OkStatus(); }}},
      {"--no-python", {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->no_python = true; return absl::OkStatus(); }}},
      {"--run-path", {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->run_path = true; return absl::OkStatus(); }}},
      {"--log-dir", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->log_dir = v; return absl::OkStatus(); }}},
      {"--redirects",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) {
          o->redirects = v;
          return ValidateStdMap(f, v);
        }}},
      {"--tee",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) {
          o->tee = v;
          return ValidateStdMap(f, v);
        }}},
      {"--monitor-interval",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->monitor_interval_s, ParseDouble(f, v));
          if (o->monitor_interval_s <= 0) return FlagError(f, "must be > 0 seconds");
          return absl::OkStatus();
        }}},
      {"--hang-timeout",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->hang_timeout_s, ParseDouble(f, v));
          if (o->hang_timeout_s < 0) return FlagError(f, "must be >= 0 seconds (0 turns hang detection off)");
          return absl::OkStatus();
        }}},
      {"--save-every",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          RETURN_IF_ERROR(ValidateSaveEvery(v, f));
          o->save_every = v;
          return absl::OkStatus();
        }}},
      {"--mtbf",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->mtbf_s, ParseDurationSeconds(v, f));
          return absl::OkStatus();
        }}},
      {"--role", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->role = v; return absl::OkStatus(); }}},
      {"--ckpt-replicas",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->ckpt_replicas, ParseInt(f, v));
          if (o->ckpt_replicas < 0 || o->ckpt_replicas > 8) return FlagError(f, "must be 0..8 (0 turns replicas off)");
          return absl::OkStatus();
        }}},
      {"--ckpt-copy-share",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->ckpt_copy_share, ParseDouble(f, v));
          if (!(o->ckpt_copy_share > 0 && o->ckpt_copy_share <= 1)) {
            return FlagError(f, "must be a share of the time in (0, 1], e.g. 0.25 (1: persist every step asked for)");
          }
          return absl::OkStatus();
        }}},
      {"--ckpt-copy-nice",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->ckpt_copy_nice, ParseInt(f, v));
          if (o->ckpt_copy_nice < 0 || o->ckpt_copy_nice > 19) {
            return FlagError(f, "must be a nice value 0..19 (0: the copies run at training's priority)");
          }
          return absl::OkStatus();
        }}},
      {"--http-port",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(int port, ParseInt(f, v));
          if (port < -1 || port > 65535) return FlagError(f, "must be 0..65535 (0: any free port) or -1 (off)");
          o->http_port = port;
          return absl::OkStatus();
        }}},
      {"--metrics-public",
       {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->metrics_public = true; return absl::OkStatus(); }}},
      {"--no-warm-restart",
       {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->warm_restart = false; return absl::OkStatus(); }}},
      {"--no-warm-fork",
       {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->warm_fork = false; return absl::OkStatus(); }}},
      {"--warm-modules",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          auto modules = ParseModuleList(v);
          if (!modules.ok()) return FlagError(f, std::string(modules.status().message()));
          o->warm_modules = *std::move(modules);
          return absl::OkStatus();
        }}},
      {"--network-check", {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->precheck = true; return absl::OkStatus(); }}},
      {"--precheck",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          int level = 0;
          ASSIGN_OR_RETURN(level, ParseInt(f, v));
          if (level < 0 || level > 1) return FlagError(f, "must be 0 (off) or 1 (pre-flight check)");
          o->precheck = level == 1;
          return absl::OkStatus();
        }}},
      {"--exclude-stragglers",
       {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->exclude_stragglers = true; return absl::OkStatus(); }}},
      {"--on-nan",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          if (!health::ParseOnNan(v).ok()) return FlagError(f, "must be rollback, fail or ignore");
          o->on_nan = v;
          return absl::OkStatus();
        }}},
      {"--max-rollbacks",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(int n, ParseInt(f, v));
          if (n < 0) return FlagError(f, "must be >= 0 (0: a bad loss fails the job)");
          o->max_rollbacks = n;
          return absl::OkStatus();
        }}},
      {"--loss-spike",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->loss_spike_z, ParseDouble(f, v));
          if (o->loss_spike_z != 0 && !(o->loss_spike_z >= 1)) {
            return FlagError(f, "must be a z-score >= 1 (e.g. 6), or 0 for off");
          }
          return absl::OkStatus();
        }}},
      {"--replica-check-every",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(int n, ParseInt(f, v));
          if (n < 0) return FlagError(f, "must be >= 0 steps (0: no fingerprint checks)");
          o->replica_check_every = n;
          return absl::OkStatus();
        }}},
      {"--no-skip-data",
       {Arity::kNone, [](auto&, auto&, RunOptions* o) { o->no_skip_data = true; return absl::OkStatus(); }}},
      {"--node-unit",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          ASSIGN_OR_RETURN(o->node_unit, ParseInt(f, v));
          if (o->node_unit < 1) return FlagError(f, "must be at least 1");
          return absl::OkStatus();
        }}},
      {"--token", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->token = v; return absl::OkStatus(); }}},
      {"--tls-cert", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->tls.cert = v; return absl::OkStatus(); }}},
      {"--tls-key", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->tls.key = v; return absl::OkStatus(); }}},
      {"--tls-ca", {Arity::kValue, [](auto&, auto& v, RunOptions* o) { o->tls.ca = v; return absl::OkStatus(); }}},
      {"--python",
       {Arity::kValue,
        [](auto& f, auto& v, RunOptions* o) -> absl::Status {
          if (v.empty()) return FlagError(f, "needs an interpreter, e.g. --python /usr/bin/python3");
          o->python = v;
          return absl::OkStatus();
        }}},
      // Accepted for compatibility with torchrun / torch.distributed.launch scripts.
      {"--start-method",
       {Arity::kValue,
        [](auto&, auto& v, RunOptions*) {
          Note(absl::StrCat("--start-method ", v, " ignored: ballast always starts workers as new processes"));
          return absl::OkStatus();
        }}},
      {"--use-env", {Arity::kNone, [](auto&, auto&, RunOptions*) { return absl::OkStatus(); }}},
  };
  return *table;
}

const std::map<std::string, std::string>& ShortFlags() {
  static const auto* shorts = new std::map<std::string, std::string>{
      {"-m", "--module"}, {"-r", "--redirects"}, {"-t", "--tee"}};
  return *shorts;
}

std::string Canonical(const std::string& name) {
  std::string out = name;
  for (size_t i = 2; i < out.size(); ++i)
    if (out[i] == '_') out[i] = '-';
  return out;
}

absl::Status Validate(RunOptions* o) {
  if (o->module && o->no_python)
    return absl::InvalidArgumentError("--module and --no-python cannot be used together: "
                                      "-m runs a Python module, --no-python runs a program directly");
  if (o->standalone && o->max_nodes > 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "--standalone runs a single-node job but --nnodes asks for up to ", o->max_nodes,
        " nodes; drop --standalone and pass --rdzv-endpoint HOST:PORT of a `ballast master`"));
  if (o->standalone && !o->rdzv_endpoint.empty()) {
    Note("--standalone starts its own master; --rdzv-endpoint " + o->rdzv_endpoint + " ignored");
    o->rdzv_endpoint.clear();
  }
  if (o->node_unit > 0 && o->nnodes_given && o->node_unit > o->max_nodes)
    return absl::InvalidArgumentError(absl::StrCat("--node-unit ", o->node_unit, " is larger than --nnodes MAX ",
                                                   o->max_nodes, ": no world could ever form"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RunOptions> ParseRunArgs(const std::vector<std::string>& args) {
  RunOptions o;
  if (const char* token = std::getenv("BALLAST_TOKEN"); token != nullptr) o.token = token;
  const auto& table = FlagTable();
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-' || arg == "-") break;  // the script
    if (arg == "-h" || arg == "--help") return absl::CancelledError("help");

    std::string name = arg;
    std::optional<std::string> value;
    if (absl::StartsWith(arg, "--")) {
      if (auto eq = arg.find('='); eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
      }
      name = Canonical(name);
    } else {
      // Short flags: -m, -r VALUE, -r3, -r=3 (argparse accepts all of them).
      std::string head = arg.substr(0, 2);
      auto it = ShortFlags().find(head);
      if (it == ShortFlags().end())
        return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg, " for `ballast run`; see `ballast run --help`"));
      if (arg.size() > 2) value = std::string(absl::StripPrefix(arg.substr(2), "="));
      name = it->second;
    }
    auto def = table.find(name);
    if (def == table.end())
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg.substr(0, arg.find('=')), " for `ballast run`; see `ballast run --help`"));
    if (def->second.arity == Arity::kNone) {
      if (value.has_value())
        return absl::InvalidArgumentError(absl::StrCat(name, " takes no value (got '", *value, "')"));
      RETURN_IF_ERROR(def->second.apply(name, "", &o));
      continue;
    }
    if (!value.has_value()) {
      if (i + 1 >= args.size())
        return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value; see `ballast run --help`"));
      value = args[++i];
    }
    RETURN_IF_ERROR(def->second.apply(name, *value, &o));
  }
  if (i >= args.size())
    return absl::InvalidArgumentError(
        "missing the training script: use `ballast run [FLAGS] SCRIPT [ARGS...]`, `ballast run [FLAGS] -m MODULE "
        "[ARGS...]` or `ballast run [FLAGS] --no-python PROGRAM [ARGS...]`; see `ballast run --help`");
  o.training_script = args[i];
  // Everything after the script is the script's, even when it looks like a flag.
  o.training_args.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  RETURN_IF_ERROR(Validate(&o));
  return o;
}

std::string RunUsage() {
  return R"(Usage: ballast run [FLAGS] SCRIPT [ARGS...]
       ballast run [FLAGS] -m MODULE [ARGS...]
       ballast run [FLAGS] --no-python PROGRAM [ARGS...]

Runs this node's training workers under a ballast master: a drop-in for torchrun.
Every multiword flag has both spellings (--nproc-per-node and --nproc_per_node),
and takes its value as `--flag VALUE` or `--flag=VALUE`. Everything after SCRIPT
is passed to it unchanged.

Job shape:
  --nnodes N|MIN:MAX        nodes in the job (elastic between MIN and MAX) [1]
  --nproc-per-node N        workers on this node; also cpu, gpu, auto [1]
  --max-restarts N          restarts after worker failures before the job fails [master's: 3]
  --node-unit N             world size in nodes is rounded down to a multiple of N
  --role NAME               worker role name (ROLE_NAME) [default]

Pre-flight check:
  --network-check           before training (and when replacement nodes join), nodes run
                            a matmul + allreduce check in pairs; faulty nodes are excluded
                            and replaced (same as --precheck 1) [off]
  --precheck 0|1            0: no check, 1: the pre-flight check
  --exclude-stragglers      exclude nodes slower than 2x the median (pre-flight check, or at runtime)
  BALLAST_CHAOS=SPEC        fault injection, e.g. check-fail:node=1 (the node's --node-rank)

Master / rendezvous:
  --standalone              single-node job with an embedded master
  --rdzv-endpoint HOST:PORT the `ballast master` of this job
  --rdzv-id ID              run id (TORCHELASTIC_RUN_ID) [master's]
  --rdzv-conf K=V,...       last_call_timeout=S, join_timeout=S, timeout=S
  --rdzv-backend NAME       accepted and ignored (the ballast master is the rendezvous)
  --token TOKEN             the job token the master printed [$BALLAST_TOKEN]
  --tls-ca FILE             TLS to the master: the PEM CA that signed its certificate [$BALLAST_TLS_CA]
  --tls-cert FILE, --tls-key FILE
                            this agent's PEM certificate and key, for a master with
                            mutual TLS [$BALLAST_TLS_CERT, $BALLAST_TLS_KEY]
  --master-addr HOST        without --rdzv-endpoint: the node with --node-rank 0 hosts
  --master-port PORT          an embedded master at HOST:PORT [29500]; needs --token
  --node-rank N             this node's rank hint (orders nodes)
  --local-addr ADDR         address other nodes reach this node at [derived]
  --http-port PORT          the embedded master's dashboard, /api/v1/job and /metrics
                            [its gRPC port + 1; any free port with --standalone; -1: off]
  --metrics-public          serve /metrics without the job token

Workers:
  -m, --module              run SCRIPT as `python -m MODULE`
  --no-python               run SCRIPT as a program, without python
  --run-path                run SCRIPT with python (same as the default)
  --python INTERPRETER      python for the workers [python3]
  --no-warm-restart         start every worker in a new interpreter; by default a
                            warm one per local rank (torch already imported) waits
                            for the next (re)start
  --no-warm-fork            hand the warm interpreter itself to a worker; by
                            default it forks a copy for each (re)start and stays
  --warm-modules M,...      modules warm interpreters import besides torch
  --ckpt-replicas K         copy each rank's newest flash checkpoint step to the
                            next K nodes' memory, so a replacement node restores
                            from a peer instead of disk [1; 0: off]
  --ckpt-copy-nice N        nice value of the threads that persist checkpoints and
                            copy replicas (and of their disk I/O): they yield the
                            cores training needs and run at full speed on idle
                            ones [10; 0: training's priority]
  --ckpt-copy-share F       the share of the time the writes of persist=True steps
                            may take: when a write takes longer, only the first
                            such step of every k steps is written, and wait() the
                            newest one left out [0.25; 1: every step asked for]
  --monitor-interval S      how often workers are checked [0.05]
  --on-nan MODE             a NaN/Inf loss reported with ballast.step(step, loss=):
                            rollback (every rank restarts from the newest checkpoint
                            before the bad step, its data skipped), fail, or ignore
                            [rollback]
  --max-rollbacks K         rollbacks before the job fails [3]
  --loss-spike Z            also roll back a loss Z robust deviations above the rank's
                            recent median, e.g. 6 [0: off]
  --no-skip-data            after a rollback, train the bad step's samples again
  --replica-check-every N   every N steps ranks holding the same parameters compare
                            fingerprints (ballast.step(step, model=)); a rank that
                            disagrees with the majority is excluded [100; 0: off]
  --hang-timeout S          a worker whose `ballast.step()` progress stops for S seconds
                            is hung: its Python stacks are logged and the workers
                            restart as for a failure [0: off]; see the tunables
                            BALLAST_HANG_FIRST_STEP_GRACE_S, BALLAST_HANG_CHECKPOINT_GRACE_S,
                            BALLAST_HANG_EXIT_GRACE_S
  --save-every N|auto[:MAX] which Checkpointer.save calls copy: every Nth step, or
                            auto: the interval that loses the least training time, from
                            the measured save cost, step time and failure rate (at most
                            MAX steps; 1000) [the script's; default 1: every call]
  --mtbf DURATION           save-every auto's prior for the job's mean time between
                            failures, e.g. 6h (one failure's weight) [1h]

Output:
  --log-dir DIR             write each worker's stdout/stderr under
                            DIR/RUN_ID/attempt_N/LOCAL_RANK/{stdout,stderr}.log
  -r, --redirects 0-3|MAP   send stdout(1)/stderr(2)/both(3) to the log files only
  -t, --tee 0-3|MAP         also copy them to the log files, lines prefixed [ROLE RANK]:

Exit codes: 0 job succeeded, 1 job failed or could not start, 2 bad flags,
128+N stopped by signal N.
)";
}

}  // namespace ballast::agent
