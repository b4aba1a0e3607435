#include "agent/replica_coordinator.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/net.h"
#include "spdlog/spdlog.h"

namespace ballast::agent {

ReplicaCoordinator::ReplicaCoordinator(ReplicaOptions options, std::vector<ckpt::SlotStore*> stores, KvGet kv_get,
                                       std::function<std::string()> log_keys)
    : options_(std::move(options)), stores_(std::move(stores)), kv_get_(std::move(kv_get)),
      log_keys_(std::move(log_keys)) {}

absl::StatusOr<std::unique_ptr<ReplicaCoordinator>> ReplicaCoordinator::Start(
    ReplicaOptions options, std::vector<ckpt::SlotStore*> stores, KvSet kv_set, KvGet kv_get,
    std::function<std::string()> log_keys) {
  auto server = ReplicaServer::Start(options.store_prefix, options.token, options.copy_nice);
  if (!server.ok()) return server.status();
  std::unique_ptr<ReplicaCoordinator> c(
      new ReplicaCoordinator(std::move(options), stores, kv_get, std::move(log_keys)));
  c->server_ = std::move(*server);
  const std::string addr = c->address();
  if (absl::Status s = kv_set(ReplicaEndpointKey(c->options_.node_id), addr); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("cannot publish the replica channel ", addr, ": ", s.message()));
  }
  c->sender_ = std::make_unique<ReplicaSender>(c->options_.node_id, c->options_.token, std::move(stores),
                                               std::move(kv_set), std::move(kv_get), /*poll_interval_s=*/0.025,
                                               c->options_.copy_nice);
  return c;
}

ReplicaCoordinator::~ReplicaCoordinator() {
  JoinCopies();
  sender_.reset();  // it reads the stores and writes to peers' servers: before our server goes
  server_.reset();
}

std::string ReplicaCoordinator::address() const { return Endpoint{options_.host, server_->port()}.ToString(); }

void ReplicaCoordinator::JoinCopies() {
  for (std::thread& t : copies_) t.join();
  copies_.clear();
}

void ReplicaCoordinator::BeforeRound(const v1::StartRound& start) {
  RestoreMissing(start);
  SetPeers(start);
}

void ReplicaCoordinator::RestoreMissing(const v1::StartRound& start) {
  JoinCopies();
  for (size_t lr = 0; lr < stores_.size(); ++lr) {
    ckpt::SlotStore* store = stores_[lr];
    bool holds_a_step = false;
    for (const ckpt::SlotInfo& info : store->Inspect()) holds_a_step |= info.state == ckpt::SlotState::kCommitted;
    if (holds_a_step) continue;  // this node's own memory (or an earlier copy) decides
    const int rank = start.rank_offset() + static_cast<int>(lr);
    std::vector<ReplicaRecord> holders;
    for (int k = 0; k < options_.replicas; ++k) {
      absl::StatusOr<std::string> value = kv_get_(ReplicaKey(rank, k));
      if (!value.ok()) continue;
      absl::StatusOr<ReplicaRecord> rec = ReplicaRecord::FromKvValue(*value);
      if (rec.ok() && rec->world == start.world_size() && rec->holder != options_.node_id) holders.push_back(*rec);
    }
    if (holders.empty()) continue;
    // The copy runs while the workers start (a replacement node's first start
    // is a cold one); their Checkpointer.load() waits for it.
    store->SetIncoming(true);
    copies_.emplace_back([store, rank, holders, token = options_.token, timeout_s = options_.fetch_timeout_s,
                          keys = log_keys_()] {
      for (const ReplicaRecord& rec : holders) {
        const auto t0 = std::chrono::steady_clock::now();
        // The newest step the holder has (the record's step may be a few seconds old).
        absl::StatusOr<uint64_t> step = FetchReplica(rec.addr, token, rank, /*step=*/0, store, timeout_s);
        if (!step.ok()) {
          spdlog::warn("flash checkpoint: cannot copy rank {}'s replica from node {} ({}): {} {}", rank, rec.holder,
                       rec.addr, step.status().ToString(), keys);
          continue;
        }
        uint64_t bytes = 0;
        for (const ckpt::SlotInfo& info : store->Inspect()) {
          if (info.state == ckpt::SlotState::kCommitted && info.step == *step) bytes = info.image_bytes;
        }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        spdlog::info("flash checkpoint: rank {} step {} copied from the replica on node {} ({:.1f} MB in {:.0f} ms) {}",
                     rank, *step, rec.holder, static_cast<double>(bytes) / 1e6, ms, keys);
        break;
      }
      store->SetIncoming(false);
    });
  }
}

void ReplicaCoordinator::SetPeers(const v1::StartRound& start) {
  // The next K nodes by group rank. In a big world the master lists only
  // those (and group rank 0), not every member: look them up by rank.
  std::map<int, const v1::RoundMember*> by_rank;
  for (const v1::RoundMember& m : start.members()) by_rank[m.group_rank()] = &m;
  std::vector<ReplicaPeer> peers;
  const int n = start.group_world_size();
  const int k_max = std::min(options_.replicas, n - 1);
  for (int k = 1; k <= k_max; ++k) {
    auto it = by_rank.find((start.group_rank() + k) % n);
    if (it == by_rank.end()) {
      spdlog::warn("checkpoint replicas: the round lists no node at group rank {} (a master too old for {} copies?) {}",
                   (start.group_rank() + k) % n, k_max, log_keys_());
      break;
    }
    if (it->second->node_id() != options_.node_id) peers.push_back({it->second->node_id(), ""});
  }
  sender_->SetPeers(std::move(peers), start.rank_offset(), start.world_size());
}

}  // namespace ballast::agent
