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

std::string PrecheckRunner::GenerationDir() const { return absl::StrCat(dir_, "/gen", generation_); }
std::string PrecheckRunner::ServerLog(int lr) const { return absl::StrCat(GenerationDir(), "/server-", lr, ".log"); }
std::string PrecheckRunner::RequestPath(int lr) const {
  return absl::StrCat(GenerationDir(), "/req-", lr, "-", seq_);
}
std::string PrecheckRunner::ResultPath(int lr) const {
  return absl::StrCat(GenerationDir(), "/res-", lr, "-", seq_);
}

void PrecheckRunner::Stop() {
  for (auto& p : servers_) {
    if (p.running()) p.Terminate(1.0);
  }
  servers_.clear();
  check_running_ = false;
}

absl::Status PrecheckRunner::EnsureServers() {
  if (dir_.empty()) return absl::InternalError("no temporary directory for the check servers");
  if (!servers_.empty() && std::all_of(servers_.begin(), servers_.end(), [](Subprocess& p) {
        p.Poll();
        return p.running();
      })) {
    return absl::OkStatus();
  }
  Stop();
  std::error_code ec;
  if (generation_ > 0) std::filesystem::remove_all(GenerationDir(), ec);  // its errors were reported
  ++generation_;
  seq_ = 0;
  std::filesystem::create_directories(GenerationDir(), ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", GenerationDir(), ": ", ec.message()));
  for (int lr = 0; lr < options_.nproc_per_node; ++lr) {
    SpawnOptions so;
    so.argv = {options_.python, "-u", "-m", "ballast.precheck", "--serve", GenerationDir()};
    so.env = options_.base_env;
    so.env["LOCAL_RANK"] = std::to_string(lr);
    so.env["LOCAL_WORLD_SIZE"] = std::to_string(options_.nproc_per_node);
    if (so.env.count("OMP_NUM_THREADS") == 0) so.env["OMP_NUM_THREADS"] = "1";
    so.stdout_file = ServerLog(lr);
    so.stderr_to_stdout = true;
    auto p = Subprocess::Spawn(so);
    if (!p.ok()) {
      Stop();
      return absl::Status(p.status().code(), absl::StrCat("cannot start the check servers: ", p.status().message()));
    }
    servers_.push_back(std::move(*p));
  }
  spdlog::info("started {} pre-flight check server(s) node={}", servers_.size(), options_.node_id);
  return absl::OkStatus();
}

void PrecheckRunner::Warm() {
  if (absl::Status s = EnsureServers(); !s.ok()) {
    spdlog::warn("pre-flight check servers: {} node={}", std::string(s.message()), options_.node_id);
  }
}

void PrecheckRunner::Start(const v1::RunCheck& rc, const std::function<bool()>& superseded) {
  if (rc.check_id() <= last_check_id_) return;  // a reconnecting watch re-sends the current decision
  if (check_running_) Stop();  // an unfinished older check: its servers are in an unknown state
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
  if (absl::Status s = EnsureServers(); !s.ok()) return Finish(false, 0, std::string(s.message()));
  ++seq_;
  for (int lr = 0; lr < options_.nproc_per_node; ++lr) {
    const std::string request =
        absl::StrCat("rank ", rc.rank_offset() + lr, "\nworld_size ", rc.world_size(), "\nmaster_addr ", addr,
                     "\nmaster_port ", port, "\nmatmul_size ", rc.matmul_size(), "\nallreduce_bytes ",
                     rc.allreduce_bytes(), "\ntimeout_s ", rc.timeout_s(), "\nfail ", fail ? 1 : 0, "\n");
    // Written whole, then renamed: the server never reads half a request.
    const std::string tmp = RequestPath(lr) + ".tmp";
    {
      std::ofstream out(tmp);
      out << request;
    }
    std::error_code ec;
    std::filesystem::rename(tmp, RequestPath(lr), ec);
    if (ec) {
      Stop();
      return Finish(false, 0, absl::StrCat("cannot write the check request ", RequestPath(lr), ": ", ec.message()));
    }
  }
  started_ = Clock::now();
  check_running_ = true;
}

void PrecheckRunner::Poll() {
  if (!check_running_) return;
  struct Result {
    bool done = false;
    bool ok = false;
    double time_s = 0;
    std::string error;
  };
  std::vector<Result> results(servers_.size());
  bool all_done = true;
  for (int lr = 0; lr < static_cast<int>(servers_.size()); ++lr) {
    Result& r = results[lr];
    const std::string text = ReadAll(ResultPath(lr));
    if (!text.empty()) {
      r.done = true;
      // "ok 0|1\ntime_s T\nerror TEXT..."
      size_t error_at = text.find("\nerror ");
      for (absl::string_view line : absl::StrSplit(text.substr(0, error_at), '\n')) {
        std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits(' ', 1));
        if (kv.first == "ok") r.ok = kv.second == "1";
        if (kv.first == "time_s" && (!absl::SimpleAtod(kv.second, &r.time_s) || !std::isfinite(r.time_s))) {
          r.ok = false;
        }
      }
      if (error_at != std::string::npos) r.error = text.substr(error_at + 7);
      if (!r.ok && r.error.empty()) r.error = absl::StrCat("no valid result in ", ResultPath(lr));
      continue;
    }
    servers_[lr].Poll();
    if (!servers_[lr].running()) {
      r.done = true;
      r.error = absl::StrCat("check server ", servers_[lr].status()->Describe(), ": ", Tail(ReadAll(ServerLog(lr)), 5));
      continue;
    }
    all_done = false;
  }
  if (!all_done) {
    if (SecondsSince(started_) < current_.timeout_s()) return;
    std::string tail = Tail(ReadAll(ServerLog(0)), 5);
    Stop();
    return Finish(false, 0, absl::StrCat("timed out after ", current_.timeout_s(), " s", tail.empty() ? "" : ": ",
                                         tail));
  }
  check_running_ = false;
  double time_s = 0;
  std::string error;
  for (int lr = 0; lr < static_cast<int>(results.size()); ++lr) {
    if (!results[lr].ok) {
      if (error.empty()) error = absl::StrCat("local rank ", lr, ": ", results[lr].error);
      continue;
    }
    time_s = std::max(time_s, results[lr].time_s);
  }
  // A server that failed a check exits (see precheck.py); do not wait for
  // that: the next check starts a new generation.
  if (!error.empty()) Stop();
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
