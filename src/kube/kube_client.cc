#include "kube/kube_client.h"

#include <curl/curl.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "yaml-cpp/yaml.h"

namespace ballast::kube {
namespace {

constexpr char kHttpPayload[] = "ballast.dev/http-status";
constexpr char kDefaultSaDir[] = "/var/run/secrets/kubernetes.io/serviceaccount";
constexpr int kMaxPooledHandles = 16;

int64_t NowSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// absl code for an HTTP status, by what the caller should do.
absl::StatusCode CodeFor(int http, const std::string& reason) {
  switch (http) {
    case 400:
    case 422: return absl::StatusCode::kInvalidArgument;
    case 401: return absl::StatusCode::kUnauthenticated;
    case 403: return absl::StatusCode::kPermissionDenied;
    case 404: return absl::StatusCode::kNotFound;
    case 409: return reason == "AlreadyExists" ? absl::StatusCode::kAlreadyExists : absl::StatusCode::kAborted;
    case 410: return absl::StatusCode::kOutOfRange;
    case 429: return absl::StatusCode::kUnavailable;
    default: break;
  }
  if (http >= 500) return absl::StatusCode::kUnavailable;
  return absl::StatusCode::kUnknown;
}

absl::Status HttpError(int http, const std::string& body, const std::string& what) {
  std::string reason, message;
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.value("kind", "") == "Status") {
    reason = j.value("reason", "");
    message = j.value("message", "");
  } else {
    message = body.size() > 300 ? body.substr(0, 300) + "..." : body;
  }
  absl::Status s(CodeFor(http, reason),
                 absl::StrCat(what, ": HTTP ", http, reason.empty() ? "" : absl::StrCat(" ", reason),
                              message.empty() ? "" : absl::StrCat(": ", Trim(message))));
  s.SetPayload(kHttpPayload, absl::Cord(std::to_string(http)));
  return s;
}

}  // namespace

int HttpStatus(const absl::Status& status) {
  auto p = status.GetPayload(kHttpPayload);
  if (!p.has_value()) return 0;
  int v = 0;
  return absl::SimpleAtoi(std::string(*p), &v) ? v : 0;
}

// --- configuration ---

absl::StatusOr<KubeConfig> KubeConfig::InCluster() {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (host == nullptr || port == nullptr || *host == '\0') {
    return absl::NotFoundError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is not set)");
  }
  const char* dir_env = std::getenv("BALLAST_K8S_SA_DIR");
  const std::string dir = dir_env != nullptr && *dir_env != '\0' ? dir_env : kDefaultSaDir;
  KubeConfig c;
  std::string h = host;
  if (h.find(':') != std::string::npos) h = absl::StrCat("[", h, "]");
  c.server = absl::StrCat("https://", h, ":", port);
  c.token_file = dir + "/token";
  c.ca_file = dir + "/ca.crt";
  if (!std::filesystem::exists(c.token_file)) {
    return absl::NotFoundError(absl::StrCat("in a pod, but no service account token at ", c.token_file,
                                            " (automountServiceAccountToken off?)"));
  }
  if (auto ns = ReadFile(dir + "/namespace"); ns.ok()) c.namespace_name = Trim(*ns);
  c.source = absl::StrCat("in-cluster service account (", dir, ")");
  return c;
}

