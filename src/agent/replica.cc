#include "agent/replica.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "ckpt/format.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "common/thread_priority.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {
namespace {

constexpr char kMagic[4] = {'B', 'R', 'P', '1'};
constexpr uint32_t kOpPut = 1;
constexpr uint32_t kOpGet = 2;   // bytes [offset, offset + length) of a step's image
constexpr uint32_t kOpStat = 3;  // a step's number and size, no bytes
constexpr uint32_t kMaxToken = 4096;
constexpr uint32_t kMaxMessage = 4096;
// A request whose header or token does not arrive within this long is dropped
// (the image itself may take longer: each read has the same deadline).
constexpr double kServerIoTimeoutS = 60.0;

// Both ends are this build on the same kind of machine: host byte order.
struct RequestHeader {
  char magic[4];
  uint32_t op;
  int32_t rank;
  int32_t world;
  uint64_t step;   // put: the image's step; get/stat: 0 = newest
  uint64_t bytes;  // put: image bytes that follow
  uint64_t offset;  // get: the range of the image wanted
  uint64_t length;
  uint32_t token_len;
  uint32_t reserved;
};
struct ReplyHeader {
  uint32_t code;  // absl::StatusCode
  uint32_t message_len;
  uint64_t step;
  uint64_t bytes;  // get: image bytes that follow
};
static_assert(sizeof(RequestHeader) == 56);
static_assert(sizeof(ReplyHeader) == 24);

void SetIoTimeout(int fd, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

absl::Status WriteAll(int fd, const void* data, uint64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t w = send(fd, p, std::min<uint64_t>(n, 64u << 20), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      return absl::UnavailableError(
          absl::StrCat("send: ", w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? "timed out" : std::strerror(errno)));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, uint64_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    ssize_t r = recv(fd, p, std::min<uint64_t>(n, 64u << 20), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return absl::UnavailableError("connection closed by the peer");
    if (r < 0) {
      return absl::UnavailableError(
          absl::StrCat("recv: ", errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : std::strerror(errno)));
    }
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

absl::Status SendReply(int fd, const absl::Status& status, uint64_t step = 0, uint64_t bytes = 0) {
  std::string msg(status.message().substr(0, kMaxMessage));
  ReplyHeader h{static_cast<uint32_t>(status.code()), static_cast<uint32_t>(msg.size()), step, bytes};
  RETURN_IF_ERROR(WriteAll(fd, &h, sizeof(h)));
  return WriteAll(fd, msg.data(), msg.size());
}

// Reads a reply header and its message: the peer's status (its code and
// message) or OK with the header filled.
absl::Status ReadReply(int fd, ReplyHeader* h) {
  RETURN_IF_ERROR(ReadAll(fd, h, sizeof(*h)));
  if (h->message_len > kMaxMessage) return absl::DataLossError("malformed replica reply");
  std::string msg(h->message_len, '\0');
  RETURN_IF_ERROR(ReadAll(fd, msg.data(), msg.size()));
  if (h->code != 0) return absl::Status(static_cast<absl::StatusCode>(h->code), msg);
  return absl::OkStatus();
}

absl::StatusOr<int> Dial(const std::string& addr, double timeout_s) {
  ASSIGN_OR_RETURN(Endpoint ep, ParseEndpoint(addr));
  ASSIGN_OR_RETURN(int fd, ConnectTcp(ep.host, ep.port, timeout_s));
  SetIoTimeout(fd, timeout_s);
  return fd;
}

absl::Status SendRequest(int fd, uint32_t op, const std::string& token, int rank, int world, uint64_t step,
                         uint64_t bytes, uint64_t offset = 0, uint64_t length = 0) {
  RequestHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.op = op;
  h.rank = rank;
  h.world = world;
  h.step = step;
  h.bytes = bytes;
  h.offset = offset;
  h.length = length;
  h.token_len = static_cast<uint32_t>(token.size());
  RETURN_IF_ERROR(WriteAll(fd, &h, sizeof(h)));
  return WriteAll(fd, token.data(), token.size());
}

// Reads `bytes` of an image from fd into a new committed step of `store`
// (origin as given), checking the image up to its index.
absl::Status ReceiveImage(int fd, ckpt::SlotStore* store, uint64_t step, uint64_t bytes, ckpt::SlotOrigin origin,
                          const std::string& what) {
  ASSIGN_OR_RETURN(ckpt::SlotWrite w, store->BeginSave(step, bytes));
  absl::Status s = ReadAll(fd, w.image(), bytes);
  if (s.ok()) {
    ckpt::ParseOptions po;
    po.verify_data = false;  // the restoring worker verifies the data as it copies it
    po.exact_size = true;
    auto parsed = ckpt::ParseImage(w.image(), bytes, what, po);
    if (!parsed.ok()) {
      s = parsed.status();
    } else if (parsed->header.step != step) {
      s = absl::DataLossError(absl::StrCat(what, " holds step ", parsed->header.step, ", not ", step));
    }
  }
  if (!s.ok()) {
    store->Abort(&w);
    return s;
  }
  return store->Commit(&w, bytes, origin);
}

}  // namespace

// ---------------------------------------------------------------------------
// Server.

absl::StatusOr<std::unique_ptr<ReplicaServer>> ReplicaServer::Start(std::string store_prefix, std::string token,
                                                                    int copy_nice) {
  int port = 0;
  ASSIGN_OR_RETURN(int fd, ListenTcpAny(&port, "checkpoint replica listener"));
  return std::unique_ptr<ReplicaServer>(
      new ReplicaServer(std::move(store_prefix), std::move(token), fd, port, copy_nice));
}

ReplicaServer::ReplicaServer(std::string store_prefix, std::string token, int fd, int port, int copy_nice)
    : prefix_(std::move(store_prefix)), token_(std::move(token)), copy_nice_(copy_nice), listen_fd_(fd),
      port_(port) {
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

ReplicaServer::~ReplicaServer() {
  stop_.Stop();
  if (accept_thread_.joinable()) accept_thread_.join();
  std::list<Conn> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Conn& c : conns_) {
      if (!c.done) shutdown(c.fd, SHUT_RDWR);  // unblocks their reads
    }
    conns.splice(conns.end(), conns_);
  }
  for (Conn& c : conns) c.thread.join();
  close(listen_fd_);
}

void ReplicaServer::AcceptLoop() {
  while (!stop_.stopped()) {
    if (!stop_.WaitReadable(listen_fd_)) continue;
    int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    SetIoTimeout(c, kServerIoTimeoutS);
    std::list<Conn> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = conns_.begin(); it != conns_.end();) {
        auto next = std::next(it);
        if (it->done) finished.splice(finished.end(), conns_, it);
        it = next;
      }
      Conn& conn = conns_.emplace_back();
      conn.fd = c;
      conn.thread = std::thread([this, c] { Serve(c); });
    }
    for (Conn& f : finished) f.thread.join();  // already returned
  }
}

absl::StatusOr<ckpt::SlotStore*> ReplicaServer::StoreFor(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = stores_.find(rank);
  if (it != stores_.end()) return it->second.get();
  ckpt::SlotStoreOptions so;
  so.num_slots = 2;  // at most two steps per source rank
  ASSIGN_OR_RETURN(auto store, ckpt::SlotStore::Create(absl::StrCat(prefix_, "-r", rank), so));
  ckpt::SlotStore* raw = store.get();
  stores_[rank] = std::move(store);
  return raw;
}

std::vector<std::string> ReplicaServer::StoreNames() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (const auto& [rank, store] : stores_) names.push_back(store->name());
  return names;
}

