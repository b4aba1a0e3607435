#include "common/net.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ballast {

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<Endpoint> ParseEndpoint(const std::string& text, int default_port) {
  Endpoint ep;
  std::string port_str;
  if (!text.empty() && text[0] == '[') {
    auto close = text.find(']');
    if (close == std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat("bad endpoint '", text, "': missing ']'"));
    ep.host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':')
        return absl::InvalidArgumentError(absl::StrCat("bad endpoint '", text, "'; use HOST:PORT"));
      port_str = text.substr(close + 2);
    }
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string::npos) {
      ep.host = text;
    } else {
      ep.host = text.substr(0, colon);
      port_str = text.substr(colon + 1);
    }
  }
  if (ep.host.empty())
    return absl::InvalidArgumentError(absl::StrCat("bad endpoint '", text, "': empty host; use HOST:PORT"));
  if (port_str.empty()) {
    if (default_port < 0)
      return absl::InvalidArgumentError(absl::StrCat("endpoint '", text, "' has no port; use HOST:PORT"));
    ep.port = default_port;
  } else if (!absl::SimpleAtoi(port_str, &ep.port) || ep.port < 0 || ep.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port '", port_str, "' in endpoint '", text, "'; use HOST:PORT with PORT in 0..65535"));
  }
  return ep;
}

absl::StatusOr<int> PickFreePort(const std::string& host) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("bind: ", std::strerror(e)));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

std::string HostName() {
  char buf[256];
  if (gethostname(buf, sizeof(buf)) != 0) return "localhost";
  buf[sizeof(buf) - 1] = '\0';
  return buf;
}

std::string RandomHex(int bytes) {
  std::string raw(bytes, '\0');
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  if (!urandom.read(raw.data(), bytes)) {
    std::random_device rd;
    for (auto& c : raw) c = static_cast<char>(rd());
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

}  // namespace ballast
