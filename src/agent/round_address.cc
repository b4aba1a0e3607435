#include "agent/round_address.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "health/failure_class.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool Retryable(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

}  // namespace

std::string RoundEndpoint::ToKvValue() const {
  return absl::StrCat(Endpoint{host, port}.ToString(), " probe=", probe_port);
}

absl::StatusOr<RoundEndpoint> RoundEndpoint::FromKvValue(const std::string& value) {
  std::string ep_text = value;
  RoundEndpoint out;
  if (size_t sp = value.find(" probe="); sp != std::string::npos) {
    ep_text = value.substr(0, sp);
    if (!absl::SimpleAtoi(value.substr(sp + 7), &out.probe_port) || out.probe_port < 0 || out.probe_port > 65535)
      return absl::InvalidArgumentError(absl::StrCat("bad round endpoint '", value, "'"));
  }
  auto ep = ParseEndpoint(ep_text, -1);
  if (!ep.ok()) return ep.status();
  out.host = ep->host;
  out.port = ep->port;
  return out;
}

std::string JudgeStore(StoreWatch* w, const TcpPortUse& use, double now_s,
                       const google::protobuf::RepeatedPtrField<v1::RoundMember>& members,
                       const std::string& master_addr) {
  if (w->done) return "";
  if (!use.listening) {
    // Not yet (rank 0 has not called init_process_group), or the store is
    // gone with rank 0's worker (that failure is reported on its own).
    if (w->listening_since.has_value()) w->done = true;
    return "";
  }
  if (!w->listening_since.has_value()) w->listening_since = now_s;
  if (now_s - *w->listening_since < w->timeout_s) return "";
  w->done = true;
  std::set<std::string> peers(use.accepted_peers.begin(), use.accepted_peers.end());
  std::vector<std::string> missing;
  for (const auto& m : members) {
    auto addrs = ResolveNumeric(m.host());
    if (!addrs.ok()) continue;  // cannot tell from here
    bool connected = false;
    for (const std::string& a : *addrs) connected = connected || peers.count(a) > 0;
    if (!connected) {
      missing.push_back(absl::StrCat("group rank ", m.group_rank(), " (node ", m.node_id(), ", host ", m.host(),
                                     ", ranks ", m.rank_offset(), "-", m.rank_offset() + m.local_world_size() - 1,
                                     ")"));
    }
  }
  if (missing.empty()) return "";
  return absl::StrCat("the process group did not form: no rank of ", absl::StrJoin(missing, ", "),
                      " reached the torch store at MASTER_ADDR ", Endpoint{master_addr, w->port}.ToString(),
                      " within ", w->timeout_s, " s after it started listening. Check that those nodes reach ",
                      master_addr, " and that their scripts call init_process_group "
                      "(BALLAST_STORE_CONNECT_TIMEOUT_S waits longer)");
}

RoundAddressHooks RoundAddressHooks::Real(
    std::function<absl::Status(const std::string&, const std::string&)> kv_set,
    std::function<absl::StatusOr<std::string>(const std::string&, double)> kv_get) {
  RoundAddressHooks h;
  h.kv_set = std::move(kv_set);
  h.kv_get = std::move(kv_get);
  h.pick_port = [] { return PickFreePort("0.0.0.0"); };
  h.open_probe = [] { return ProbeListener::Start(); };
  h.connect = [](const std::string& host, int port, double timeout_s) {
    return CheckTcpConnect(host, port, timeout_s);
  };
  h.resolve = [](const std::string& host) { return LocalAddressToward(host).status(); };
  h.port_use = [](int port) { return LocalTcpPortUse(port); };
  return h;
}

RoundAddress::RoundAddress(RoundAddressOptions options, RoundAddressHooks hooks,
                           std::function<std::string()> log_keys)
    : options_(std::move(options)), hooks_(std::move(hooks)), log_keys_(std::move(log_keys)) {}

