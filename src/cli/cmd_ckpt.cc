// ballast ckpt: look at flash-checkpoint directories.
//   ls <dir>                       steps, completeness, latest
//   inspect <dir> [--step --rank]  entries (key, dtype, shape, bytes) of one shard
//   verify <dir> [--step]          every shard's checksums; exit 1 naming bad files
//   export <dir> --to F [...]      a torch.load-able file, or a DCP directory with --format dcp
//                                  (runs python3 -m ballast.export)
// ls/inspect/verify use the C++ reader (src/ckpt/reader.h) and need no Python.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/format.h"
#include "ckpt/persister.h"
#include "ckpt/reader.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

namespace ballast::cli {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] =
    "usage: ballast ckpt <ls|inspect|verify|export> <dir> [options]\n"
    "\n"
    "  ls <dir>                                 list steps (complete or not) and the latest\n"
    "  inspect <dir> [--step N] [--rank R]      list a shard's tensors: key, dtype, shape, bytes\n"
    "  verify <dir> [--step N]                  check every shard's checksums (exit 1 if bad)\n"
    "  export <dir> --to FILE [--step N] [--rank R] [--full] [--format pt|dcp] [--python PY]\n"
    "                                           write a step as a file torch.load reads, or (dcp)\n"
    "                                           as a directory torch.distributed.checkpoint.load reads\n";

