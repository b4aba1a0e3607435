#include "agent/chaos_driver.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/progress_cell.h"

namespace ballast::agent {

ChaosDriver::ChaosDriver(ChaosSpec spec, int node_rank) {
  if (const ChaosFault* f = spec.Find("kill-agent", node_rank); f != nullptr) {
    faults_.push_back({*f, ChaosAction::Kind::kKillAgent});
  }
  if (const ChaosFault* f = spec.Find("partition", node_rank); f != nullptr) {
    faults_.push_back({*f, ChaosAction::Kind::kLinkDown});
  }
  for (const ChaosFault* f : spec.All("kill-worker")) faults_.push_back({*f, ChaosAction::Kind::kKillWorker});
  for (const ChaosFault* f : spec.All("hang")) faults_.push_back({*f, ChaosAction::Kind::kStopWorker});
  // kill-master by step: the launcher decides from the steps the master
  // knows, so every agent (of any incarnation: the launcher waits for every
  // training node) reports its step the moment it reaches the fault's.
  for (const ChaosFault& f : spec.faults) {
    if (f.kind == "kill-master" && f.params.count("at_step") > 0) {
      faults_.push_back({f, ChaosAction::Kind::kReportStep});
    }
  }
}

void ChaosDriver::RoundStarted(uint64_t now_ns, int restart_count) {
  if (first_round_ns_ == 0) first_round_ns_ = now_ns;
  round_ns_ = now_ns;
  restart_count_ = restart_count;
  for (Pending& p : faults_) {
    if (p.kind == ChaosAction::Kind::kReportStep) p.fired = false;
  }
}

std::string ChaosDriver::Describe(const ChaosFault& f) const {
  std::vector<std::string> kv;
  if (f.node >= 0) kv.push_back(absl::StrCat("node=", f.node));
  // As users write it: who first, then when.
  for (const char* key : {"rank", "after", "at_step", "for", "restart"}) {
    if (auto it = f.params.find(key); it != f.params.end()) kv.push_back(absl::StrCat(key, "=", it->second));
  }
  return absl::StrCat(f.kind, ":", absl::StrJoin(kv, ","));
}

std::vector<ChaosAction> ChaosDriver::Due(uint64_t now_ns, const std::vector<Worker>& workers) {
  std::vector<ChaosAction> out;
  if (round_ns_ == 0) return out;
  for (Pending& p : faults_) {
    if (p.restore_ns != 0 && now_ns >= p.restore_ns) {
      p.restore_ns = 0;
      out.push_back({ChaosAction::Kind::kLinkUp, -1, -1, absl::StrCat(Describe(p.fault), " (over)")});
    }
    if (p.fired) continue;
    const ChaosFault& f = p.fault;
    const bool by_step = f.params.count("at_step") > 0;
    const double after_s = f.Number("after", 0);
    const uint64_t at_step = static_cast<uint64_t>(f.Number("at_step", 0));
    if (p.kind == ChaosAction::Kind::kKillAgent || p.kind == ChaosAction::Kind::kLinkDown ||
        p.kind == ChaosAction::Kind::kReportStep) {
      bool due = false;
      std::string why;
      if (by_step) {
        // The node's lowest step: every worker of the node got there.
        uint64_t lowest = UINT64_MAX;
        bool all = !workers.empty();
        for (const Worker& w : workers) {
          if (!w.stepped) all = false;
          lowest = std::min(lowest, w.step);
        }
        due = all && lowest >= at_step;
        if (due) why = absl::StrCat("its workers at step ", lowest);
      } else {
        due = now_ns >= first_round_ns_ + static_cast<uint64_t>(after_s * 1e9);
        if (due) why = absl::StrCat(after_s, " s after its workers first started");
      }
      if (!due) continue;
      p.fired = true;
      ChaosAction a{p.kind, -1, -1, absl::StrCat(Describe(f), " (", why, ")")};
      if (p.kind == ChaosAction::Kind::kLinkDown) {
        a.seconds = f.Number("for", 0);
        p.restore_ns = std::max<uint64_t>(now_ns + static_cast<uint64_t>(a.seconds * 1e9), now_ns + 1);
      }
      out.push_back(std::move(a));
      continue;
    }
    const int rank = static_cast<int>(f.Number("rank", -1));
    if (static_cast<int>(f.Number("restart", 0)) != restart_count_) continue;
    auto w = std::find_if(workers.begin(), workers.end(), [&](const Worker& x) { return x.global_rank == rank; });
    if (w == workers.end() || !w->running || w->pid <= 0) continue;
    bool due = by_step ? (w->stepped && w->step >= at_step)
                       : now_ns >= round_ns_ + static_cast<uint64_t>(after_s * 1e9);
    if (!due) continue;
    p.fired = true;
    out.push_back({p.kind, w->pid, rank,
                   absl::StrCat(Describe(f), " (rank ", rank, ", pid ", w->pid,
                                by_step ? absl::StrCat(", at step ", w->step)
                                        : absl::StrCat(", ", after_s, " s into the round"),
                                ")")});
  }
  return out;
}

DiskChaos::DiskChaos(const ChaosSpec& spec, int node_rank) : made_ns_(MonotonicNowNs()) {
  for (const char* kind : {"disk-full", "disk-error"}) {
    if (const ChaosFault* f = spec.Find(kind, node_rank); f != nullptr && !fault_.has_value()) {
      fault_ = *f;
      full_ = std::string(kind) == "disk-full";
      left_ = static_cast<int>(f->Number("writes", 3));
    }
  }
}

absl::Status DiskChaos::BeforeWrite(uint64_t step, const std::string& dir) {
  if (!fault_.has_value()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  if (left_ <= 0) return absl::OkStatus();
  const bool due = fault_->params.count("at_step") > 0
                       ? step >= static_cast<uint64_t>(fault_->Number("at_step", 0))
                       : MonotonicNowNs() >= made_ns_ + static_cast<uint64_t>(fault_->Number("after", 0) * 1e9);
  if (!due) return absl::OkStatus();
  --left_;
  const int err = full_ ? ENOSPC : EIO;
  const std::string what = absl::StrCat(std::strerror(err), " (chaos ", full_ ? "disk-full" : "disk-error", ", ",
                                        left_, " more failing write(s))");
  return full_ ? absl::ResourceExhaustedError(what) : absl::DataLossError(what);
}

std::optional<std::string> KillMasterDue(const ChaosFault& fault, const v1::JobStatus& status,
                                         double since_start_s) {
  if (fault.params.count("at_step") == 0) {
    const double after_s = fault.Number("after", 0);
    if (since_start_s < after_s) return std::nullopt;
    return absl::StrFormat("%.1f s after it started", since_start_s);
  }
  if (status.state() != "running") return std::nullopt;
  int64_t lowest = -1;
  for (const v1::NodeStatus& n : status.nodes()) {
    if (n.state() != "training") continue;
    lowest = lowest < 0 ? n.last_step() : std::min(lowest, n.last_step());
  }
  if (lowest < 0 || lowest < static_cast<int64_t>(fault.Number("at_step", 0))) return std::nullopt;
  return absl::StrCat("every training node at step ", lowest, " or later");
}

}  // namespace ballast::agent
