// Small networking helpers: host:port parsing, free ports, host name.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace ballast {

struct Endpoint {
  std::string host;
  int port = 0;
  std::string ToString() const;
};

// Parses "host:port", "[v6]:port" or "host" (port = default_port).
absl::StatusOr<Endpoint> ParseEndpoint(const std::string& text, int default_port = -1);

// A TCP port that was free on `host` a moment ago (bind to port 0, read it back).
absl::StatusOr<int> PickFreePort(const std::string& host = "0.0.0.0");

// This machine's host name (gethostname), "localhost" if unavailable.
std::string HostName();

// Random hex string of `bytes` random bytes from /dev/urandom (tokens, ids).
std::string RandomHex(int bytes);

}  // namespace ballast
