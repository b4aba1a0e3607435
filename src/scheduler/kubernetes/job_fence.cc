#include "scheduler/kubernetes/job_fence.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler::kubernetes {

using kube::Json;

JobFence::JobFence(kube::KubeClient* client, const ElasticJobSpec& job) : client_(client), job_(job) {}

JobFence::~JobFence() { Stop(); }

void JobFence::Start() {
  if (informer_) return;
  kube::InformerOptions io;
  io.path = kube::CollectionPath(kApiVersion, kPlural, job_.ns);
  io.field_selector = absl::StrCat("metadata.name=", job_.name);
  io.what = absl::StrCat("ElasticJob ", job_.Describe());
  informer_ = std::make_unique<kube::Informer>(client_, io, [this](const std::string& type, const Json& obj) {
    if (type == "DELETED") {
      Fence(absl::StrCat("the ElasticJob ", job_.Describe(), " was deleted"));
    } else {
      Observe(obj);
    }
  });
  informer_->Start();
}

void JobFence::Stop() {
  if (informer_) informer_->Stop();
}

std::string JobFence::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

void JobFence::Fence(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!why_.empty()) return;
    why_ = why;
    fenced_ = true;  // after why_: whoever sees it fenced reads why
  }
  spdlog::warn("{}: its master stops acting for it (no pod created, replaced or deleted, no status or event "
               "written); the operator deletes its pods",
               why);
}

void JobFence::Observe(const Json& obj) {
  const std::string uid = kube::Str(obj, {"metadata", "uid"});
  if (!uid.empty() && !job_.uid.empty() && uid != job_.uid) {
    Fence(absl::StrCat("the ElasticJob ", job_.Describe(), " was deleted and created again (uid ", uid, ", this "
                       "master's job was ", job_.uid, ")"));
    return;
  }
  const Json* suspend = kube::Find(obj, {"spec", "suspend"});
  if (suspend != nullptr && suspend->is_boolean() && suspend->get<bool>()) {
    Fence(absl::StrCat("the ElasticJob ", job_.Describe(), " is suspended (spec.suspend)"));
  }
}

absl::StatusOr<Json> JobFence::Read() {
  auto obj = client_->Get(kube::ObjectPath(kApiVersion, kPlural, job_.ns, job_.name),
                          absl::StrCat("get ElasticJob ", job_.Describe()));
  if (absl::IsNotFound(obj.status())) Fence(absl::StrCat("the ElasticJob ", job_.Describe(), " was deleted"));
  if (obj.ok()) Observe(*obj);
  return obj;
}

absl::StatusOr<bool> JobFence::Confirm() {
  if (fenced()) return true;
  auto obj = Read();
  if (!obj.ok() && !fenced()) return obj.status();
  return fenced();
}

absl::Status JobFence::ApplyStatus(Json body, const std::string& field_manager) {
  const std::string path = kube::ObjectPath(kApiVersion, kPlural, job_.ns, job_.name) + "/status";
  const std::string what = absl::StrCat("update the status of ElasticJob ", job_.Describe());
  constexpr int kAttempts = 5;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    if (fenced()) return absl::FailedPreconditionError(why());
    auto obj = Read();
    if (fenced()) return absl::FailedPreconditionError(why());
    if (!obj.ok()) return obj.status();
    // The API server refuses the write (Conflict) when the job changed since
    // this read: a suspension written in between is never overwritten.
    body["metadata"]["resourceVersion"] = kube::Str(*obj, {"metadata", "resourceVersion"});
    auto r = client_->Apply(path, body, field_manager, what);
    if (r.ok()) return absl::OkStatus();
    if (!absl::IsAborted(r.status())) return r.status();
  }
  return absl::AbortedError(absl::StrCat(what, ": the job changed under each of ", kAttempts, " attempts"));
}

// --- FencedScheduler ---

FencedScheduler::FencedScheduler(SchedulerInterface* inner, JobFence* fence, NodeCallbacks forward, double retry_s)
    : inner_(inner), fence_(fence), forward_(std::move(forward)), retry_s_(retry_s) {}

void FencedScheduler::OnNodeLost(const std::string& node_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  notices_.push_back({node_id, reason, false});
}

void FencedScheduler::OnNodeExcluded(const std::string& node_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  notices_.push_back({node_id, reason, true});
}

size_t FencedScheduler::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size() + notices_.size();
}

std::vector<NodeEvent> FencedScheduler::Poll() {
  for (NodeEvent& e : inner_->Poll()) events_.push_back(std::move(e));
  std::vector<Notice> notices;
  {
    std::lock_guard<std::mutex> lock(mu_);
    notices.swap(notices_);
  }
  auto hold = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    notices_.insert(notices_.begin(), notices.begin(), notices.end());
  };
  if (fence_->fenced()) {
    hold();
    return {};
  }
  auto decides = [](const NodeEvent& e) {
    return e.kind == NodeEvent::Kind::kExited || e.kind == NodeEvent::Kind::kLost;
  };
  if (notices.empty() && std::none_of(events_.begin(), events_.end(), decides)) return std::exchange(events_, {});
  // A node ended, vanished, or the master lost it: the operator may be
  // deleting the pods of a job suspended a moment ago. Only a read of the job
  // made now says whether it was (see the file comment of job_fence.h).
  const auto now = std::chrono::steady_clock::now();
  absl::StatusOr<bool> suspended = absl::UnavailableError("read again shortly");
  if (now >= next_read_) suspended = fence_->Confirm();
  if (suspended.ok() && *suspended) {
    hold();
    return {};
  }
  if (!suspended.ok()) {
    if (now >= next_read_) {
      next_read_ = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(retry_s_));
      if (!warned_) {
        spdlog::warn("kubernetes: {}; nodes that ended or were lost are replaced once the job can be read (it "
                     "may have been suspended: then nothing is replaced)",
                     std::string(suspended.status().message()));
      }
      warned_ = true;
    }
    hold();
    std::vector<NodeEvent> pass, keep;
    for (NodeEvent& e : events_) (decides(e) ? keep : pass).push_back(std::move(e));
    events_ = std::move(keep);
    return pass;
  }
  if (warned_) spdlog::info("kubernetes: the ElasticJob could be read again and is not suspended: acting on the "
                            "nodes that ended meanwhile");
  warned_ = false;
  for (const Notice& n : notices) {
    const auto& to = n.excluded ? forward_.excluded : forward_.lost;
    if (to) to(n.node_id, n.reason);
  }
  return std::exchange(events_, {});
}

}  // namespace ballast::scheduler::kubernetes