absl::StatusOr<KubeConfig> KubeConfig::FromKubeconfig(const std::string& path, const std::string& context) {
  YAML::Node doc;
  try {
    doc = YAML::LoadFile(path);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read kubeconfig ", path, ": ", e.what()));
  }
  const std::filesystem::path base = std::filesystem::path(path).parent_path();
  auto rel = [&](const std::string& p) { return p.empty() || p[0] == '/' ? p : (base / p).string(); };
  // The `field` of the entry of `list` called `name`; an undefined node if none.
  auto named = [&](const char* list, const std::string& name, const char* field) -> YAML::Node {
    for (const auto& item : doc[list]) {
      if (item["name"] && item["name"].as<std::string>() == name && item[field]) return item[field];
    }
    return YAML::Node(YAML::NodeType::Undefined);
  };
  try {
    std::string ctx_name = context.empty() && doc["current-context"] ? doc["current-context"].as<std::string>() : context;
    if (ctx_name.empty()) return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", path, " has no current-context"));
    YAML::Node ctx = named("contexts", ctx_name, "context");
    if (!ctx) return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", path, ": no context '", ctx_name, "'"));
    YAML::Node cluster = named("clusters", ctx["cluster"].as<std::string>(""), "cluster");
    if (!cluster || !cluster["server"]) {
      return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", path, ": context '", ctx_name, "' has no cluster server"));
    }
    KubeConfig c;
    c.server = cluster["server"].as<std::string>();
    while (!c.server.empty() && c.server.back() == '/') c.server.pop_back();
    c.ca_file = rel(cluster["certificate-authority"].as<std::string>(""));
    if (cluster["certificate-authority-data"]) {
      if (!absl::Base64Unescape(cluster["certificate-authority-data"].as<std::string>(), &c.ca_data)) {
        return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", path, ": bad certificate-authority-data"));
      }
    }
    c.insecure_skip_tls_verify = cluster["insecure-skip-tls-verify"].as<bool>(false);
    if (YAML::Node user = named("users", ctx["user"].as<std::string>(""), "user"); user) {
      c.token = user["token"].as<std::string>("");
      c.token_file = rel(user["tokenFile"].as<std::string>(""));
      auto data = [&](const char* data_key, const char* file_key, std::string* out) -> absl::Status {
        if (user[data_key]) {
          if (!absl::Base64Unescape(user[data_key].as<std::string>(), out))
            return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", path, ": bad ", data_key));
        } else if (user[file_key]) {
          auto f = ReadFile(rel(user[file_key].as<std::string>()));
          if (!f.ok()) return f.status();
          *out = *f;
        }
        return absl::OkStatus();
      };
      if (auto s = data("client-certificate-data", "client-certificate", &c.client_cert_data); !s.ok()) return s;
      if (auto s = data("client-key-data", "client-key", &c.client_key_data); !s.ok()) return s;
      if (user["exec"] || user["auth-provider"]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "kubeconfig ", path, ": user '", ctx["user"].as<std::string>(""),
            "' authenticates with an exec/auth-provider plugin, which ballast does not run; use a token or a "
            "client certificate (e.g. a service account token)"));
      }
    }
    c.namespace_name = ctx["namespace"].as<std::string>("default");
    c.source = absl::StrCat("kubeconfig ", path, " (context ", ctx_name, ")");
    return c;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", path, ": ", e.what()));
  }
}

absl::StatusOr<KubeConfig> KubeConfig::Load(const std::string& kubeconfig_path) {
  if (!kubeconfig_path.empty()) return FromKubeconfig(kubeconfig_path);
  if (const char* env = std::getenv("KUBECONFIG"); env != nullptr && *env != '\0') {
    std::string first = env;
    if (size_t colon = first.find(':'); colon != std::string::npos) first = first.substr(0, colon);
    return FromKubeconfig(first);
  }
  auto in_cluster = InCluster();
  if (in_cluster.ok() || !absl::IsNotFound(in_cluster.status())) return in_cluster;
  if (const char* home = std::getenv("HOME"); home != nullptr) {
    std::string p = absl::StrCat(home, "/.kube/config");
    if (std::filesystem::exists(p)) return FromKubeconfig(p);
  }
  return absl::NotFoundError(absl::StrCat("no Kubernetes configuration: pass --kubeconfig, set KUBECONFIG, or run "
                                          "in a pod (", in_cluster.status().message(), ")"));
}

// --- client ---

