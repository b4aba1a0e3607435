// A small Kubernetes API client over libcurl + nlohmann-json: what the master's
// Kubernetes backend and `ballast operator` need (typed paths, JSON bodies,
// list, watch, patch), nothing more. No Python and no Go in the control plane.
//
// Configuration (KubeConfig::Load): an explicit kubeconfig path, else
// $KUBECONFIG, else in-cluster (the pod's service account: token, CA and
// namespace under /var/run/secrets/kubernetes.io/serviceaccount, or
// $BALLAST_K8S_SA_DIR; API server at $KUBERNETES_SERVICE_HOST:PORT), else
// ~/.kube/config.
//
// Errors: every call returns a Status whose message names the verb and the
// object ("create pod default/job-worker-0-1: ...") and, when the API server
// sent one, its Status reason and message. Codes follow what the caller
// should do: 404 kNotFound, 409 kAlreadyExists (AlreadyExists) or kAborted
// (Conflict: re-read and retry), 410 kOutOfRange (the resourceVersion is too
// old: relist), 401 kUnauthenticated, 403 kPermissionDenied, 400/422
// kInvalidArgument, 429/5xx/transport kUnavailable. HttpStatus() recovers the
// HTTP code.
//
// Thread safety: KubeClient is thread-safe; each call uses its own curl handle
// (taken from a small pool, so connections are reused). Watch blocks the
// calling thread until the stream ends, the handler returns false, or *stop
// becomes true (libcurl checks it about once a second).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace ballast::kube {

using Json = nlohmann::json;

struct KubeConfig {
  std::string server;       // https://host:port
  std::string token;        // bearer token (static)
  std::string token_file;   // re-read when it changes (projected service account tokens rotate)
  std::string ca_file;      // PEM file, or
  std::string ca_data;      // PEM bytes
  std::string client_cert_data, client_key_data;  // PEM bytes (kubeconfig client certificates)
  bool insecure_skip_tls_verify = false;
  std::string namespace_name = "default";  // the pod's namespace in-cluster, else the context's
  std::string source;       // where it came from, for messages

  // In-cluster config; kNotFound when not in a pod.
  static absl::StatusOr<KubeConfig> InCluster();
  // A kubeconfig file's current context (or `context`).
  static absl::StatusOr<KubeConfig> FromKubeconfig(const std::string& path, const std::string& context = "");
  // See the file comment for the order. kNotFound with what was tried.
  static absl::StatusOr<KubeConfig> Load(const std::string& kubeconfig_path = "");
};

// The HTTP status carried by a Status from this client (0: none).
int HttpStatus(const absl::Status& status);

// One watch event: type is ADDED, MODIFIED, DELETED, BOOKMARK or ERROR.
struct WatchEvent {
  std::string type;
  Json object;
};

class KubeClient {
 public:
  explicit KubeClient(KubeConfig config);
  ~KubeClient();
  KubeClient(const KubeClient&) = delete;
  KubeClient& operator=(const KubeClient&) = delete;

  const KubeConfig& config() const { return config_; }

  // `path` is the API path with query ("/api/v1/namespaces/ns/pods?labelSelector=a%3Db");
  // `what` names the call for messages ("create pod ns/name").
  absl::StatusOr<Json> Get(const std::string& path, const std::string& what);
  absl::StatusOr<Json> Create(const std::string& path, const Json& body, const std::string& what);
  absl::StatusOr<Json> Replace(const std::string& path, const Json& body, const std::string& what);
  // content_type: application/merge-patch+json (default),
  // application/strategic-merge-patch+json, application/json-patch+json.
  absl::StatusOr<Json> Patch(const std::string& path, const Json& body, const std::string& what,
                             const std::string& content_type = "application/merge-patch+json");
  // Server-side apply: `body` (apiVersion, kind, metadata.name and the fields
  // this manager owns) becomes field_manager's intent; force takes fields
  // over from other managers. Fields it applied before and omits now are removed.
  absl::StatusOr<Json> Apply(const std::string& path, const Json& body, const std::string& field_manager,
                             const std::string& what);
  // body: DeleteOptions (e.g. {"gracePeriodSeconds": 0}); null for none.
  absl::StatusOr<Json> Delete(const std::string& path, const Json& body, const std::string& what);

  // Streams a watch (path must carry watch=1 and usually resourceVersion).
  // Calls on_event for each event until the server ends the stream (OK), the
  // handler returns false (OK), *stop is set (kCancelled), or an error.
  absl::Status Watch(const std::string& path, const std::string& what,
                     const std::function<bool(const WatchEvent&)>& on_event, const std::atomic<bool>* stop);

  // The raw call behind the above.
  absl::StatusOr<Json> Request(const std::string& method, const std::string& path, const Json* body,
                               const std::string& content_type, const std::string& what);

 private:
  struct Handle;
  std::unique_ptr<Handle> TakeHandle();
  void ReturnHandle(std::unique_ptr<Handle> h);
  std::string BearerToken();
  void Configure(Handle* h, const std::string& method, const std::string& url);

  const KubeConfig config_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Handle>> pool_;
  std::string cached_token_;
  int64_t token_read_at_ = 0;  // steady clock seconds
};

// Query string helpers: "?labelSelector=..." with percent-encoding.
std::string UrlEncode(const std::string& s);
// API paths. Namespaced collection: CollectionPath("v1", "pods", "ns") =
// "/api/v1/namespaces/ns/pods"; groups: CollectionPath("ballast.dev/v1alpha1",
// "elasticjobs", "ns") = "/apis/ballast.dev/v1alpha1/namespaces/ns/elasticjobs".
// An empty namespace gives the cluster-wide collection.
std::string CollectionPath(const std::string& api_version, const std::string& plural, const std::string& ns);
std::string ObjectPath(const std::string& api_version, const std::string& plural, const std::string& ns,
                       const std::string& name);

// Small accessors for objects: "" / 0 when absent.
std::string Str(const Json& j, std::initializer_list<const char*> path);
int64_t Int(const Json& j, std::initializer_list<const char*> path, int64_t def = 0);
const Json* Find(const Json& j, std::initializer_list<const char*> path);

}  // namespace ballast::kube