absl::StatusOr<RoundEndpoint> RoundAddress::Resolve(const v1::StartRound& start,
                                                    const std::function<bool()>& superseded) {
  const std::string key = absl::StrCat("round/", start.round(), "/master_endpoint");
  if (start.group_rank() == 0) {
    auto port = hooks_.pick_port();
    if (!port.ok()) return port.status();
    RoundEndpoint ep{options_.host, *port, 0};
    // The other members connect here before their workers start (and so do
    // we): an address they cannot reach fails the round at once, instead of
    // every worker hanging in init_process_group.
    auto probe = hooks_.open_probe();
    if (probe.ok()) {
      probe_ = std::move(*probe);
      ep.probe_port = probe_->port();
    } else {
      spdlog::warn("cannot open the address probe ({}); members check only that {} resolves {}",
                   std::string(probe.status().message()), options_.host, log_keys_());
    }
    absl::Status s;
    auto t0 = Clock::now();
    do {
      s = hooks_.kv_set(key, ep.ToKvValue());
      if (s.ok()) return ep;
      if (!Retryable(s) || superseded()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } while (SecondsSince(t0) < options_.reconnect_timeout_s);  // a restarting master comes back
    return s;
  }
  auto t0 = Clock::now();
  const double wait_s = options_.kv_wait_s;
  absl::Status last;
  while (SecondsSince(t0) < wait_s) {
    // Wait in short slices so a newer decision or a signal is not held up.
    if (superseded()) return absl::AbortedError("superseded by a newer event");
    auto slice_start = Clock::now();
    auto r = hooks_.kv_get(key, std::min(1.0, std::max(0.0, wait_s - SecondsSince(t0))));
    if (r.ok()) return RoundEndpoint::FromKvValue(*r);
    last = r.status();
    if (!absl::IsNotFound(last) && !Retryable(last)) return last;
    if (SecondsSince(slice_start) < 0.1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat("group rank 0 did not publish ", key, " within ",
                                                  static_cast<int>(wait_s), " s (", last.message(), ")"));
}

std::string RoundAddress::Check(const v1::StartRound& start, const RoundEndpoint& ep) const {
  absl::Status s = ep.probe_port > 0 ? hooks_.connect(ep.host, ep.probe_port, options_.addr_check_timeout_s)
                                     : hooks_.resolve(ep.host);
  // Without a probe port only the name can be checked.
  if (s.ok() || (ep.probe_port == 0 && !absl::IsNotFound(s))) return "";
  std::string rank0 = "group rank 0";
  for (const auto& m : start.members()) {
    if (m.group_rank() == 0) rank0 = absl::StrCat("group rank 0 (node ", m.node_id(), ")");
  }
  const bool self = start.group_rank() == 0;
  return absl::StrCat(
      "node rank ", options_.node_rank, " (node ", options_.node_id, ", host ", options_.host, ", group rank ",
      start.group_rank(), ") cannot reach the round's MASTER_ADDR ", Endpoint{ep.host, ep.port}.ToString(),
      self ? " (its own announced address)" : absl::StrCat(", announced by ", rank0), ": ", s.message(),
      ". The workers would hang in init_process_group. ",
      self ? "Pass `--local-addr ADDR` to this node's `ballast run` with an address of this host that every node "
             "reaches (e.g. its IP)"
           : absl::StrCat("Pass `--local-addr ADDR` to the `ballast run` of ", rank0,
                          " with an address of its host that every node reaches (e.g. its IP), or make '", ep.host,
                          "' resolve on every node"));
}

void RoundAddress::WorkersStarted(const v1::StartRound& start, int master_port) {
  store_watch_ = StoreWatch{};
  if (start.rank_offset() == 0 && start.world_size() > 1) {
    store_watch_.port = master_port;
    store_watch_.timeout_s = options_.store_connect_timeout_s;
  }
}

std::optional<v1::FailureReport> RoundAddress::WatchStore(uint64_t now, const v1::StartRound& start) {
  if (store_watch_.port == 0 || store_watch_.done) return std::nullopt;
  if (now < next_store_check_ns_) return std::nullopt;
  next_store_check_ns_ = now + 1'000'000'000ull;
  auto use = hooks_.port_use(store_watch_.port);
  if (!use.ok()) {
    store_watch_.done = true;  // cannot tell: say nothing rather than guess
    spdlog::debug("store watch: {} {}", use.status().ToString(), log_keys_());
    return std::nullopt;
  }
  std::string cause = JudgeStore(&store_watch_, *use, static_cast<double>(now) / 1e9, start.members(), options_.host);
  if (cause.empty()) return std::nullopt;
  spdlog::error("{} {}", cause, log_keys_());
  v1::FailureReport report;
  report.set_node_id(options_.node_id);
  report.set_round(start.round());
  report.set_local_rank(0);
  report.set_global_rank(0);
  health::FailureEvidence evidence;
  evidence.store_timeout = true;
  health::FailureClass fc = health::Classify(evidence);
  report.set_cause(cause);
  report.set_kind(health::FailureKindName(fc.kind));
  report.set_max_retries(fc.max_retries);
  return report;
}

void RoundAddress::RoundEnded() {
  probe_.reset();
  store_watch_ = StoreWatch{};
}

}  // namespace ballast::agent