struct KubeClient::Handle {
  CURL* curl = nullptr;
  curl_slist* headers = nullptr;
  ~Handle() {
    if (headers != nullptr) curl_slist_free_all(headers);
    if (curl != nullptr) curl_easy_cleanup(curl);
  }
};

KubeClient::KubeClient(KubeConfig config) : config_(std::move(config)) { GlobalInit(); }
KubeClient::~KubeClient() = default;

std::unique_ptr<KubeClient::Handle> KubeClient::TakeHandle() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pool_.empty()) {
      auto h = std::move(pool_.back());
      pool_.pop_back();
      return h;
    }
  }
  auto h = std::make_unique<Handle>();
  h->curl = curl_easy_init();
  return h;
}

void KubeClient::ReturnHandle(std::unique_ptr<Handle> h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pool_.size() < kMaxPooledHandles) pool_.push_back(std::move(h));
}

std::string KubeClient::BearerToken() {
  if (config_.token_file.empty()) return config_.token;
  std::lock_guard<std::mutex> lock(mu_);
  // Projected tokens are rotated by the kubelet: re-read once a minute.
  if (cached_token_.empty() || NowSeconds() - token_read_at_ >= 60) {
    if (auto t = ReadFile(config_.token_file); t.ok()) cached_token_ = Trim(*t);
    token_read_at_ = NowSeconds();
  }
  return cached_token_;
}

void KubeClient::Configure(Handle* h, const std::string& method, const std::string& url) {
  CURL* c = h->curl;
  curl_easy_reset(c);
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method.c_str());
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
  curl_easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L);
  if (config_.insecure_skip_tls_verify) {
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
  } else if (!config_.ca_data.empty()) {
    curl_blob blob{const_cast<char*>(config_.ca_data.data()), config_.ca_data.size(), CURL_BLOB_COPY};
    curl_easy_setopt(c, CURLOPT_CAINFO_BLOB, &blob);
  } else if (!config_.ca_file.empty()) {
    curl_easy_setopt(c, CURLOPT_CAINFO, config_.ca_file.c_str());
  }
  if (!config_.client_cert_data.empty()) {
    curl_blob cert{const_cast<char*>(config_.client_cert_data.data()), config_.client_cert_data.size(),
                   CURL_BLOB_COPY};
    curl_blob key{const_cast<char*>(config_.client_key_data.data()), config_.client_key_data.size(), CURL_BLOB_COPY};
    curl_easy_setopt(c, CURLOPT_SSLCERT_BLOB, &cert);
    curl_easy_setopt(c, CURLOPT_SSLCERTTYPE, "PEM");
    curl_easy_setopt(c, CURLOPT_SSLKEY_BLOB, &key);
    curl_easy_setopt(c, CURLOPT_SSLKEYTYPE, "PEM");
  }
}

namespace {

size_t AppendBody(char* data, size_t size, size_t n, void* user) {
  static_cast<std::string*>(user)->append(data, size * n);
  return size * n;
}

struct WatchState {
  std::string buffer;
  const std::function<bool(const WatchEvent&)>* on_event = nullptr;
  const std::atomic<bool>* stop = nullptr;
  bool handler_done = false;
  std::string parse_error;
  std::string raw;  // a non-event body (an HTTP error), kept short
};

size_t WatchWrite(char* data, size_t size, size_t n, void* user) {
  auto* st = static_cast<WatchState*>(user);
  st->buffer.append(data, size * n);
  size_t start = 0;
  while (true) {
    size_t nl = st->buffer.find('\n', start);
    if (nl == std::string::npos) break;
    std::string line = st->buffer.substr(start, nl - start);
    start = nl + 1;
    if (line.empty()) continue;
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("type")) {
      if (st->raw.size() < 4096) st->raw += line;
      continue;
    }
    WatchEvent e{j.value("type", ""), j.contains("object") ? j["object"] : Json()};
    if (!(*st->on_event)(e)) {
      st->handler_done = true;
      return 0;  // aborts the transfer
    }
  }
  st->buffer.erase(0, start);
  if (st->buffer.size() > (64u << 20)) {
    st->parse_error = "a watch event larger than 64 MiB";
    return 0;
  }
  return size * n;
}