int ReplicaServer::DiscardFrom(uint64_t below) {
  std::vector<std::pair<ckpt::SlotStore*, std::mutex*>> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rank, store] : stores_) {
      auto& m = rank_mu_[rank];
      if (!m) m = std::make_unique<std::mutex>();
      held.emplace_back(store.get(), m.get());
    }
  }
  int emptied = 0;
  for (auto& [store, m] : held) {
    std::lock_guard<std::mutex> lock(*m);  // a replica being received lands first
    absl::StatusOr<int> n = store->DiscardFrom(below);
    if (n.ok()) {
      emptied += *n;
    } else {
      spdlog::warn("rollback: cannot drop steps >= {} from replica store {}: {}", below, store->name(),
                   n.status().ToString());
    }
  }
  return emptied;
}

absl::StatusOr<ckpt::PinnedSlot> ReplicaServer::Pin(int rank, uint64_t step) {
  ckpt::SlotStore* store = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stores_.find(rank);
    if (it == stores_.end()) return absl::NotFoundError(absl::StrCat("no replica of rank ", rank, " here"));
    store = it->second.get();
  }
  return step == 0 ? store->PinLatest() : store->PinStep(step);
}

void ReplicaServer::Serve(int fd) {
  auto done = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    close(fd);
    for (Conn& c : conns_) {
      if (c.fd == fd && !c.done) c.done = true;
    }
  };
  RequestHeader h{};
  if (!ReadAll(fd, &h, sizeof(h)).ok() || std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
      h.token_len > kMaxToken) {
    done();
    return;
  }
  std::string token(h.token_len, '\0');
  if (!ReadAll(fd, token.data(), token.size()).ok()) {
    done();
    return;
  }
  if (token != token_) {
    (void)SendReply(fd, absl::PermissionDeniedError("wrong job token for this checkpoint replica channel"));
    done();
    return;
  }
  if (h.op == kOpPut) {
    // A peer's copy yields the cores to this node's training; this thread
    // serves this one put.
    LowerThisThreadForCopies(copy_nice_, "replica-in");
    last_put_nice_ = ThisThreadNice();
    std::mutex* rank_mu;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& m = rank_mu_[h.rank];
      if (!m) m = std::make_unique<std::mutex>();
      rank_mu = m.get();
    }
    absl::Status s;
    {
      std::lock_guard<std::mutex> rank_lock(*rank_mu);
      absl::StatusOr<ckpt::SlotStore*> store = StoreFor(h.rank);
      s = store.ok() ? ReceiveImage(fd, *store, h.step, h.bytes, ckpt::SlotOrigin::kReplica,
                                    absl::StrCat("replica of rank ", h.rank, " step ", h.step))
                     : store.status();
    }
    if (!s.ok()) spdlog::warn("checkpoint replica: rank {} step {} not kept: {}", h.rank, h.step, s.ToString());
    (void)SendReply(fd, s, h.step);
  } else if (h.op == kOpStat) {
    absl::StatusOr<ckpt::PinnedSlot> pin = Pin(h.rank, h.step);
    (void)(pin.ok() ? SendReply(fd, absl::OkStatus(), pin->step(), pin->image_bytes()) : SendReply(fd, pin.status()));
  } else if (h.op == kOpGet) {
    last_get_nice_ = ThisThreadNice();
    absl::StatusOr<ckpt::PinnedSlot> pin = Pin(h.rank, h.step);
    if (!pin.ok()) {
      (void)SendReply(fd, pin.status());
    } else if (h.offset > pin->image_bytes() || h.length > pin->image_bytes() - h.offset) {
      (void)SendReply(fd, absl::OutOfRangeError(absl::StrCat("step ", pin->step(), " of rank ", h.rank, " has ",
                                                             pin->image_bytes(), " bytes")));
    } else if (SendReply(fd, absl::OkStatus(), pin->step(), h.length).ok()) {
      (void)WriteAll(fd, pin->image() + h.offset, h.length);
    }
  } else {
    (void)SendReply(fd, absl::InvalidArgumentError(absl::StrCat("unknown replica request ", h.op)));
  }
  done();
}

