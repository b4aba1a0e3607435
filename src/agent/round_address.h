// The round's MASTER_ADDR:PORT, as an agent handles it:
//  - Resolve: group rank 0 picks a free port, opens an address probe and
//    publishes "host:port probe=P" in the master's KV store; the other
//    members read it (waiting up to kv_wait_s).
//  - Check: every member, before its workers start, proves the address is
//    reachable from here (connects to the probe port; without one only the
//    name can be checked), so an address others cannot reach fails the round
//    at once instead of every worker hanging in init_process_group.
//  - The store watch: on the node of global rank 0, once the workers run,
//    fails the round when a member node never reached the torch store
//    (JudgeStore).
//
// Side effects go through RoundAddressHooks (the KV store, the port and
// address probing, /proc/net/tcp), so it is tested with fakes; RealHooks
// gives the real ones but the KV store, which is the caller's.
//
// Ownership: owns the probe listener (group rank 0, while the round runs)
// and the store watch. Threading: not thread-safe; the agent's main loop
// owns it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ballast/v1/master.pb.h"
#include "common/net.h"

namespace ballast::agent {

// The round's MASTER_ADDR:PORT, as group rank 0 publishes it in the master's
// KV store ("host:port probe=P"): probe_port is a port on the same host that
// accepts connections, so members can prove they reach the address before
// their workers start (0: none was published).
struct RoundEndpoint {
  std::string host;
  int port = 0;
  int probe_port = 0;
  std::string ToKvValue() const;
  static absl::StatusOr<RoundEndpoint> FromKvValue(const std::string& value);
};

// The process group's formation, seen from the node of global rank 0: its
// TCPStore listens on MASTER_PORT and every rank connects to it (torch opens
// one or two connections per rank, so only "none from a node" is certain).
// `use` is what /proc/net/tcp says about that port now. Once the store has
// listened for timeout_s, the watch is done: it returns the failure cause when
// some member node has no connection to the store at all (naming those
// nodes), else "". Members whose host does not resolve here are not judged.
struct StoreWatch {
  int port = 0;            // 0: not watching
  double timeout_s = 0;
  std::optional<double> listening_since;  // seconds, any monotonic clock
  bool done = false;
};
std::string JudgeStore(StoreWatch* watch, const TcpPortUse& use, double now_s,
                       const google::protobuf::RepeatedPtrField<v1::RoundMember>& members,
                       const std::string& master_addr);

struct RoundAddressOptions {
  std::string node_id;
  std::string host;   // the address this node announces (MASTER_ADDR when group rank 0)
  int node_rank = -1;  // --node-rank hint, for messages
  double kv_wait_s = 120;            // members wait this long for group rank 0's endpoint
  double reconnect_timeout_s = 60;   // group rank 0 retries its KvSet this long (a restarting master)
  double addr_check_timeout_s = 5;   // connecting to the probe port
  double store_connect_timeout_s = 300;  // StoreWatch.timeout_s
};

struct RoundAddressHooks {
  // The master's KV store. kv_get may wait up to wait_s for the key
  // (kNotFound when it is still unset).
  std::function<absl::Status(const std::string& key, const std::string& value)> kv_set;
  std::function<absl::StatusOr<std::string>(const std::string& key, double wait_s)> kv_get;
  // A free TCP port for MASTER_PORT (PickFreePort).
  std::function<absl::StatusOr<int>()> pick_port;
  // Opens the address probe (ProbeListener::Start).
  std::function<absl::StatusOr<std::unique_ptr<ProbeListener>>()> open_probe;
  // Connects to host:port within timeout_s (CheckTcpConnect).
  std::function<absl::Status(const std::string& host, int port, double timeout_s)> connect;
  // Whether host resolves to an address reachable from here (LocalAddressToward).
  std::function<absl::Status(const std::string& host)> resolve;
  // Who talks to a local TCP port (LocalTcpPortUse).
  std::function<absl::StatusOr<TcpPortUse>(int port)> port_use;

  // The real network hooks with the given KV store.
  static RoundAddressHooks Real(
      std::function<absl::Status(const std::string&, const std::string&)> kv_set,
      std::function<absl::StatusOr<std::string>(const std::string&, double)> kv_get);
};

class RoundAddress {
 public:
  // log_keys gives the "node=... round=..." suffix of its log lines.
  RoundAddress(RoundAddressOptions options, RoundAddressHooks hooks, std::function<std::string()> log_keys);

  // Resolves MASTER_ADDR/PORT for the round (publishing it at group rank 0);
  // kAborted when superseded() says a pending event (newer decision, signal)
  // made the start pointless while waiting.
  absl::StatusOr<RoundEndpoint> Resolve(const v1::StartRound& start, const std::function<bool()>& superseded);
  // Every member, before its workers start: the round's MASTER_ADDR resolves
  // here and its probe port accepts a connection. The failure cause names this
  // node and says what to pass, or "".
  std::string Check(const v1::StartRound& start, const RoundEndpoint& ep) const;

  // The round's workers started with MASTER_PORT master_port: the node of
  // global rank 0 (in a world of more than one rank) watches the store.
  void WorkersStarted(const v1::StartRound& start, int master_port);
  // Every poll while the round runs: once a second, the store watch. A
  // failure report (global rank 0) when a member node never reached the
  // store, else nullopt.
  std::optional<v1::FailureReport> WatchStore(uint64_t now_ns, const v1::StartRound& start);
  // The round's workers stopped: closes the probe and ends the watch.
  void RoundEnded();

  const StoreWatch& store_watch() const { return store_watch_; }
  bool probe_open() const { return probe_ != nullptr; }

 private:
  const RoundAddressOptions options_;
  RoundAddressHooks hooks_;
  std::function<std::string()> log_keys_;
  // Group rank 0: accepts the other members' address checks while the round runs.
  std::unique_ptr<ProbeListener> probe_;
  // Group rank 0: the round's TCPStore; port 0 = not watching.
  StoreWatch store_watch_;
  uint64_t next_store_check_ns_ = 0;
};

}  // namespace ballast::agent
