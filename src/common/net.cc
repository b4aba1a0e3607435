#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

namespace {

// Binds a TCP socket to host:port (0: any), returns the port bound or -1 (errno set).
int BindPort(const std::string& host, int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

int EphemeralPortLow() {
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  if (!(f >> low) || low <= 0) low = 32768;
  return low;
}

absl::StatusOr<int> PickFreePort(const std::string& host) {
  // Below the ephemeral range: the kernel hands a bind to port 0, and every
  // outgoing connection its local port, from that range, so a port picked
  // there can be taken by some connection before the process it is meant for
  // binds it (a worker's TCPStore then fails with EADDRINUSE).
  const int low = EphemeralPortLow();
  if (low > kLowestPickedPort + 100) {
    thread_local std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<int> pick(kLowestPickedPort, low - 1);
    for (int i = 0; i < 200; ++i) {
      if (const int port = BindPort(host, pick(rng)); port > 0) return port;
    }
  }
  const int port = BindPort(host, 0);
  if (port < 0) return absl::UnavailableError(absl::StrCat("bind: ", std::strerror(errno)));
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

namespace {

// getaddrinfo for `host` (numeric or a name); kNotFound naming the host.
absl::StatusOr<std::vector<sockaddr_storage>> Resolve(const std::string& host, int port, int socktype) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<sockaddr_storage> out;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    sockaddr_storage ss{};
    std::memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
    out.push_back(ss);
  }
  freeaddrinfo(res);
  if (out.empty()) return absl::NotFoundError(absl::StrCat("cannot resolve '", host, "': no addresses"));
  return out;
}

socklen_t SockLen(const sockaddr_storage& ss) {
  return ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

std::string NumericHost(const sockaddr* sa, socklen_t len) {
  char buf[NI_MAXHOST];
  if (getnameinfo(sa, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  std::string s = buf;
  if (absl::StartsWith(s, "::ffff:") && s.find('.') != std::string::npos) s = s.substr(7);
  return s;
}

bool IsLoopbackSockaddr(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
  }
  return false;
}

}  // namespace

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "::1" || host == "[::1]";
}

absl::StatusOr<std::string> LocalAddressToward(const std::string& host) {
  auto addrs = Resolve(host, 9, SOCK_DGRAM);
  if (!addrs.ok()) return addrs.status();
  std::string last_error;
  for (const sockaddr_storage& ss : *addrs) {
    int fd = socket(ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (connect(fd, reinterpret_cast<const sockaddr*>(&ss), SockLen(ss)) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    int rc = getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
    close(fd);
    if (rc != 0) continue;
    std::string addr = NumericHost(reinterpret_cast<sockaddr*>(&local), len);
    if (!addr.empty()) return addr;
  }
  return absl::UnavailableError(absl::StrCat("no route to '", host, "'", last_error.empty() ? "" : ": ", last_error));
}

absl::StatusOr<std::vector<std::string>> ResolveNumeric(const std::string& host) {
  auto addrs = Resolve(host, 0, SOCK_STREAM);
  if (!addrs.ok()) return addrs.status();
  std::vector<std::string> out;
  for (const sockaddr_storage& ss : *addrs) {
    std::string a = NumericHost(reinterpret_cast<const sockaddr*>(&ss), SockLen(ss));
    if (!a.empty() && std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
  }
  return out;
}

absl::StatusOr<int> ConnectTcp(const std::string& host, int port, double timeout_s) {
  auto addrs = Resolve(host, port, SOCK_STREAM);
  if (!addrs.ok()) return addrs.status();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string last_error = "timed out";
  for (const sockaddr_storage& ss : *addrs) {
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int rc = connect(fd, reinterpret_cast<const sockaddr*>(&ss), SockLen(ss));
    if (rc != 0 && errno != EINPROGRESS) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    if (rc != 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd p{fd, POLLOUT, 0};
      rc = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
      if (rc <= 0) {
        last_error = "timed out";
        close(fd);
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last_error = std::strerror(err);
        close(fd);
        continue;
      }
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
  }
  return absl::UnavailableError(absl::StrCat("cannot connect to ", Endpoint{host, port}.ToString(), ": ", last_error));
}

absl::Status CheckTcpConnect(const std::string& host, int port, double timeout_s) {
  absl::StatusOr<int> fd = ConnectTcp(host, port, timeout_s);
  if (!fd.ok()) return fd.status();
  close(*fd);
  return absl::OkStatus();
}

bool ResolvesToLocalNonLoopback(const std::string& host) {
  auto addrs = Resolve(host, 0, SOCK_STREAM);
  if (!addrs.ok()) return false;
  for (const sockaddr_storage& ss : *addrs) {
    if (IsLoopbackSockaddr(reinterpret_cast<const sockaddr*>(&ss))) continue;
    // Local when it can be bound (gloo's own test: doesHostnameResolveToUsableAddress).
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage any = ss;
    if (any.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&any)->sin_port = 0;
    if (any.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&any)->sin6_port = 0;
    bool ok = bind(fd, reinterpret_cast<const sockaddr*>(&any), SockLen(any)) == 0;
    close(fd);
    if (ok) return true;
  }
  return false;
}

std::string InterfaceWithAddress(const std::string& addr) {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return "";
  std::string name;
  for (ifaddrs* i = ifs; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    socklen_t len = fam == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    if (NumericHost(i->ifa_addr, len) == addr) name = i->ifa_name;
  }
  freeifaddrs(ifs);
  return name;
}

absl::Status SetInterfaceUp(const std::string& name, bool up) {
  if (name.empty() || name.size() >= IFNAMSIZ) {
    return absl::InvalidArgumentError(absl::StrCat("bad network interface name \"", name, "\""));
  }
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  ifreq req{};
  std::memcpy(req.ifr_name, name.data(), name.size());
  absl::Status st;
  if (ioctl(fd, SIOCGIFFLAGS, &req) != 0) {
    st = absl::NotFoundError(absl::StrCat("interface ", name, ": ", std::strerror(errno)));
  } else {
    req.ifr_flags = static_cast<short>(up ? (req.ifr_flags | IFF_UP) : (req.ifr_flags & ~IFF_UP));
    if (ioctl(fd, SIOCSIFFLAGS, &req) != 0) {
      st = absl::PermissionDeniedError(absl::StrCat("cannot take interface ", name, up ? " up: " : " down: ",
                                                    std::strerror(errno), " (needs CAP_NET_ADMIN)"));
    }
  }
  close(fd);
  return st;
}

absl::StatusOr<int> ListenTcpAny(int* port, const std::string& what) {
  int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool v6 = fd >= 0;
  if (v6) {
    int off = 0;  // dual stack: IPv4 peers too
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close(fd);
      v6 = false;
    }
  }
  if (!v6) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat(what, ": socket: ", std::strerror(errno)));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      int e = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat(what, ": bind: ", std::strerror(e)));
    }
  }
  if (listen(fd, 128) != 0) {
    int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat(what, ": listen: ", std::strerror(e)));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  *port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

absl::StatusOr<std::unique_ptr<ProbeListener>> ProbeListener::Start() {
  int port = 0;
  absl::StatusOr<int> fd = ListenTcpAny(&port, "probe listener");
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<ProbeListener>(new ProbeListener(*fd, port));
}

StopSignal::StopSignal() : efd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

StopSignal::~StopSignal() {
  if (efd_ >= 0) close(efd_);
}

void StopSignal::Stop() {
  stopped_ = true;
  if (efd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(efd_, &one, sizeof(one));
  }
}

bool StopSignal::WaitReadable(int fd, int fallback_ms) const {
  pollfd p[2] = {{fd, POLLIN, 0}, {efd_, POLLIN, 0}};
  // Stop() sets stopped_ before it writes, so a stop before the poll is seen
  // either here or as a readable eventfd.
  if (stopped_.load()) return false;
  const int n = poll(p, efd_ >= 0 ? 2 : 1, efd_ >= 0 ? -1 : fallback_ms);
  return n > 0 && (p[0].revents & (POLLIN | POLLERR | POLLHUP)) != 0 && !stopped_.load();
}

ProbeListener::ProbeListener(int fd, int port) : fd_(fd), port_(port) {
  thread_ = std::thread([this] {
    while (!stop_.stopped()) {
      if (!stop_.WaitReadable(fd_)) continue;
      int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) close(c);
    }
  });
}

ProbeListener::~ProbeListener() {
  stop_.Stop();
  if (thread_.joinable()) thread_.join();
  close(fd_);
}

void ParseProcNetTcp(std::string_view text_in, bool ipv6, int port, TcpPortUse* use) {
  // Debian's Abseil has its own string_view.
  const absl::string_view text(text_in.data(), text_in.size());
  constexpr int kEstablished = 0x01;
  constexpr int kListen = 0x0A;
  bool header = true;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (header) {  // "  sl  local_address rem_address   st ..."
      header = false;
      continue;
    }
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 4) continue;
    auto split_addr = [](absl::string_view a, absl::string_view* ip, int* p) {
      size_t colon = a.find(':');
      if (colon == absl::string_view::npos) return false;
      *ip = a.substr(0, colon);
      unsigned v = 0;
      if (!absl::SimpleHexAtoi(a.substr(colon + 1), &v)) return false;
      *p = static_cast<int>(v);
      return true;
    };
    absl::string_view local_ip, remote_ip;
    int local_port = 0, remote_port = 0;
    unsigned state = 0;
    if (!split_addr(f[1], &local_ip, &local_port) || !split_addr(f[2], &remote_ip, &remote_port) ||
        !absl::SimpleHexAtoi(f[3], &state)) {
      continue;
    }
    if (local_port != port) continue;
    if (static_cast<int>(state) == kListen) {
      use->listening = true;
      continue;
    }
    if (static_cast<int>(state) != kEstablished) continue;
    // The kernel prints each 32-bit word of the address in host byte order.
    const size_t words = ipv6 ? 4 : 1;
    if (remote_ip.size() != words * 8) continue;
    unsigned char bytes[16];
    bool ok = true;
    for (size_t w = 0; w < words && ok; ++w) {
      uint32_t v = 0;
      ok = absl::SimpleHexAtoi(remote_ip.substr(w * 8, 8), &v);
      std::memcpy(bytes + 4 * w, &v, 4);
    }
    if (!ok) continue;
    char buf[INET6_ADDRSTRLEN];
    std::string peer;
    if (!ipv6) {
      if (inet_ntop(AF_INET, bytes, buf, sizeof(buf)) != nullptr) peer = buf;
    } else {
      in6_addr a;
      std::memcpy(&a, bytes, 16);
      if (IN6_IS_ADDR_V4MAPPED(&a)) {
        if (inet_ntop(AF_INET, bytes + 12, buf, sizeof(buf)) != nullptr) peer = buf;
      } else if (inet_ntop(AF_INET6, bytes, buf, sizeof(buf)) != nullptr) {
        peer = buf;
      }
    }
    if (!peer.empty()) use->accepted_peers.push_back(peer);
  }
}

absl::StatusOr<TcpPortUse> LocalTcpPortUse(int port) {
  TcpPortUse use;
  bool any = false;
  for (auto [path, v6] : {std::pair<const char*, bool>{"/proc/net/tcp", false}, {"/proc/net/tcp6", true}}) {
    std::ifstream in(path);
    if (!in) continue;
    std::stringstream ss;
    ss << in.rdbuf();
    ParseProcNetTcp(ss.str(), v6, port, &use);
    any = true;
  }
  if (!any) return absl::UnavailableError("cannot read /proc/net/tcp");
  return use;
}

bool TokenEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace ballast
