// The master's HTTP interface, beside its gRPC port: the dashboard, the job's
// status as JSON, its timeline and its Prometheus metrics.
//
//   GET /                 the dashboard (one self-contained page; open it as
//                         /?token=TOKEN, the page keeps the token for its calls)
//   GET /api/v1/job       the status (the document `ballast status --json` prints)
//   GET /api/v1/events    the timeline: ?after=SEQ (default 0) and ?wait=S
//                         (long-poll up to S <= 30 s for the next event; at
//                         most 8 wait at once, more are answered at once)
//   GET /metrics          Prometheus text format (metrics.h)
//
// Every path but the page itself needs the job token as
// `Authorization: Bearer TOKEN` (401 otherwise); /metrics is open with
// metrics_public.
//
// Ownership: owns the httplib server and the thread that runs it; reads the
// job through JobMaster's thread-safe methods (a long-poll waits on the event
// log, never on the job lock). Thread safety: Start/Stop from one thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ballast/v1/master.pb.h"

namespace ballast::master {

class JobMaster;

struct HttpOptions {
  std::string bind_host = "0.0.0.0";
  int port = 0;  // 0: any free port
  std::string token;
  bool metrics_public = false;  // /metrics without the token
};

// The JSON document of a status (proto field names, every field printed).
std::string JobStatusJson(const v1::JobStatus& status);

class MasterHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MasterHttpServer>> Start(const HttpOptions& options, const JobMaster* job);
  ~MasterHttpServer();  // Stop()
  int port() const { return port_; }
  void Stop();

 private:
  MasterHttpServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace ballast::master