int WatchProgress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* st = static_cast<WatchState*>(user);
  return st->stop != nullptr && st->stop->load() ? 1 : 0;
}

}  // namespace

absl::StatusOr<Json> KubeClient::Request(const std::string& method, const std::string& path, const Json* body,
                                         const std::string& content_type, const std::string& what) {
  auto h = TakeHandle();
  if (h->curl == nullptr) return absl::InternalError(absl::StrCat(what, ": curl_easy_init failed"));
  Configure(h.get(), method, config_.server + path);
  if (h->headers != nullptr) curl_slist_free_all(h->headers);
  h->headers = nullptr;
  h->headers = curl_slist_append(h->headers, "Accept: application/json");
  if (std::string token = BearerToken(); !token.empty()) {
    h->headers = curl_slist_append(h->headers, absl::StrCat("Authorization: Bearer ", token).c_str());
  }
  std::string payload;
  if (body != nullptr) {
    payload = body->dump();
    h->headers = curl_slist_append(h->headers, absl::StrCat("Content-Type: ", content_type).c_str());
    curl_easy_setopt(h->curl, CURLOPT_POSTFIELDS, payload.c_str());
    curl_easy_setopt(h->curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(payload.size()));
  }
  curl_easy_setopt(h->curl, CURLOPT_HTTPHEADER, h->headers);
  curl_easy_setopt(h->curl, CURLOPT_TIMEOUT_MS, 30000L);
  std::string response;
  curl_easy_setopt(h->curl, CURLOPT_WRITEFUNCTION, AppendBody);
  curl_easy_setopt(h->curl, CURLOPT_WRITEDATA, &response);
  CURLcode rc = curl_easy_perform(h->curl);
  long http = 0;
  curl_easy_getinfo(h->curl, CURLINFO_RESPONSE_CODE, &http);
  // The handle keeps its connection for the next call.
  curl_easy_setopt(h->curl, CURLOPT_HTTPHEADER, nullptr);
  ReturnHandle(std::move(h));
  if (rc != CURLE_OK) {
    return absl::UnavailableError(
        absl::StrCat(what, ": cannot reach the Kubernetes API server at ", config_.server, ": ", curl_easy_strerror(rc)));
  }
  if (http < 200 || http >= 300) return HttpError(static_cast<int>(http), response, what);
  if (response.empty()) return Json::object();
  Json j = Json::parse(response, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::DataLossError(absl::StrCat(what, ": the API server's answer is not JSON"));
  }
  return j;
}

absl::StatusOr<Json> KubeClient::Get(const std::string& path, const std::string& what) {
  return Request("GET", path, nullptr, "", what);
}
absl::StatusOr<Json> KubeClient::Create(const std::string& path, const Json& body, const std::string& what) {
  return Request("POST", path, &body, "application/json", what);
}
absl::StatusOr<Json> KubeClient::Replace(const std::string& path, const Json& body, const std::string& what) {
  return Request("PUT", path, &body, "application/json", what);
}
absl::StatusOr<Json> KubeClient::Patch(const std::string& path, const Json& body, const std::string& what,
                                       const std::string& content_type) {
  return Request("PATCH", path, &body, content_type, what);
}
absl::StatusOr<Json> KubeClient::Apply(const std::string& path, const Json& body, const std::string& field_manager,
                                       const std::string& what) {
  const char* sep = path.find('?') == std::string::npos ? "?" : "&";
  // JSON is YAML: the apply content type takes it as it is.
  return Request("PATCH", absl::StrCat(path, sep, "fieldManager=", UrlEncode(field_manager), "&force=true"), &body,
                 "application/apply-patch+yaml", what);
}

