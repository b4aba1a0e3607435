// Peer replicas (replica.h) as an agent runs them, round by round: this
// node's replica channel (a ReplicaServer, its address published in the
// master's KV store), the sender of this node's steps to the next K nodes of
// each round, and, before a round's workers start, the copy of this node's
// ranks' newest replicas into its stores that hold no step (a replacement
// node), running while the workers start (each store is marked incoming
// meanwhile, and the workers' Checkpointer.load() waits for it).
//
// Ownership: owns the server, the sender and the copy threads; the stores
// are the agent's (CkptPersister) and outlive it. The destructor joins the
// copies, then stops the sender and the server.
//
// Threading: BeforeRound, HeldStores and JoinCopies from one thread (the
// agent's main loop); the copies run on threads of their own.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agent/replica.h"
#include "ballast/v1/master.pb.h"
#include "ckpt/slot_store.h"

namespace ballast::agent {

struct ReplicaOptions {
  std::string node_id;
  std::string host;          // the address other nodes reach this one at
  std::string token;
  std::string store_prefix;  // the agent's store names' prefix (the held replicas' stores extend it)
  int replicas = 1;          // --ckpt-replicas K (> 0)
  int copy_nice = 0;         // --ckpt-copy-nice: the sending thread's and the puts' nice value
  double fetch_timeout_s = 30;
};

class ReplicaCoordinator {
 public:
  // kv_get(key) answers at once (kNotFound when unset).
  using KvSet = std::function<absl::Status(const std::string&, const std::string&)>;
  using KvGet = std::function<absl::StatusOr<std::string>(const std::string&)>;

  // Opens the channel and publishes it; an error says why there are no
  // replicas (the caller logs it and goes on without).
  static absl::StatusOr<std::unique_ptr<ReplicaCoordinator>> Start(ReplicaOptions options,
                                                                  std::vector<ckpt::SlotStore*> stores, KvSet kv_set,
                                                                  KvGet kv_get, std::function<std::string()> log_keys);
  ~ReplicaCoordinator();
  ReplicaCoordinator(const ReplicaCoordinator&) = delete;
  ReplicaCoordinator& operator=(const ReplicaCoordinator&) = delete;

  // Before round `start`'s workers start: copies in the replicas of this
  // node's ranks its stores lack (in the background), and sends this node's
  // steps to the round's next K nodes from now on.
  void BeforeRound(const v1::StartRound& start);
  // The shared-memory names of the replicas held here now, for the workers
  // (BALLAST_CKPT_REPLICAS): a world of another size reads the lost ranks'
  // steps from them.
  std::vector<std::string> HeldStores() { return server_->StoreNames(); }
  // A rollback: the replicas held here drop every step >= below (replica.h).
  int Rewind(uint64_t below) { return server_->DiscardFrom(below); }
  // Waits for the copies BeforeRound started.
  void JoinCopies();
  std::string address() const;

 private:
  ReplicaCoordinator(ReplicaOptions options, std::vector<ckpt::SlotStore*> stores, KvGet kv_get,
                     std::function<std::string()> log_keys);
  void RestoreMissing(const v1::StartRound& start);
  void SetPeers(const v1::StartRound& start);

  const ReplicaOptions options_;
  const std::vector<ckpt::SlotStore*> stores_;
  KvGet kv_get_;
  std::function<std::string()> log_keys_;
  std::unique_ptr<ReplicaServer> server_;
  std::unique_ptr<ReplicaSender> sender_;
  std::vector<std::thread> copies_;
};

}  // namespace ballast::agent
