#include "scheduler/kubernetes/master_state.h"

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ballast::scheduler::kubernetes {

using kube::Json;

MasterStateStore::MasterStateStore(kube::KubeClient* client, const ElasticJobSpec& job, std::string holder)
    : client_(client), job_(job), holder_(std::move(holder)) {}

Json MasterStateStore::Build(const std::string& payload, uint64_t seq) const {
  Json cm = {{"apiVersion", "v1"},
             {"kind", "ConfigMap"},
             {"metadata",
              {{"name", Name()},
               {"namespace", job_.ns},
               {"labels", {{kJobLabel, job_.name}, {kRoleLabel, "master-state"}}},
               {"ownerReferences", Json::array({OwnerReference(job_)})}}},
             {"data", {{"holder", holder_}, {"seq", std::to_string(seq)}, {"job-uid", job_.uid}}},
             {"binaryData", {{"snapshot", absl::Base64Escape(payload)}}}};
  if (!resource_version_.empty()) cm["metadata"]["resourceVersion"] = resource_version_;
  return cm;
}

absl::StatusOr<std::optional<v1::MasterSnapshot>> MasterStateStore::Load() {
  auto cm = client_->Get(kube::ObjectPath("v1", "configmaps", job_.ns, Name()),
                         absl::StrCat("get ConfigMap ", job_.ns, "/", Name(), " (the job master's state)"));
  if (absl::IsNotFound(cm.status())) return std::optional<v1::MasterSnapshot>();
  if (!cm.ok()) return cm.status();
  resource_version_ = kube::Str(*cm, {"metadata", "resourceVersion"});
  last_holder_ = kube::Str(*cm, {"data", "holder"});
  const std::string b64 = kube::Str(*cm, {"binaryData", "snapshot"});
  std::string payload;
  v1::MasterSnapshot state;
  if (!absl::Base64Unescape(b64, &payload) || !state.ParseFromString(payload)) {
    return absl::DataLossError(absl::StrCat("ConfigMap ", job_.ns, "/", Name(), " (written by ", last_holder_,
                                            ") does not hold a readable master state; delete it to start the job "
                                            "over from its checkpoints"));
  }
  if (!state.has_job()) return std::optional<v1::MasterSnapshot>();
  // A job deleted and created again under the same name: its state is the
  // old job's until the garbage collector removes it.
  if (const std::string uid = kube::Str(*cm, {"data", "job-uid"}); !uid.empty() && uid != job_.uid) {
    spdlog::warn("kubernetes: ConfigMap {}/{} holds the state of an earlier ElasticJob {} (uid {}, not {}): "
                 "starting anew",
                 job_.ns, Name(), job_.name, uid, job_.uid);
    return std::optional<v1::MasterSnapshot>();
  }
  return std::optional<v1::MasterSnapshot>(std::move(state));
}

absl::StatusOr<Json> MasterStateStore::Write(const std::string& payload, uint64_t seq) {
  const std::string what = absl::StrCat("store the master state in ConfigMap ", job_.ns, "/", Name());
  if (resource_version_.empty()) {
    return client_->Create(kube::CollectionPath("v1", "configmaps", job_.ns), Build(payload, seq), what);
  }
  return client_->Replace(kube::ObjectPath("v1", "configmaps", job_.ns, Name()), Build(payload, seq), what);
}

absl::StatusOr<std::optional<v1::MasterSnapshot>> MasterStateStore::Claim() {
  for (int attempt = 0; attempt < 5; ++attempt) {
    resource_version_.clear();
    auto state = Load();
    if (!state.ok()) return state.status();
    std::string payload;
    if (state->has_value()) (*state)->SerializeToString(&payload);
    claimed_from_ = last_holder_;
    auto r = Write(payload, state->has_value() ? (*state)->last_seq() : 0);
    if (r.ok()) {
      resource_version_ = kube::Str(*r, {"metadata", "resourceVersion"});
      last_holder_ = holder_;
      return state;
    }
    // Written meanwhile (the last master's final write): read it again.
    if (!absl::IsAborted(r.status()) && !absl::IsAlreadyExists(r.status())) return r.status();
  }
  return absl::AbortedError(absl::StrCat("ConfigMap ", job_.ns, "/", Name(),
                                         " (the job master's state) keeps changing: is another master of the job "
                                         "running without its Lease?"));
}

absl::Status MasterStateStore::Save(const v1::MasterSnapshot& state) {
  std::string payload;
  state.SerializeToString(&payload);
  if (payload.size() > kMaxMasterStateBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the master's state is ", payload.size(),
                                                     " bytes, more than a ConfigMap holds (", kMaxMasterStateBytes,
                                                     "): a lost master pod cannot resume this job"));
  }
  const std::string what = absl::StrCat("store the master state in ConfigMap ", job_.ns, "/", Name());
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<Json> r = Write(payload, state.last_seq());
    if (r.ok()) {
      resource_version_ = kube::Str(*r, {"metadata", "resourceVersion"});
      last_holder_ = holder_;
      bytes_saved_ = payload.size();
      return absl::OkStatus();
    }
    if (!absl::IsAborted(r.status()) && !absl::IsAlreadyExists(r.status())) return r.status();
    // Someone wrote it since: us (a write whose answer was lost) or a newer master.
    auto cur = client_->Get(kube::ObjectPath("v1", "configmaps", job_.ns, Name()), what);
    if (!cur.ok()) return cur.status();
    last_holder_ = kube::Str(*cur, {"data", "holder"});
    if (last_holder_ != holder_) {
      return absl::FailedPreconditionError(
          absl::StrCat("master ", last_holder_, " stored the job's state since this master (", holder_,
                       ") did: it acts for the job now"));
    }
    resource_version_ = kube::Str(*cur, {"metadata", "resourceVersion"});
  }
  return absl::AbortedError(absl::StrCat(what, ": it keeps changing"));
}

MasterStateMirror::MasterStateMirror(MasterStateStore* store,
                                     std::function<std::optional<v1::MasterSnapshot>(uint64_t)> state_after,
                                     double interval_s)
    : store_(store), state_after_(std::move(state_after)), interval_s_(interval_s) {}

MasterStateMirror::~MasterStateMirror() { Stop(false); }

std::string MasterStateMirror::fenced_why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fenced_why_;
}

void MasterStateMirror::Start() {
  thread_ = std::thread([this] {
    int64_t round_saved = -1;
    auto last = std::chrono::steady_clock::now() - std::chrono::hours(1);
    while (!fenced_.load()) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; })) return;
      }
      const int64_t round = round_.load();
      if (round == round_saved &&
          std::chrono::steady_clock::now() - last < std::chrono::duration<double>(interval_s_)) {
        continue;
      }
      round_saved = round;
      last = std::chrono::steady_clock::now();
      SaveIfChanged();
    }
  });
}

void MasterStateMirror::Stop(bool final_save) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (final_save && !fenced_.load()) SaveIfChanged();
}

void MasterStateMirror::SaveIfChanged() {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<v1::MasterSnapshot> state = state_after_(saved_seq_);
  if (!state.has_value()) return;
  absl::Status s = store_->Save(*state);
  if (s.ok()) {
    saved_seq_ = state->last_seq();
    return;
  }
  if (absl::IsFailedPrecondition(s)) {
    fenced_why_ = std::string(s.message());
    fenced_ = true;
    return;
  }
  if (!warned_ || !absl::IsResourceExhausted(s)) spdlog::warn("kubernetes: {}", std::string(s.message()));
  warned_ = true;
}

}  // namespace ballast::scheduler::kubernetes
