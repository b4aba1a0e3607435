#include "agent/precheck_runner.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/net.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool Retryable(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The last `n` non-empty lines of `text`, '\n'-joined.
std::string Tail(const std::string& text, int n) {
  std::vector<std::string> lines;
  for (absl::string_view l : absl::StrSplit(text, '\n', absl::SkipWhitespace())) lines.emplace_back(l);
  if (static_cast<int>(lines.size()) > n) lines.erase(lines.begin(), lines.end() - n);
  std::string out;
  for (const auto& l : lines) absl::StrAppend(&out, out.empty() ? "" : "\n", l);
  return out;
}

}  // namespace

PrecheckRunner::PrecheckRunner(PrecheckRunnerOptions options, MasterClient* client)
    : options_(std::move(options)), client_(client) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "ballast-precheck-XXXXXX").string();
  if (mkdtemp(tmpl.data()) != nullptr) dir_ = tmpl;
}

PrecheckRunner::~PrecheckRunner() {
  Stop();
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

std::string PrecheckRunner::LogPath(int lr) const {
  return absl::StrCat(dir_, "/check", current_.check_id(), "-", lr, ".log");
}
std::string PrecheckRunner::ResultPath(int lr) const {
  return absl::StrCat(dir_, "/check", current_.check_id(), "-", lr, ".result");
}

void PrecheckRunner::Stop() {
  for (auto& p : procs_) {
    if (p.running()) p.Terminate(1.0);
  }
  procs_.clear();
}

void PrecheckRunner::Start(const v1::RunCheck& rc, const std::function<bool()>& superseded) {
  if (rc.check_id() <= last_check_id_) return;  // a reconnecting watch re-sends the current decision
  Stop();
  last_check_id_ = rc.check_id();
  current_ = rc;
  spdlog::info("pre-flight check {} round {}: group {} rank {}/{} node={}", rc.check_id(), rc.check_round(),
               rc.group_id(), rc.group_rank(), rc.group_world_size(), options_.node_id);
  // The group's MASTER_ADDR:PORT, as for a training round.
  std::string addr;
  int port = 0;
  if (rc.group_rank() == 0) {
    auto p = PickFreePort("0.0.0.0");
    if (!p.ok()) return Finish(false, 0, absl::StrCat("no free port: ", p.status().message()));
    addr = options_.host;
    port = *p;
    absl::Status s;
    auto t0 = Clock::now();
    do {
      s = client_->KvSet(rc.endpoint_key(), absl::StrCat(addr, ":", port));
      if (s.ok() || !Retryable(s) || superseded()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } while (SecondsSince(t0) < 5.0);
    if (!s.ok()) return Finish(false, 0, absl::StrCat("cannot publish the group endpoint: ", s.message()));
  } else {
    auto t0 = Clock::now();
    absl::Status last;
    bool found = false;
    while (SecondsSince(t0) < options_.kv_wait_s) {
      if (superseded()) {
        spdlog::info("pre-flight check {} superseded before it started node={}", rc.check_id(), options_.node_id);
        return;
      }
      auto r = client_->KvGet(rc.endpoint_key(), 1.0);
      if (r.ok()) {
        auto ep = ParseEndpoint(*r, -1);
        if (!ep.ok()) return Finish(false, 0, std::string(ep.status().message()));
        addr = ep->host;
        port = ep->port;
        found = true;
        break;
      }
      last = r.status();
      if (!absl::IsNotFound(last) && !Retryable(last)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!found) return Finish(false, 0, absl::StrCat("no group endpoint: ", last.message()));
  }
  const bool fail = options_.chaos.Find("check-fail", options_.node_rank) != nullptr;
  if (fail) spdlog::warn("chaos: check-fail on node rank {}: this node's check will fail", options_.node_rank);
  started_ = Clock::now();
  for (int lr = 0; lr < options_.nproc_per_node; ++lr) {
    SpawnOptions so;
    so.argv = {options_.python, "-u", "-m", "ballast.precheck"};
    so.env = options_.base_env;
    so.env["RANK"] = std::to_string(rc.rank_offset() + lr);
    so.env["LOCAL_RANK"] = std::to_string(lr);
    so.env["WORLD_SIZE"] = std::to_string(rc.world_size());
    so.env["LOCAL_WORLD_SIZE"] = std::to_string(options_.nproc_per_node);
    so.env["GROUP_RANK"] = std::to_string(rc.group_rank());
    so.env["MASTER_ADDR"] = addr;
    so.env["MASTER_PORT"] = std::to_string(port);
    if (so.env.count("OMP_NUM_THREADS") == 0) so.env["OMP_NUM_THREADS"] = "1";
    so.env["BALLAST_PRECHECK_RESULT"] = ResultPath(lr);
    so.env["BALLAST_PRECHECK_MATMUL_SIZE"] = std::to_string(rc.matmul_size());
    so.env["BALLAST_PRECHECK_ALLREDUCE_BYTES"] = std::to_string(rc.allreduce_bytes());
    so.env["BALLAST_PRECHECK_TIMEOUT_S"] = absl::StrCat(rc.timeout_s());
    if (fail) so.env["BALLAST_PRECHECK_FAIL"] = "1";
    so.stdout_file = LogPath(lr);
    so.stderr_to_stdout = true;
    auto p = Subprocess::Spawn(so);
    if (!p.ok()) {
      Stop();
      return Finish(false, 0, absl::StrCat("cannot start the check workers: ", p.status().message()));
    }
    procs_.push_back(std::move(*p));
  }
}

void PrecheckRunner::Poll() {
  if (procs_.empty()) return;
  bool all_exited = true;
  for (auto& p : procs_) {
    if (!p.status().has_value()) p.Poll();
    if (!p.status().has_value()) all_exited = false;
  }
  if (!all_exited) {
    if (SecondsSince(started_) < current_.timeout_s()) return;
    Stop();
    std::string tail = Tail(ReadAll(LogPath(0)), 5);
    return Finish(false, 0, absl::StrCat("timed out after ", current_.timeout_s(), " s", tail.empty() ? "" : ": ",
                                         tail));
  }
  double time_s = 0;
  std::string error;
  for (int lr = 0; lr < static_cast<int>(procs_.size()); ++lr) {
    const ExitStatus& st = *procs_[lr].status();
    if (!st.ok()) {
      if (error.empty()) {
        error = absl::StrCat("local rank ", lr, ": ", st.Describe(), ": ", Tail(ReadAll(LogPath(lr)), 5));
      }
      continue;
    }
    double t = 0;
    std::string text(absl::StripAsciiWhitespace(ReadAll(ResultPath(lr))));
    if (!absl::SimpleAtod(text, &t) || !std::isfinite(t)) {
      if (error.empty()) error = absl::StrCat("local rank ", lr, ": no time in ", ResultPath(lr));
      continue;
    }
    time_s = std::max(time_s, t);
  }
  procs_.clear();
  if (const ChaosFault* slow = options_.chaos.Find("check-slow", options_.node_rank); slow != nullptr) {
    double factor = slow->Number("factor", 1.0);
    spdlog::warn("chaos: check-slow on node rank {}: time {:.3f} s x {}", options_.node_rank, time_s, factor);
    time_s *= factor;
  }
  Finish(error.empty(), time_s, error);
}

void PrecheckRunner::Finish(bool ok, double time_s, const std::string& error) {
  if (ok) {
    spdlog::info("pre-flight check {} passed in {:.3f} s node={}", current_.check_id(), time_s, options_.node_id);
  } else {
    spdlog::error("pre-flight check {} failed: {} node={}", current_.check_id(), error, options_.node_id);
  }
  v1::CheckResult r;
  r.set_node_id(options_.node_id);
  r.set_check_id(current_.check_id());
  r.set_ok(ok);
  r.set_time_s(time_s);
  r.set_error(error);
  auto t0 = Clock::now();
  while (true) {
    absl::Status s = client_->ReportCheckResult(r);
    if (s.ok() || absl::IsAborted(s)) return;
    if (!Retryable(s) || SecondsSince(t0) > 5.0) {
      spdlog::warn("could not report the pre-flight check result: {} node={}", s.ToString(), options_.node_id);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace ballast::agent
