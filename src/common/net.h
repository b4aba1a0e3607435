// Small networking helpers: host:port parsing, free ports, host name.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast {

struct Endpoint {
  std::string host;
  int port = 0;
  std::string ToString() const;
};

// Parses "host:port", "[v6]:port" or "host" (port = default_port).
absl::StatusOr<Endpoint> ParseEndpoint(const std::string& text, int default_port = -1);

// A TCP port that was free on `host` a moment ago: a random one from
// kLowestPickedPort up to below the kernel's ephemeral port range (where no
// outgoing connection can take it before its user binds it), else (that range
// full) one the kernel picks.
absl::StatusOr<int> PickFreePort(const std::string& host = "0.0.0.0");
inline constexpr int kLowestPickedPort = 10000;
// The first port of the kernel's ephemeral range (ip_local_port_range; 32768 if unreadable).
int EphemeralPortLow();

// This machine's host name (gethostname), "localhost" if unavailable.
std::string HostName();

// Random hex string of `bytes` random bytes from /dev/urandom (tokens, ids).
std::string RandomHex(int bytes);

// Compares secrets without an early exit, so response timing does not leak
// how much of a guessed token was right.
bool TokenEquals(std::string_view a, std::string_view b);

// --- Addresses that work across hosts ---

// Whether `host` is a loopback name or address (localhost, 127.x, ::1).
bool IsLoopbackHost(const std::string& host);

// The numeric local address this host sends from to reach `host` (the route's
// source address, found with a UDP connect: no packet is sent). It is on a
// network `host` reaches, so other nodes on that network reach it too.
// kNotFound when `host` does not resolve, kUnavailable without a route.
absl::StatusOr<std::string> LocalAddressToward(const std::string& host);

// The numeric addresses `host` resolves to (IPv4-mapped IPv6 as IPv4);
// kNotFound naming the host when it does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveNumeric(const std::string& host);

// Connects to host:port over TCP within timeout_s and closes again. kNotFound
// when the name does not resolve ("cannot resolve 'h': Name or service not
// known"), kUnavailable when no connection could be made (refused, no route,
// timed out), each naming host and port.
absl::Status CheckTcpConnect(const std::string& host, int port, double timeout_s);

// Connects to host:port over TCP within timeout_s: the connected (blocking)
// socket, which the caller closes; errors as CheckTcpConnect's.
absl::StatusOr<int> ConnectTcp(const std::string& host, int port, double timeout_s);

// A TCP socket listening on every address (IPv6 dual stack where available)
// on a port the kernel picks (*port); `what` names it in errors.
absl::StatusOr<int> ListenTcpAny(int* port, const std::string& what);

// Whether `host` (e.g. this machine's name) resolves to an address of this
// machine that is not loopback: what gloo needs of the host name to pick a
// network interface by itself (it falls back to loopback otherwise).
bool ResolvesToLocalNonLoopback(const std::string& host);

// The network interface holding the numeric address `addr` ("" if none).
std::string InterfaceWithAddress(const std::string& addr);

// Takes a network interface down or brings it up (SIOCSIFFLAGS; needs
// CAP_NET_ADMIN in its network namespace). The chaos `partition` drill.
absl::Status SetInterfaceUp(const std::string& name, bool up);

// Wakes a thread that polls a socket the moment it is told to stop, instead
// of at the end of its poll's timeout (which a stop on a restart's critical
// path would wait out): an eventfd polled beside the socket.
class StopSignal {
 public:
  StopSignal();
  ~StopSignal();
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;
  void Stop();
  bool stopped() const { return stopped_.load(); }
  // Waits until fd is readable (true), the signal stops (false) or
  // fallback_ms pass (false; used only when the eventfd could not be made).
  bool WaitReadable(int fd, int fallback_ms = 100) const;

 private:
  int efd_ = -1;
  std::atomic<bool> stopped_{false};
};

// A TCP listener on every address (port picked by the kernel) that accepts
// connections and closes them at once: other nodes connect to it to prove that
// an address of this host is reachable from theirs. One thread; the destructor
// stops it at once.
class ProbeListener {
 public:
  static absl::StatusOr<std::unique_ptr<ProbeListener>> Start();
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;
  int port() const { return port_; }

 private:
  ProbeListener(int fd, int port);
  int fd_;
  int port_;
  StopSignal stop_;
  std::thread thread_;
};

// --- Who talks to a local TCP port (/proc/net/tcp, /proc/net/tcp6) ---

struct TcpPortUse {
  bool listening = false;                   // a socket listens on the port
  std::vector<std::string> accepted_peers;  // remote addresses of ESTABLISHED sockets on that local port
};

// Adds what one /proc/net/tcp (ipv6 = false) or /proc/net/tcp6 (ipv6 = true)
// text says about local port `port` to *use. IPv4-mapped IPv6 peers are
// written as IPv4 ("10.0.0.2"). Malformed lines are skipped.
void ParseProcNetTcp(std::string_view text, bool ipv6, int port, TcpPortUse* use);
// Both tables of this network namespace.
absl::StatusOr<TcpPortUse> LocalTcpPortUse(int port);

}  // namespace ballast