std::string HumanBytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// (rank, path) of every rank-<R>.ballast file of a step, by rank.
std::vector<std::pair<int, std::string>> ShardFiles(const std::string& dir, uint64_t step) {
  static const std::regex kName(R"(rank-(\d{1,9})\.ballast)");
  std::vector<std::pair<int, std::string>> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(ckpt::StepDir(dir, step), ec)) {
    std::smatch m;
    const std::string name = de.path().filename().string();
    if (std::regex_match(name, m, kName)) out.emplace_back(std::stoi(m[1]), de.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// World size recorded in a step's COMPLETE marker ("world_size=N"), if any.
std::optional<int> CompleteWorldSize(const std::string& dir, uint64_t step) {
  FILE* f = std::fopen(absl::StrCat(ckpt::StepDir(dir, step), "/COMPLETE").c_str(), "r");
  if (f == nullptr) return std::nullopt;
  int n = 0;
  const bool ok = std::fscanf(f, "world_size=%d", &n) == 1;
  std::fclose(f);
  return ok ? std::optional<int>(n) : std::optional<int>(0);
}

bool CheckDir(const std::string& cmd, const std::string& dir) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return true;
  std::fprintf(stderr, "ballast ckpt %s: %s is not a directory: pass the checkpoint directory "
               "given to ballast.Checkpointer\n", cmd.c_str(), dir.c_str());
  return false;
}

// The step to look at: --step, else <dir>/latest.
std::optional<uint64_t> ResolveStep(const std::string& cmd, const std::string& dir,
                                    std::optional<uint64_t> step) {
  if (step.has_value()) return step;
  absl::StatusOr<uint64_t> latest = ckpt::ReadLatestStep(dir);
  if (latest.ok()) return *latest;
  std::fprintf(stderr, "ballast ckpt %s: %s; pass --step (see `ballast ckpt ls %s`)\n",
               cmd.c_str(), std::string(latest.status().message()).c_str(), dir.c_str());
  return std::nullopt;
}

int Ls(const Args& args) {
  CLI::App app{"List the steps of a checkpoint directory.", "ckpt ls"};
  std::string dir;
  app.add_option("dir", dir, "Checkpoint directory")->required();
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (!CheckDir("ls", dir)) return 1;
  absl::StatusOr<uint64_t> latest = ckpt::ReadLatestStep(dir);
  if (!latest.ok() && !absl::IsNotFound(latest.status())) {
    std::fprintf(stderr, "warning: %s\n", std::string(latest.status().message()).c_str());
  }
  const std::vector<uint64_t> steps = ckpt::ListSteps(dir);
  if (steps.empty()) {
    std::printf("no checkpoints in %s\n", dir.c_str());
    return 0;
  }
  std::printf("%-12s %-11s %7s %12s\n", "STEP", "STATE", "SHARDS", "BYTES");
  for (uint64_t step : steps) {
    const auto files = ShardFiles(dir, step);
    uint64_t bytes = 0;
    for (const auto& f : files) {
      std::error_code ec;
      const auto n = fs::file_size(f.second, ec);
      if (!ec) bytes += n;
    }
    const std::optional<int> world = CompleteWorldSize(dir, step);
    std::string shards = world.has_value() && *world > 0
                             ? absl::StrCat(files.size(), "/", *world)
                             : absl::StrCat(files.size());
    const bool is_latest = latest.ok() && *latest == step;
    std::printf("%-12lu %-11s %7s %12s%s\n", static_cast<unsigned long>(step),
                world.has_value() ? "complete" : "incomplete", shards.c_str(),
                HumanBytes(bytes).c_str(), is_latest ? "  <- latest" : "");
  }
  if (latest.ok()) {
    std::printf("latest: %lu\n", static_cast<unsigned long>(*latest));
  } else {
    std::printf("latest: none (no step is complete yet)\n");
  }
  return 0;
}

// Collects key -> "shard of G at O" from the JSON state tree written by the
// Python package ({"s": key, "gs": [...], "go": [...]} nodes).
void CollectShards(const nlohmann::json& node, std::map<std::string, std::string>* out) {
  if (node.is_object()) {
    if (node.contains("s") && node["s"].is_string() && node.contains("gs") && node.contains("go")) {
      std::vector<int64_t> gs, go;
      for (const auto& v : node["gs"]) gs.push_back(v.is_number_integer() ? v.get<int64_t>() : 0);
      for (const auto& v : node["go"]) go.push_back(v.is_number_integer() ? v.get<int64_t>() : 0);
      (*out)[node["s"].get<std::string>()] =
          absl::StrCat("shard of ", ShapeString(gs), " at ", ShapeString(go));
      return;
    }
    for (const auto& [k, v] : node.items()) CollectShards(v, out);
  } else if (node.is_array()) {
    for (const auto& v : node) CollectShards(v, out);
  }
}

int Inspect(const Args& args) {
  CLI::App app{"List the entries of one rank's shard of a step.", "ckpt inspect"};
  std::string dir;
  std::optional<uint64_t> step;
  int rank = 0;
  app.add_option("dir", dir, "Checkpoint directory")->required();
  app.add_option("--step", step, "Step (default: latest)");
  app.add_option("--rank", rank, "Rank (default 0)");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (!CheckDir("inspect", dir)) return 1;
  step = ResolveStep("inspect", dir, step);
  if (!step.has_value()) return 1;
  const std::string path = ckpt::ShardPath(dir, *step, rank);
  ckpt::ReadOptions options;
  options.verify_data = false;  // `verify` reads every byte; inspect stays fast
  absl::StatusOr<ckpt::Snapshot> snap = ckpt::ReadCheckpointFile(path, options);
  if (!snap.ok()) {
    std::fprintf(stderr, "ballast ckpt inspect: %s\n", std::string(snap.status().message()).c_str());
    return 1;
  }
  std::map<std::string, std::string> shards;
  std::string saved_by;
  if (const ckpt::Entry* tree = snap->Find("__ballast__/tree"); tree != nullptr) {
    const char* p = reinterpret_cast<const char*>(snap->Data(*tree));
    nlohmann::json doc = nlohmann::json::parse(p, p + tree->nbytes, nullptr, false);
    if (doc.is_object()) {
      if (doc.contains("rank") && doc.contains("world_size")) {
        saved_by = absl::StrCat(", saved by rank ", doc["rank"].dump(), " of ",
                                doc["world_size"].dump());
      }
      if (doc.contains("tree")) CollectShards(doc["tree"], &shards);
    }
  }
  uint64_t total = 0;
  for (const auto& e : snap->entries()) total += e.nbytes;
  std::printf("%s: step %lu, %zu entries, %s%s\n", path.c_str(),
              static_cast<unsigned long>(snap->step()), snap->entries().size(),
              HumanBytes(total).c_str(), saved_by.c_str());
  std::printf("%-48s %-10s %-20s %12s\n", "KEY", "DTYPE", "SHAPE", "BYTES");
  for (const auto& e : snap->entries()) {
    std::string note;
    if (auto it = shards.find(e.key); it != shards.end()) note = "  " + it->second;
    std::printf("%-48s %-10s %-20s %12lu%s\n", e.key.c_str(),
                std::string(ckpt::DTypeName(e.dtype)).c_str(),
                e.dtype == ckpt::DType::kBlob ? "-" : ShapeString(e.shape).c_str(),
                static_cast<unsigned long>(e.nbytes), note.c_str());
  }
  return 0;
}

int Verify(const Args& args) {
  CLI::App app{"Check the checksums of every shard file.", "ckpt verify"};
  std::string dir;
  std::optional<uint64_t> only_step;
  app.add_option("dir", dir, "Checkpoint directory")->required();
  app.add_option("--step", only_step, "Only this step");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (!CheckDir("verify", dir)) return 1;
  std::vector<uint64_t> steps = ckpt::ListSteps(dir);
  if (only_step.has_value()) steps = {*only_step};
  std::vector<std::string> bad;
  int files = 0;
  for (uint64_t step : steps) {
    const auto shard_files = ShardFiles(dir, step);
    for (const auto& [rank, path] : shard_files) {
      ++files;
      absl::StatusOr<ckpt::Snapshot> snap = ckpt::ReadCheckpointFile(path);
      if (snap.ok() && snap->step() != step) {
        snap = absl::DataLossError(absl::StrCat(path, " holds step ", snap->step()));
      }
      if (snap.ok()) {
        std::printf("ok       %s\n", path.c_str());
      } else {
        std::printf("CORRUPT  %s: %s\n", path.c_str(), std::string(snap.status().message()).c_str());
        bad.push_back(path);
      }
    }
    if (std::optional<int> world = CompleteWorldSize(dir, step); world.has_value()) {
      for (int r = 0; r < *world; ++r) {
        const std::string path = ckpt::ShardPath(dir, step, r);
        std::error_code ec;
        if (!fs::exists(path, ec)) {
          std::printf("MISSING  %s (step %lu is marked complete for %d ranks)\n", path.c_str(),
                      static_cast<unsigned long>(step), *world);
          bad.push_back(path);
        }
      }
    }
  }
  absl::StatusOr<uint64_t> latest = ckpt::ReadLatestStep(dir);
  if (!latest.ok() && !absl::IsNotFound(latest.status())) {
    std::printf("CORRUPT  %s: %s\n", ckpt::LatestPath(dir).c_str(),
                std::string(latest.status().message()).c_str());
    bad.push_back(ckpt::LatestPath(dir));
  } else if (latest.ok() && !CompleteWorldSize(dir, *latest).has_value()) {
    std::printf("CORRUPT  %s names step %lu, which is not complete\n", ckpt::LatestPath(dir).c_str(),
                static_cast<unsigned long>(*latest));
    bad.push_back(ckpt::LatestPath(dir));
  }
  if (!bad.empty()) {
    std::fprintf(stderr,
                 "ballast ckpt verify: %zu problem(s) in %s: %s\nload another step (`ballast ckpt "
                 "ls %s`) or delete the step directory holding the bad file\n",
                 bad.size(), dir.c_str(), absl::StrJoin(bad, ", ").c_str(), dir.c_str());
    return 1;
  }
  std::printf("%d file(s) in %zu step(s) verified\n", files, steps.size());
  return 0;
}

// The directory holding the ballast Python package next to this binary
// (<build>/bin/ballast -> <build>/python), or "" if there is none.
std::string PackageDirNextToBinary() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const fs::path dir = exe.parent_path().parent_path() / "python";
  if (fs::exists(dir / "ballast" / "__init__.py", ec)) return dir.string();
  return "";
}