absl::StatusOr<Json> KubeClient::Delete(const std::string& path, const Json& body, const std::string& what) {
  return Request("DELETE", path, body.is_null() ? nullptr : &body, "application/json", what);
}

absl::Status KubeClient::Watch(const std::string& path, const std::string& what,
                               const std::function<bool(const WatchEvent&)>& on_event,
                               const std::atomic<bool>* stop) {
  // Its own handle, not pooled: a watch holds its connection for minutes.
  Handle h;
  h.curl = curl_easy_init();
  if (h.curl == nullptr) return absl::InternalError(absl::StrCat(what, ": curl_easy_init failed"));
  Configure(&h, "GET", config_.server + path);
  h.headers = curl_slist_append(h.headers, "Accept: application/json");
  if (std::string token = BearerToken(); !token.empty()) {
    h.headers = curl_slist_append(h.headers, absl::StrCat("Authorization: Bearer ", token).c_str());
  }
  curl_easy_setopt(h.curl, CURLOPT_HTTPHEADER, h.headers);
  WatchState st;
  st.on_event = &on_event;
  st.stop = stop;
  curl_easy_setopt(h.curl, CURLOPT_WRITEFUNCTION, WatchWrite);
  curl_easy_setopt(h.curl, CURLOPT_WRITEDATA, &st);
  curl_easy_setopt(h.curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h.curl, CURLOPT_XFERINFOFUNCTION, WatchProgress);
  curl_easy_setopt(h.curl, CURLOPT_XFERINFODATA, &st);
  // A silent stream (no event, no bookmark) for this long is a dead connection.
  curl_easy_setopt(h.curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(h.curl, CURLOPT_LOW_SPEED_TIME, 120L);
  CURLcode rc = curl_easy_perform(h.curl);
  long http = 0;
  curl_easy_getinfo(h.curl, CURLINFO_RESPONSE_CODE, &http);
  if (st.handler_done) return absl::OkStatus();
  if (stop != nullptr && stop->load()) return absl::CancelledError(absl::StrCat(what, ": stopped"));
  if (http != 0 && (http < 200 || http >= 300)) return HttpError(static_cast<int>(http), st.raw, what);
  if (!st.parse_error.empty()) return absl::DataLossError(absl::StrCat(what, ": ", st.parse_error));
  if (rc != CURLE_OK) {
    return absl::UnavailableError(absl::StrCat(what, ": watch stream from ", config_.server,
                                               " broke: ", curl_easy_strerror(rc)));
  }
  return absl::OkStatus();
}

// --- paths and accessors ---

std::string UrlEncode(const std::string& s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string CollectionPath(const std::string& api_version, const std::string& plural, const std::string& ns) {
  std::string root = api_version.find('/') == std::string::npos ? absl::StrCat("/api/", api_version)
                                                                 : absl::StrCat("/apis/", api_version);
  if (ns.empty()) return absl::StrCat(root, "/", plural);
  return absl::StrCat(root, "/namespaces/", ns, "/", plural);
}

std::string ObjectPath(const std::string& api_version, const std::string& plural, const std::string& ns,
                       const std::string& name) {
  return absl::StrCat(CollectionPath(api_version, plural, ns), "/", name);
}

const Json* Find(const Json& j, std::initializer_list<const char*> path) {
  const Json* cur = &j;
  for (const char* key : path) {
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end()) return nullptr;
    cur = &*it;
  }
  return cur;
}

std::string Str(const Json& j, std::initializer_list<const char*> path) {
  const Json* v = Find(j, path);
  return v != nullptr && v->is_string() ? v->get<std::string>() : "";
}

int64_t Int(const Json& j, std::initializer_list<const char*> path, int64_t def) {
  const Json* v = Find(j, path);
  if (v == nullptr) return def;
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number()) return static_cast<int64_t>(v->get<double>());
  return def;
}

}  // namespace ballast::kube
