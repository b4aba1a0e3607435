// Integration-test harness: real `ballast` processes in temp dirs, their output
// captured to files, RAII cleanup that kills and reaps everything (as gRPC's
// end2end client_crash_test and PyTorch's c10d TestUtils do).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace ballast::testing {

inline std::string Env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}
inline std::string BallastBin() { return Env("BALLAST_BIN", BALLAST_TEST_BIN); }
inline std::string SourceDir() { return Env("BALLAST_SOURCE_DIR", BALLAST_TEST_SOURCE_DIR); }
inline std::string Python() { return Env("BALLAST_PYTHON", "/usr/bin/python3"); }
inline std::string Script(const std::string& name) { return SourceDir() + "/tests/integration/scripts/" + name; }
inline std::string Example(const std::string& name) { return SourceDir() + "/examples/" + name; }

// A fresh directory removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ballast-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    if (std::getenv("BALLAST_KEEP_TEST_DIRS") == nullptr) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls pred every 50 ms until it holds or timeout_s passes.
inline bool WaitFor(const std::function<bool()>& pred, double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

// A `ballast ...` (or any) process whose stdout+stderr go to a log file.
class Proc {
 public:
  Proc(std::vector<std::string> argv, const std::string& log_path,
       const std::map<std::string, std::string>& extra_env = {})
      : log_path_(log_path) {
    SpawnOptions o;
    o.argv = std::move(argv);
    o.env = CurrentEnvironment();
    // Fast failure detection for tests; each test may override.
    o.env["BALLAST_HEARTBEAT_TIMEOUT_S"] = "3";
    o.env["BALLAST_STOP_GRACE_S"] = "2";
    for (const auto& [k, v] : extra_env) o.env[k] = v;
    o.stdout_file = log_path;
    o.stderr_to_stdout = true;
    auto p = Subprocess::Spawn(o);
    if (!p.ok()) {
      ADD_FAILURE() << "spawn failed: " << p.status();
      return;
    }
    proc_ = std::move(*p);
  }
  pid_t pid() const { return proc_.pid(); }
  std::string Output() const { return ReadFile(log_path_); }
  // Waits for exit; returns the shell-style code, or -1 on timeout (then kills).
  int Wait(double timeout_s) {
    auto st = proc_.Wait(timeout_s);
    if (!st.has_value()) {
      ADD_FAILURE() << "process " << proc_.pid() << " did not exit within " << timeout_s << " s; output:\n"
                    << Output();
      proc_.Terminate(1);
      return -1;
    }
    return st->ShellCode();
  }
  void Kill(int sig) { ::kill(proc_.pid(), sig); }

 private:
  std::string log_path_;
  Subprocess proc_;  // killed and reaped (with its group) on destruction
};

// JSON-lines events a worker of train_ddp.py wrote.
inline std::vector<nlohmann::json> Events(const std::string& dir, int rank) {
  std::vector<nlohmann::json> out;
  std::ifstream in(dir + "/rank" + std::to_string(rank) + ".jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) out.push_back(j);
  }
  return out;
}

inline std::vector<nlohmann::json> EventsOfKind(const std::string& dir, int rank, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (auto& e : Events(dir, rank))
    if (e["event"] == kind) out.push_back(e);
  return out;
}

// Highest step any "step" event of `rank` reached.
inline int LastStep(const std::string& dir, int rank) {
  int s = 0;
  for (auto& e : EventsOfKind(dir, rank, "step")) s = std::max(s, e["step"].get<int>());
  return s;
}

// The master address `ballast launch` logged ("master on HOST:PORT").
inline std::string MasterAddressFromLog(const std::string& log) {
  static const std::regex re("master on ([0-9.]+:[0-9]+)");
  std::smatch m;
  return std::regex_search(log, m, re) ? m[1].str() : "";
}

// The address a `ballast master` process listens on, once it logged it
// ("listening on HOST:PORT"); "" after timeout_s.
inline std::string WaitForMasterAddress(const Proc& master, double timeout_s = 30) {
  static const std::regex re("listening on ([0-9.]+:[0-9]+)");
  std::string addr;
  WaitFor(
      [&] {
        std::smatch m;
        std::string out = master.Output();
        if (std::regex_search(out, m, re)) addr = m[1].str();
        return !addr.empty();
      },
      timeout_s);
  return addr;
}

}  // namespace ballast::testing
