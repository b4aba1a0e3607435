#include "master/http_server.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/net.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "master/dashboard_assets.h"
#include "master/job_master.h"
#include "master/metrics.h"
#include "spdlog/spdlog.h"

namespace ballast::master {
namespace {

constexpr double kMaxEventWaitS = 30;
// A long-poll holds a worker thread while it waits (and httplib cannot tell
// that its client went away): at most kMaxLongPolls wait at once, the rest
// are answered at once, so status calls and scrapes always find a thread.
constexpr size_t kHttpThreads = 16;
constexpr int kMaxLongPolls = 8;

std::string ToJson(const google::protobuf::Message& m, bool pretty) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = pretty;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

void JsonError(httplib::Response& res, int code, const std::string& message) {
  res.status = code;
  res.set_content(absl::StrCat("{\"error\": ", nlohmann::json(message).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "}\n"), "application/json");
}

}  // namespace

std::string JobStatusJson(const v1::JobStatus& status) { return ToJson(status, true); }

struct MasterHttpServer::Impl {
  HttpOptions options;
  const JobMaster* job = nullptr;
  httplib::Server server;
  std::thread thread;
  bool stopped = false;
  std::atomic<int> long_polls{0};  // /api/v1/events requests asking to wait

  bool Authorized(const httplib::Request& req, httplib::Response& res) const {
    const std::string auth = req.get_header_value("Authorization");
    constexpr char kBearer[] = "Bearer ";
    if (absl::StartsWith(auth, kBearer) && TokenEquals(std::string_view(auth).substr(sizeof(kBearer) - 1), options.token)) {
      return true;
    }
    spdlog::warn("job={} HTTP {} refused (401) from {}: {} job token", job->job_id(), req.path, req.remote_addr,
                 auth.empty() ? "missing" : "wrong");
    res.set_header("WWW-Authenticate", "Bearer realm=\"ballast\"");
    JsonError(res, 401,
              "missing or wrong job token: send it as 'Authorization: Bearer TOKEN' (the token the master "
              "printed, BALLAST_TOKEN), or open the dashboard as /?token=TOKEN");
    return false;
  }

  void Routes() {
    server.Get("/", [](const httplib::Request&, httplib::Response& res) {
      res.set_header("Cache-Control", "no-store");
      res.set_content(std::string(DashboardHtml()), "text/html; charset=utf-8");
    });
    server.Get("/api/v1/job", [this](const httplib::Request& req, httplib::Response& res) {
      if (!Authorized(req, res)) return;
      res.set_content(JobStatusJson(job->Status()), "application/json");
    });
    server.Get("/api/v1/events", [this](const httplib::Request& req, httplib::Response& res) {
      if (!Authorized(req, res)) return;
      int64_t after = 0;
      double wait_s = 0;
      if (req.has_param("after") && !absl::SimpleAtoi(req.get_param_value("after"), &after)) {
        return JsonError(res, 400, "after must be an event seq (an integer), e.g. ?after=0");
      }
      if (req.has_param("wait") && (!absl::SimpleAtod(req.get_param_value("wait"), &wait_s) || !(wait_s >= 0))) {
        return JsonError(res, 400, "wait must be seconds >= 0, e.g. ?wait=25");
      }
      wait_s = std::min(wait_s, kMaxEventWaitS);
      const bool may_wait = wait_s > 0 && long_polls.fetch_add(1) < kMaxLongPolls;
      std::vector<v1::Event> events = job->events().After(after, may_wait ? wait_s : 0);
      if (wait_s > 0) long_polls.fetch_sub(1);
      std::string body = "{\"events\": [";
      for (size_t i = 0; i < events.size(); ++i) absl::StrAppend(&body, i ? ", " : "", ToJson(events[i], false));
      absl::StrAppend(&body, "], \"last_seq\": ", events.empty() ? std::max<int64_t>(after, 0) : events.back().seq(),
                      "}\n");
      res.set_content(body, "application/json");
    });
    server.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
      if (!options.metrics_public && !Authorized(req, res)) return;
      const v1::JobStatus st = job->Status();
      const Histogram recovery = job->RecoveryHistogram();
      const std::map<std::string, int> restarts = job->RecoveriesByKind();
      const Histogram ckpt_save = job->CkptSaveHistogram();
      res.set_content(PrometheusText({&st, &recovery, &restarts, &ckpt_save}), "text/plain; version=0.0.4; charset=utf-8");
    });
    server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (res.status == 404) {
        JsonError(res, 404, absl::StrCat("no such path ", req.path, ": try /, /api/v1/job, /api/v1/events, /metrics"));
      }
    });
  }
};

absl::StatusOr<std::unique_ptr<MasterHttpServer>> MasterHttpServer::Start(const HttpOptions& options,
                                                                          const JobMaster* job) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-port must be between 0 (pick a free one) and 65535, got ", options.port));
  }
  std::unique_ptr<MasterHttpServer> s(new MasterHttpServer());
  s->impl_ = std::make_unique<Impl>();
  Impl& impl = *s->impl_;
  impl.options = options;
  impl.job = job;
  impl.server.new_task_queue = [] { return new httplib::ThreadPool(kHttpThreads); };
  impl.server.set_payload_max_length(64 * 1024);  // GETs only: no body worth reading
  // httplib's default sets SO_REUSEPORT, which lets a second master bind the
  // same port silently and take half the requests: only SO_REUSEADDR here.
  impl.server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  impl.Routes();
  if (options.port == 0) {
    s->port_ = impl.server.bind_to_any_port(options.bind_host);
  } else if (impl.server.bind_to_port(options.bind_host, options.port)) {
    s->port_ = options.port;
  }
  if (s->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("the master's HTTP server could not listen on ", options.bind_host, ":",
                                               options.port,
                                               ": is the port in use? pick another --http-port (0: any free port)"));
  }
  impl.thread = std::thread([&impl] { impl.server.listen_after_bind(); });
  // Serving before Start returns: a Stop() before the loop ran would not
  // reach it (httplib's stop() only acts on a running server).
  for (int i = 0; i < 500 && !impl.server.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return s;
}

MasterHttpServer::~MasterHttpServer() { Stop(); }

void MasterHttpServer::Stop() {
  if (impl_ == nullptr || impl_->stopped) return;
  impl_->stopped = true;
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace ballast::master
