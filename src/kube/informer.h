// Informer: a list+watch cache of one collection (client-go's reflector and
// store, reduced to what Ballast needs). It lists the collection, delivers
// every object, then watches from the list's resourceVersion with bookmarks;
// a broken stream is resumed from the last seen resourceVersion with backoff
// (0.2 s doubling to 5 s), and "410 Gone" (the resourceVersion was compacted
// away) relists and delivers the difference: objects that changed as
// MODIFIED, objects that vanished as DELETED. So the handler sees every
// object's latest state at least once, in order per object.
//
// Threading: one thread per informer runs the loop and calls the handler; the
// handler must not block for long. The cache (Get, List) is guarded by a
// mutex and may be read from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kube/kube_client.h"

namespace ballast::kube {

struct InformerOptions {
  std::string path;            // collection path, e.g. CollectionPath("v1", "pods", "ns")
  std::string label_selector;  // "" = all
  std::string field_selector;
  std::string what;            // for messages, e.g. "pods of job ns/train"
  int watch_timeout_s = 300;   // the server ends each watch after this long (then it resumes)
};

class Informer {
 public:
  // type: "ADDED", "MODIFIED" or "DELETED".
  using Handler = std::function<void(const std::string& type, const Json& object)>;

  Informer(KubeClient* client, InformerOptions options, Handler handler);
  ~Informer();  // Stop()
  Informer(const Informer&) = delete;
  Informer& operator=(const Informer&) = delete;

  void Start();
  void Stop();
  // Blocks until the first list was delivered (true) or timeout_s passed.
  bool WaitForSync(double timeout_s);
  bool synced() const { return synced_.load(); }
  // The last error of the loop ("" after a good list/watch), for status.
  std::string last_error() const;

  // Cache keys: "namespace/name", or "name" for cluster-scoped objects.
  static std::string KeyOf(const Json& object);
  std::optional<Json> Get(const std::string& key) const;
  std::vector<Json> List() const;

  // Counters, for tests: lists done (the first and every relist), watches started.
  int lists() const { return lists_.load(); }
  int watches() const { return watches_.load(); }

 private:
  void Loop();
  // Lists and delivers the difference to the cache; returns the list's resourceVersion.
  absl::StatusOr<std::string> ListAndSync();
  void Deliver(const std::string& type, const Json& object);
  std::string Query(bool watch, const std::string& resource_version) const;

  KubeClient* const client_;
  const InformerOptions options_;
  const Handler handler_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> synced_{false};
  std::atomic<int> lists_{0}, watches_{0};
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // synced_, stop_
  std::map<std::string, Json> cache_;  // by KeyOf
  std::string last_error_;
};

}  // namespace ballast::kube