// ---------------------------------------------------------------------------
// Client calls.

absl::Status PutReplica(const std::string& addr, const std::string& token, int rank, int world, uint64_t step,
                        const uint8_t* image, uint64_t bytes, double timeout_s) {
  ASSIGN_OR_RETURN(int fd, Dial(addr, timeout_s));
  absl::Status s = SendRequest(fd, kOpPut, token, rank, world, step, bytes);
  if (s.ok()) s = WriteAll(fd, image, bytes);
  ReplyHeader h{};
  if (s.ok()) s = ReadReply(fd, &h);
  close(fd);
  return s;
}

absl::StatusOr<uint64_t> FetchReplica(const std::string& addr, const std::string& token, int rank, uint64_t step,
                                      ckpt::SlotStore* into, double timeout_s, int streams) {
  // Which step, and how large.
  ReplyHeader stat{};
  {
    ASSIGN_OR_RETURN(int fd, Dial(addr, timeout_s));
    absl::Status s = SendRequest(fd, kOpStat, token, rank, 0, step, 0);
    if (s.ok()) s = ReadReply(fd, &stat);
    close(fd);
    RETURN_IF_ERROR(s);
  }
  const uint64_t bytes = stat.bytes;
  const std::string what = absl::StrCat("replica of rank ", rank, " step ", stat.step, " from ", addr);
  // The other slot grows at the worker's first save, not while it restores.
  absl::StatusOr<ckpt::SlotWrite> begun = into->BeginSave(stat.step, bytes, /*grow_others=*/false);
  if (!begun.ok()) {
    into->ReleaseWriter();  // the worker saves next
    return begun.status();
  }
  ckpt::SlotWrite w = std::move(*begun);
  // The image in `streams` ranges over as many connections at once: one TCP
  // stream (and the one core copying it) is slower than the network.
  const int n = static_cast<int>(std::clamp<uint64_t>(bytes >> 24, 1, std::max(1, streams)));
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  const uint64_t chunk = (bytes + n - 1) / n;
  for (int i = 0; i < n; ++i) {
    const uint64_t off = std::min(bytes, chunk * i);
    const uint64_t len = std::min(bytes - off, chunk);
    threads.emplace_back([&, i, off, len] {
      absl::StatusOr<int> fd = Dial(addr, timeout_s);
      if (!fd.ok()) {
        results[i] = fd.status();
        return;
      }
      ReplyHeader h{};
      absl::Status s = SendRequest(*fd, kOpGet, token, rank, 0, stat.step, 0, off, len);
      if (s.ok()) s = ReadReply(*fd, &h);
      if (s.ok() && h.bytes != len) s = absl::DataLossError(absl::StrCat(what, ": short range"));
      if (s.ok()) s = ReadAll(*fd, w.image() + off, len);
      close(*fd);
      results[i] = s;
    });
  }
  for (auto& t : threads) t.join();
  absl::Status s;
  for (const absl::Status& r : results) s.Update(r);
  if (s.ok()) {
    ckpt::ParseOptions po;
    po.verify_data = false;  // the restoring worker verifies the data as it copies it
    po.exact_size = true;
    auto parsed = ckpt::ParseImage(w.image(), bytes, what, po);
    if (!parsed.ok()) s = parsed.status();
    else if (parsed->header.step != stat.step) s = absl::DataLossError(absl::StrCat(what, " holds another step"));
  }
  if (s.ok()) {
    s = into->Commit(&w, bytes, ckpt::SlotOrigin::kReplica);
  } else {
    into->Abort(&w);
  }
  into->ReleaseWriter();
  if (!s.ok()) return s;
  return stat.step;
}

