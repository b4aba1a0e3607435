#include "kube/informer.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ballast::kube {

Informer::Informer(KubeClient* client, InformerOptions options, Handler handler)
    : client_(client), options_(std::move(options)), handler_(std::move(handler)) {}

Informer::~Informer() { Stop(); }

void Informer::Start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { Loop(); });
}

void Informer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Informer::WaitForSync(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return synced_.load() || stop_.load(); });
  return synced_.load();
}

std::string Informer::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

std::string Informer::KeyOf(const Json& object) {
  std::string ns = Str(object, {"metadata", "namespace"});
  std::string name = Str(object, {"metadata", "name"});
  return ns.empty() ? name : absl::StrCat(ns, "/", name);
}

std::optional<Json> Informer::Get(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cache_.find(key);
  if (it == cache_.end()) return std::nullopt;
  return it->second;
}

std::vector<Json> Informer::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Json> out;
  out.reserve(cache_.size());
  for (const auto& [k, v] : cache_) out.push_back(v);
  return out;
}

std::string Informer::Query(bool watch, const std::string& rv) const {
  std::string q;
  auto add = [&](const std::string& k, const std::string& v) {
    absl::StrAppend(&q, q.empty() ? "?" : "&", k, "=", UrlEncode(v));
  };
  if (!options_.label_selector.empty()) add("labelSelector", options_.label_selector);
  if (!options_.field_selector.empty()) add("fieldSelector", options_.field_selector);
  if (watch) {
    add("watch", "1");
    add("allowWatchBookmarks", "true");
    add("timeoutSeconds", std::to_string(options_.watch_timeout_s));
    if (!rv.empty()) add("resourceVersion", rv);
  }
  return options_.path + q;
}

void Informer::Deliver(const std::string& type, const Json& object) {
  const std::string key = KeyOf(object);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (type == "DELETED") {
      cache_.erase(key);
    } else {
      cache_[key] = object;
    }
  }
  handler_(type, object);
}

absl::StatusOr<std::string> Informer::ListAndSync() {
  auto list = client_->Get(Query(false, ""), absl::StrCat("list ", options_.what));
  if (!list.ok()) return list.status();
  ++lists_;
  std::map<std::string, Json> fresh;
  if (const Json* items = Find(*list, {"items"}); items != nullptr && items->is_array()) {
    for (const Json& item : *items) fresh[KeyOf(item)] = item;
  }
  std::map<std::string, Json> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = cache_;
  }
  for (const auto& [key, obj] : old) {
    if (fresh.count(key) == 0) Deliver("DELETED", obj);
  }
  for (const auto& [key, obj] : fresh) {
    auto it = old.find(key);
    if (it == old.end()) {
      Deliver("ADDED", obj);
    } else if (Str(it->second, {"metadata", "resourceVersion"}) != Str(obj, {"metadata", "resourceVersion"})) {
      Deliver("MODIFIED", obj);
    }
  }
  return Str(*list, {"metadata", "resourceVersion"});
}

void Informer::Loop() {
  double backoff = 0.2;
  std::string rv;
  bool need_list = true;
  auto sleep_backoff = [&] {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double>(backoff), [&] { return stop_.load(); });
    backoff = std::min(5.0, backoff * 2);
  };
  auto set_error = [&](const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    last_error_ = s.ok() ? "" : std::string(s.message());
  };
  while (!stop_.load()) {
    if (need_list) {
      auto listed = ListAndSync();
      if (!listed.ok()) {
        set_error(listed.status());
        spdlog::warn("kubernetes: {} (retrying in {:.1f} s)", std::string(listed.status().message()), backoff);
        sleep_backoff();
        continue;
      }
      rv = *listed;
      need_list = false;
      if (!synced_.exchange(true)) {
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
      }
    }
    ++watches_;
    bool gone = false;
    bool error_event = false;
    bool got_event = false;
    const auto started = std::chrono::steady_clock::now();
    absl::Status s = client_->Watch(
        Query(true, rv), absl::StrCat("watch ", options_.what),
        [&](const WatchEvent& e) {
          if (e.type == "ERROR") {
            // A Status object; 410 means our resourceVersion is too old.
            gone = Int(e.object, {"code"}) == 410;
            error_event = !gone;
            if (error_event) spdlog::warn("kubernetes: watch {}: {}", options_.what, Str(e.object, {"message"}));
            return false;
          }
          got_event = true;
          const std::string erv = Str(e.object, {"metadata", "resourceVersion"});
          if (!erv.empty()) rv = erv;
          if (e.type == "BOOKMARK") return true;
          Deliver(e.type, e.object);
          return !stop_.load();
        },
        &stop_);
    if (stop_.load()) break;
    if (gone || HttpStatus(s) == 410) {
      spdlog::info("kubernetes: watch {}: resourceVersion {} is too old (410 Gone); relisting", options_.what, rv);
      need_list = true;
      continue;
    }
    if (!s.ok() || error_event) {
      if (!s.ok()) set_error(s);
      if (!s.ok()) spdlog::warn("kubernetes: {} (resuming in {:.1f} s)", std::string(s.message()), backoff);
      need_list = error_event;
      sleep_backoff();
      continue;
    }
    set_error(absl::OkStatus());
    if (got_event) backoff = 0.2;
    // The server ended the watch (timeoutSeconds): resume from rv at once,
    // unless it ended at once without a word (then back off).
    if (!got_event && std::chrono::steady_clock::now() - started < std::chrono::seconds(1)) sleep_backoff();
  }
}

}  // namespace ballast::kube
