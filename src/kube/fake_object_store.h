// Test-only: a fake API server (cpp-httplib on loopback) that stores objects
// the way the real one does for GET, POST (create: 409 AlreadyExists), PUT
// (replace: 409 Conflict unless the body's resourceVersion is the stored
// one) and PATCH (merge of the body, or of its .status on a ".../status"
// path: the status subresource; a resourceVersion in the body is a
// precondition, 409 Conflict when it is not the stored one, as for merge
// patches and server-side apply); every write bumps it. Enough for the Lease,
// the master state store and the job fence; the real API server is exercised
// by tests/kubernetes/.
#pragma once

#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "httplib.h"
#include "kube/kube_client.h"

namespace ballast::kube::testing {

class FakeObjectStore {
 public:
  FakeObjectStore() {
    auto handler = [this](const httplib::Request& req, httplib::Response& res) { Handle(req, res); };
    server_.Get(".*", handler);
    server_.Post(".*", handler);
    server_.Put(".*", handler);
    server_.Patch(".*", handler);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) usleep(1000);
  }
  ~FakeObjectStore() {
    server_.stop();
    thread_.join();
  }
  KubeConfig Config() const {
    KubeConfig c;
    c.server = "http://127.0.0.1:" + std::to_string(port_);
    c.token = "t";
    return c;
  }
  // The stored object at path (null when none).
  Json Object(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(path);
    return it == objects_.end() ? Json() : it->second;
  }
  // Writes as another client would (bumps the resourceVersion).
  void Put(const std::string& path, Json object) {
    std::lock_guard<std::mutex> lock(mu_);
    object["metadata"]["resourceVersion"] = std::to_string(++version_);
    objects_[path] = std::move(object);
  }
  // Every request fails with 503 while set (the API server unreachable).
  std::atomic<bool> unavailable{false};
  std::atomic<int> writes{0};
  // Called with the path before each PATCH is handled (without the store's
  // lock: it may Put), so a test can write as another client would between
  // a client's read and its write. Set it before the requests it is for.
  std::function<void(const std::string& path)> before_patch;

 private:
  static void Fail(httplib::Response& res, int code, const std::string& reason) {
    res.status = code;
    res.set_content(Json{{"kind", "Status"}, {"code", code}, {"reason", reason}, {"message", reason}}.dump(),
                    "application/json");
  }
  void Handle(const httplib::Request& req, httplib::Response& res) {
    if (unavailable.load()) return Fail(res, 503, "ServiceUnavailable");
    if (req.method == "PATCH" && before_patch) before_patch(req.path);
    std::lock_guard<std::mutex> lock(mu_);
    if (req.method == "GET") {
      auto it = objects_.find(req.path);
      if (it == objects_.end()) return Fail(res, 404, "NotFound");
      res.set_content(it->second.dump(), "application/json");
      return;
    }
    Json body = Json::parse(req.body);
    std::string path = req.path;
    if (req.method == "PATCH") {
      const std::string kStatus = "/status";
      const bool status = path.size() > kStatus.size() &&
                          path.compare(path.size() - kStatus.size(), kStatus.size(), kStatus) == 0;
      if (status) path.resize(path.size() - kStatus.size());
      auto it = objects_.find(path);
      if (it == objects_.end()) return Fail(res, 404, "NotFound");
      const std::string want = body.contains("metadata") ? body["metadata"].value("resourceVersion", "") : "";
      if (!want.empty() && want != it->second["metadata"].value("resourceVersion", "")) {
        return Fail(res, 409, "Conflict");
      }
      if (body.contains("metadata")) body["metadata"].erase("resourceVersion");
      if (status) {
        it->second["status"].merge_patch(body.value("status", Json::object()));
      } else {
        it->second.merge_patch(body);
      }
      it->second["metadata"]["resourceVersion"] = std::to_string(++version_);
      ++writes;
      res.set_content(it->second.dump(), "application/json");
      return;
    }
    if (req.method == "POST") {
      path += "/" + body["metadata"]["name"].get<std::string>();
      if (objects_.count(path) > 0) return Fail(res, 409, "AlreadyExists");
    } else {
      auto it = objects_.find(path);
      if (it == objects_.end()) return Fail(res, 404, "NotFound");
      if (body["metadata"].value("resourceVersion", "") != it->second["metadata"].value("resourceVersion", "")) {
        return Fail(res, 409, "Conflict");
      }
    }
    body["metadata"]["resourceVersion"] = std::to_string(++version_);
    objects_[path] = body;
    ++writes;
    res.status = req.method == "POST" ? 201 : 200;
    res.set_content(body.dump(), "application/json");
  }

  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::map<std::string, Json> objects_;
  int64_t version_ = 0;
};

}  // namespace ballast::kube::testing