// ---------------------------------------------------------------------------
// Sender.

ReplicaSender::ReplicaSender(std::string node_id, std::string token, std::vector<ckpt::SlotStore*> stores,
                             KvSet kv_set, KvGet kv_get, double poll_interval_s, int copy_nice)
    : node_id_(std::move(node_id)),
      token_(std::move(token)),
      stores_(std::move(stores)),
      kv_set_(std::move(kv_set)),
      kv_get_(std::move(kv_get)),
      poll_interval_s_(poll_interval_s),
      copy_nice_(copy_nice) {
  thread_ = std::thread([this] { Loop(); });
}

ReplicaSender::~ReplicaSender() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ReplicaSender::SetPeers(std::vector<ReplicaPeer> peers, int rank_offset, int world) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_ = std::move(peers);
  rank_offset_ = rank_offset;
  world_ = world;
  // Only steps saved from now on carry this round's ranks.
  baseline_.assign(stores_.size(), 0);
  for (size_t lr = 0; lr < stores_.size(); ++lr) {
    for (const ckpt::SlotInfo& info : stores_[lr]->Inspect()) {
      if (info.state == ckpt::SlotState::kCommitted) baseline_[lr] = std::max(baseline_[lr], info.commit_order);
    }
  }
}

int ReplicaSender::PollOnce() {
  std::vector<ReplicaPeer> peers;
  std::vector<uint64_t> baseline;
  int rank_offset = 0, world = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = peers_;
    baseline = baseline_;
    rank_offset = rank_offset_;
    world = world_;
  }
  int sent = 0;
  const auto now = std::chrono::steady_clock::now();
  for (ReplicaPeer& peer : peers) {
    if (!peer.addr.empty()) continue;
    if (auto it = endpoints_.find(peer.node_id); it != endpoints_.end()) {
      peer.addr = it->second;
    } else if (absl::StatusOr<std::string> ep = kv_get_(ReplicaEndpointKey(peer.node_id)); ep.ok()) {
      peer.addr = endpoints_[peer.node_id] = *ep;
    }
  }
  for (size_t lr = 0; lr < stores_.size() && lr < baseline.size(); ++lr) {
    ckpt::SlotStore* store = stores_[lr];
    // The step to send: the one the worker asked for (every rank asks for the
    // same steps), else the newest committed slot saved in this round.
    const uint64_t requested = store->requested_replica_step();
    std::optional<ckpt::SlotInfo> target;
    for (const ckpt::SlotInfo& info : store->Inspect()) {
      if (info.state != ckpt::SlotState::kCommitted || info.origin != ckpt::SlotOrigin::kSaved) continue;
      if (info.commit_order <= baseline[lr] || (requested > 0 && info.step != requested)) continue;
      if (!target || info.commit_order > target->commit_order) target = info;
    }
    if (!target) continue;
    const int rank = rank_offset + static_cast<int>(lr);
    std::vector<size_t> todo;  // the holders that lack it and can take it now
    bool reachable = false;
    for (size_t k = 0; k < peers.size(); ++k) {
      if (peers[k].addr.empty()) continue;  // its agent has not published its endpoint yet
      reachable = true;
      std::lock_guard<std::mutex> lock(mu_);
      if (sent_[{peers[k].node_id, static_cast<int>(lr)}] >= target->commit_order) continue;
      if (auto it = retry_at_.find(peers[k].node_id); it != retry_at_.end() && now < it->second) continue;
      todo.push_back(k);
    }
    if (!reachable) continue;
    absl::StatusOr<ckpt::PinnedSlot> pin = store->PinStep(target->step);
    if (!pin.ok()) continue;  // overwritten meanwhile: the next pass sends a newer one
    double put_s = 0;
    for (size_t k : todo) {
      const ReplicaPeer& peer = peers[k];
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status s = PutReplica(peer.addr, token_, rank, world, pin->step(), pin->image(), pin->image_bytes(),
                                  /*timeout_s=*/30.0);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      // The record says where a rank's replicas are (and, refreshed every few
      // seconds, which step): one master RPC per rank and round, not per save.
      const std::string kv_key = ReplicaKey(rank, static_cast<int>(k));
      const std::string where = absl::StrCat(peer.node_id, " ", peer.addr, " ", world);
      auto& rec = recorded_[kv_key];
      if (s.ok() && (rec.first != where || std::chrono::steady_clock::now() - rec.second >= kRecordRefresh)) {
        s = kv_set_(kv_key, ReplicaRecord{peer.node_id, peer.addr, pin->step(), world}.ToKvValue());
        if (s.ok()) rec = {where, std::chrono::steady_clock::now()};
      }
      if (!s.ok()) {
        retry_at_[peer.node_id] = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        if (warned_[peer.node_id] != s.ToString()) {
          warned_[peer.node_id] = s.ToString();
          spdlog::warn("checkpoint replica: cannot copy rank {} step {} to node {} ({}): {}; retrying", rank,
                       pin->step(), peer.node_id, peer.addr, s.ToString());
        }
        continue;
      }
      warned_.erase(peer.node_id);
      put_s += ms / 1e3;
      spdlog::debug("checkpoint replica: rank {} step {} ({} bytes) on node {} in {:.1f} ms node={}", rank,
                    pin->step(), pin->image_bytes(), peer.node_id, ms, node_id_);
      std::lock_guard<std::mutex> lock(mu_);
      sent_[{peer.node_id, static_cast<int>(lr)}] = target->commit_order;
      ++sent;
    }
    // Every reachable holder has it: the store keeps it (the survivors' side
    // of a restore from it; SlotStore::MarkReplicated) and the worker learns
    // what it cost.
    bool everywhere = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const ReplicaPeer& peer : peers) {
        if (!peer.addr.empty() && sent_[{peer.node_id, static_cast<int>(lr)}] < target->commit_order) everywhere = false;
      }
    }
    if (!everywhere) continue;
    // The time of one whole pass over the holders only (a retried holder's
    // put alone is not what a step's copy costs).
    if (store->replicated_step() != target->step || !todo.empty()) {
      store->MarkReplicated(target->step, todo.size() == peers.size() ? put_s : 0);
    }
  }
  return sent;
}

void ReplicaSender::Loop() {
  LowerThisThreadForCopies(copy_nice_, "replica-out");
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // Wait first: SetPeers wakes it, and tests drive PollOnce alone.
    cv_.wait_for(lock, std::chrono::duration<double>(poll_interval_s_), [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    PollOnce();
    lock.lock();
  }
}

}  // namespace ballast::agent
