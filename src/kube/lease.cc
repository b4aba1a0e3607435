#include "kube/lease.h"

#include <sys/time.h>

#include <algorithm>
#include <cstdio>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"

namespace ballast::kube {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string LeasePath(const std::string& ns, const std::string& name) {
  return ObjectPath("coordination.k8s.io/v1", "leases", ns, name);
}

}  // namespace

std::string MicroTimeNow() {
  timeval tv{};
  gettimeofday(&tv, nullptr);
  std::tm tm{};
  gmtime_r(&tv.tv_sec, &tm);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  char out[48];
  std::snprintf(out, sizeof(out), "%s.%06ldZ", buf, static_cast<long>(tv.tv_usec));
  return out;
}

LeaderLease::LeaderLease(KubeClient* client, LeaseOptions options)
    : client_(client), options_(std::move(options)) {}

LeaderLease::~LeaderLease() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string LeaderLease::lost_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_reason_;
}

void LeaderLease::Lose(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!held_.load()) return;
    held_ = false;
    lost_reason_ = why;
  }
  spdlog::error("lost {}: {}", options_.what, why);
}

absl::StatusOr<bool> LeaderLease::TryAcquireOrRenew() {
  const std::string path = LeasePath(options_.ns, options_.name);
  const std::string now = MicroTimeNow();
  const std::map<std::string, std::string>& annotations = options_.annotations;
  auto current = client_->Get(path, absl::StrCat("get ", options_.what));
  if (!current.ok() && !absl::IsNotFound(current.status())) return current.status();
  if (!current.ok()) {
    Json lease = {{"apiVersion", "coordination.k8s.io/v1"},
                  {"kind", "Lease"},
                  {"metadata", {{"name", options_.name}, {"namespace", options_.ns}}},
                  {"spec",
                   {{"holderIdentity", options_.identity},
                    {"leaseDurationSeconds", static_cast<int>(options_.lease_duration_s + 0.999)},
                    {"acquireTime", now},
                    {"renewTime", now},
                    {"leaseTransitions", 0}}}};
    for (const auto& [k, v] : annotations) lease["metadata"]["annotations"][k] = v;
    if (!options_.owner_reference.is_null()) lease["metadata"]["ownerReferences"] = Json::array({options_.owner_reference});
    auto r = client_->Create(CollectionPath("coordination.k8s.io/v1", "leases", options_.ns), lease,
                             absl::StrCat("create ", options_.what));
    if (absl::IsAlreadyExists(r.status())) return false;  // another candidate was first
    if (!r.ok()) return r.status();
    return true;
  }
  Json lease = *current;
  const std::string holder = Str(lease, {"spec", "holderIdentity"});
  // The record as a whole: any change (a renewal) restarts the clock.
  const std::string record = absl::StrCat(holder, "|", Str(lease, {"spec", "renewTime"}), "|",
                                          Str(lease, {"metadata", "resourceVersion"}));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (record != observed_record_) {
      observed_record_ = record;
      observed_at_ = Clock::now();
    }
    const double duration = std::max<double>(Int(lease, {"spec", "leaseDurationSeconds"}, 0), 1);
    if (!holder.empty() && holder != options_.identity && SecondsSince(observed_at_) < duration) {
      return false;  // someone else holds it and renews it
    }
  }
  Json& spec = lease["spec"];
  if (holder != options_.identity) {
    spec["acquireTime"] = now;
    spec["leaseTransitions"] = Int(lease, {"spec", "leaseTransitions"}) + 1;
  }
  spec["holderIdentity"] = options_.identity;
  spec["renewTime"] = now;
  spec["leaseDurationSeconds"] = static_cast<int>(options_.lease_duration_s + 0.999);
  for (const auto& [k, v] : annotations) lease["metadata"]["annotations"][k] = v;
  // Conditional on the resourceVersion read (it is in the body): a
  // concurrent writer makes this a Conflict.
  auto r = client_->Replace(path, lease, absl::StrCat("update ", options_.what));
  if (absl::IsAborted(r.status())) return false;
  if (!r.ok()) return r.status();
  return true;
}

