// The master's HTTP flags, the same on `ballast master` and `ballast launch`
// (`ballast run` parses its own, torchrun-style: agent/run_options.cc).
#pragma once

#include <CLI/CLI.hpp>
#include "cli/cli_util.h"
#include "master/master_server.h"

namespace ballast::cli {

struct HttpFlags {
  int port = -2;  // not given: beside the gRPC port
  bool metrics_public = false;

  void Add(CLI::App& app) {
    app.add_option("--http-port,--http_port", port,
                   "The dashboard, /api/v1/job, /api/v1/events and /metrics (default: --port + 1, or any free port "
                   "when --port is 0 or that one is taken; -1: off)")
        ->check(IntegerIn(-1, 65535, "a port from 0 to 65535 (0: any free port), or -1 for off", "PORT"));
    app.add_flag("--metrics-public,--metrics_public", metrics_public, "Serve /metrics without the job token");
  }
  // Sets the HTTP options of a master whose gRPC port is o->port.
  void Apply(master::MasterOptions* o) const {
    o->http_port = port == -2 ? master::HttpPortBeside(o->port) : port;
    o->http_port_is_default = port == -2;
    o->metrics_public = metrics_public;
  }
};

}  // namespace ballast::cli