int Export(const Args& args) {
  CLI::App app{"Write one step of a checkpoint as a file that torch.load reads.", "ckpt export"};
  std::string dir, to, python, format = "pt";
  std::optional<uint64_t> step;
  int rank = 0;
  bool full = false;
  app.add_option("dir", dir, "Checkpoint directory")->required();
  app.add_option("--to", to, "Output file (.pt), or directory with --format dcp")->required();
  app.add_option("--format", format,
                 "pt: a torch.save file of one rank's state; dcp: a torch.distributed.checkpoint directory of "
                 "the whole state (whole tensors; torch >= 2.2)")
      ->check(CLI::IsMember({"pt", "dcp"}));
  app.add_option("--step", step, "Step (default: latest)");
  app.add_option("--rank", rank, "Rank whose shard to export (default 0)");
  app.add_flag("--full", full, "Assemble sharded tensors from every rank into whole tensors");
  app.add_option("--python", python,
                 "Python with torch (default: $BALLAST_PYTHON, else /usr/bin/python3)");
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  if (!CheckDir("export", dir)) return 1;
  if (python.empty()) {
    const char* env = std::getenv("BALLAST_PYTHON");
    python = env != nullptr && *env != '\0' ? env
             : access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3"
                                                     : "python3";
  }
  if (const std::string pkg = PackageDirNextToBinary(); !pkg.empty()) {
    const char* old = std::getenv("PYTHONPATH");
    const std::string path = old != nullptr && *old != '\0' ? absl::StrCat(pkg, ":", old) : pkg;
    setenv("PYTHONPATH", path.c_str(), 1);
  }
  std::vector<std::string> argv = {python, "-m", "ballast.export", dir, "--to", to,
                                   "--rank", std::to_string(rank), "--format", format};
  if (step.has_value()) {
    argv.push_back("--step");
    argv.push_back(std::to_string(*step));
  }
  if (full) argv.push_back("--full");
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  std::fflush(stdout);
  execvp(cargv[0], cargv.data());
  std::fprintf(stderr,
               "ballast ckpt export: cannot run %s: %s; pass --python with a Python that has "
               "torch and the ballast package (make install, or PYTHONPATH=<build>/python)\n",
               python.c_str(), std::strerror(errno));
  return 1;
}

}  // namespace

int CkptCommand(const Args& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? kUsageExit : 0;
  }
  const Args rest(args.begin() + 1, args.end());
  if (args[0] == "ls") return Ls(rest);
  if (args[0] == "inspect") return Inspect(rest);
  if (args[0] == "verify") return Verify(rest);
  if (args[0] == "export") return Export(rest);
  std::fprintf(stderr, "ballast ckpt: unknown subcommand '%s'\n\n%s", args[0].c_str(), kUsage);
  return kUsageExit;
}

}  // namespace ballast::cli