absl::Status LeaderLease::Acquire(const std::atomic<int>* stop, double timeout_s,
                                  const std::function<void(const std::string&)>& on_wait) {
  const auto start = Clock::now();
  bool told = false;
  absl::Status last;
  while (true) {
    auto r = TryAcquireOrRenew();
    if (r.ok() && *r) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        renewed_at_ = Clock::now();
        held_ = true;
        lost_reason_.clear();
      }
      spdlog::info("holding {} as {}", options_.what, options_.identity);
      thread_ = std::thread([this] { RenewLoop(); });
      return absl::OkStatus();
    }
    if (!r.ok()) {
      last = r.status();
      spdlog::warn("cannot take {} yet: {}", options_.what, last.ToString());
    } else if (!told && on_wait) {
      told = true;
      auto cur = client_->Get(LeasePath(options_.ns, options_.name), absl::StrCat("get ", options_.what));
      on_wait(cur.ok() ? Str(*cur, {"spec", "holderIdentity"}) : "?");
    }
    // Looks again soon: a holder that releases it (its pod being deleted)
    // hands over within a quarter second.
    const double wait_s = std::min(options_.retry_s, 0.25);
    for (int i = 0; i < 5; ++i) {
      if (stop != nullptr && stop->load() != 0) return absl::CancelledError("stopped while waiting for the lease");
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::duration<double>(wait_s / 5));
    }
    if (timeout_s >= 0 && SecondsSince(start) > timeout_s) {
      return absl::DeadlineExceededError(absl::StrCat("could not take ", options_.what, " within ", timeout_s, " s",
                                                      last.ok() ? "" : absl::StrCat(": ", last.message())));
    }
  }
}

void LeaderLease::RenewLoop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::duration<double>(options_.retry_s), [&] { return stop_; });
      if (stop_) return;
    }
    if (!held_.load()) return;
    auto r = TryAcquireOrRenew();
    if (r.ok() && *r) {
      std::lock_guard<std::mutex> lock(mu_);
      renewed_at_ = Clock::now();
      continue;
    }
    if (r.ok()) {
      // Refused: another candidate wrote it since (it holds it now).
      Lose("another holder took it");
      return;
    }
    double since;
    {
      std::lock_guard<std::mutex> lock(mu_);
      since = SecondsSince(renewed_at_);
    }
    spdlog::warn("cannot renew {}: {}", options_.what, r.status().ToString());
    if (since >= options_.renew_deadline_s) {
      Lose(absl::StrFormat("not renewed for %.1f s (%s)", since, std::string(r.status().message())));
      return;
    }
  }
}

void LeaderLease::Release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (!held_.exchange(false)) return;
  const std::string path = LeasePath(options_.ns, options_.name);
  auto cur = client_->Get(path, absl::StrCat("get ", options_.what));
  if (!cur.ok() || Str(*cur, {"spec", "holderIdentity"}) != options_.identity) return;
  Json lease = *cur;
  lease["spec"]["holderIdentity"] = "";
  lease["spec"]["leaseDurationSeconds"] = 1;
  lease["spec"]["renewTime"] = MicroTimeNow();
  auto r = client_->Replace(path, lease, absl::StrCat("release ", options_.what));
  if (r.ok()) {
    spdlog::info("released {}", options_.what);
  } else {
    spdlog::warn("cannot release {} (the next holder waits out its {} s): {}", options_.what,
                 options_.lease_duration_s, r.status().ToString());
  }
}

absl::StatusOr<std::string> LeaseAnnotation(KubeClient* client, const std::string& ns, const std::string& name,
                                            const std::string& key) {
  auto lease = client->Get(LeasePath(ns, name), absl::StrCat("get lease ", ns, "/", name));
  if (absl::IsNotFound(lease.status())) return std::string();
  if (!lease.ok()) return lease.status();
  if (Str(*lease, {"spec", "holderIdentity"}).empty()) return std::string();
  const Json* a = Find(*lease, {"metadata", "annotations"});
  if (a == nullptr || !a->is_object() || !a->contains(key) || !(*a)[key].is_string()) return std::string();
  return (*a)[key].get<std::string>();
}

}  // namespace ballast::kube
