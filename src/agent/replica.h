// In-memory checkpoint replicas on peer nodes.
//
// Every agent copies a flash checkpoint step of each of its local ranks to
// the agents of the next K nodes of the round (ring order by group rank,
// `--ckpt-replicas K`; 0 turns it off): the step the rank's worker asked for
// (SlotStore::RequestReplica: every rank asks for the same steps, paced by
// the worker so the copies take at most --ckpt-copy-share of the time), or
// the newest step when the worker never asks. The rank's own store keeps the
// last two steps every holder took (SlotStore::MarkReplicated; two: a
// survivor whose copy of step S+k was taken while a lost node's was not
// still holds S): a restore after a node loss needs one step that every rank
// holds, and with paced copies the lost node's replica step is several saves
// old. A node that is lost takes its
// shared memory with it; its replacement (same ranks, same world) copies its
// ranks' newest replicas into its own stores before its workers start, and
// the workers' Checkpointer.load() then finds the step in memory
// (last_load_source "replica") instead of reading the disk.
//
// Data channel: one TCP listener per agent (any address, a kernel-picked
// port), separate from the control-plane RPCs. A request is a fixed header,
// the job token, and for a put the image bytes; the answer is a status, a
// message and for a get the image bytes. Images carry their own header,
// index and data checksums (format.h): a put is checked up to the index
// before it is committed, and the data checksum is checked by the worker's
// verified load, so a replica corrupted anywhere is detected and the load
// falls back to disk.
//
// Where replicas are: after a peer acknowledged a put, the sender records it
// in the master's KV store, key "ckpt-replica/<rank>/<k>" (k-th holder),
// value "<holder node id> <host:port> step=<S> world=<W>": when the holder or
// world changes, and then at most every 5 s (the step is informational; a
// restore copies the newest step the holder has). The data endpoint
// of an agent is in "ckpt-replica-ep/<node id>". The workers still choose
// the step to load collectively (the newest step every rank holds in memory,
// if it is not older than disk's latest): one consistent choice.
//
// Memory: a holder keeps at most two steps per source rank (one SlotStore of
// two slots per source rank, named "<store prefix>-r<rank>", unlinked when the
// agent exits, reclaimed by RemoveStaleAgentShmObjects after a SIGKILL).
//
// Threading: ReplicaServer runs an accept thread and one thread per open
// connection; ReplicaSender runs one thread. Both are stopped by their
// destructors. SetRound is thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/slot_store.h"
#include "common/net.h"
#include "common/replica_record.h"

namespace ballast::agent {

using ballast::ReplicaEndpointKey;
using ballast::ReplicaKey;
using ballast::ReplicaRecord;

class ReplicaServer {
 public:
  // Listens on every address; stores are named "<store_prefix>-r<rank>".
  // copy_nice: the nice value of the threads that take puts (LowerThisThread;
  // 0: the agent's); a get, a restore on the critical path, keeps the agent's.
  static absl::StatusOr<std::unique_ptr<ReplicaServer>> Start(std::string store_prefix, std::string token,
                                                              int copy_nice = 0);
  ~ReplicaServer();
  ReplicaServer(const ReplicaServer&) = delete;
  ReplicaServer& operator=(const ReplicaServer&) = delete;

  int port() const { return port_; }
  // The shared-memory names of the stores held here (one per source rank
  // that sent a replica), for the workers (BALLAST_CKPT_REPLICAS): a world
  // that changed size reads lost ranks' steps from them.
  std::vector<std::string> StoreNames();
  // A rollback: drops every step >= `below` of every rank held here
  // (SlotStore::DiscardFrom). Returns how many slots it emptied.
  int DiscardFrom(uint64_t below);
  // The step of `rank` held here (newest when step is 0); for tests.
  absl::StatusOr<ckpt::PinnedSlot> Pin(int rank, uint64_t step);
  // The nice value the thread of the last put and of the last get ran at
  // (-100: none yet); for tests.
  int last_put_nice() const { return last_put_nice_.load(); }
  int last_get_nice() const { return last_get_nice_.load(); }

 private:
  ReplicaServer(std::string store_prefix, std::string token, int fd, int port, int copy_nice);
  void AcceptLoop();
  void Serve(int fd);
  // The store for a source rank, created on first use.
  absl::StatusOr<ckpt::SlotStore*> StoreFor(int rank);

  const std::string prefix_;
  const std::string token_;
  const int copy_nice_;
  std::atomic<int> last_put_nice_{-100};
  std::atomic<int> last_get_nice_{-100};
  const int listen_fd_;
  const int port_;
  StopSignal stop_;  // wakes the accept thread at once
  std::thread accept_thread_;

  std::mutex mu_;
  std::map<int, std::unique_ptr<ckpt::SlotStore>> stores_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<std::mutex>> rank_mu_ ABSL_GUARDED_BY(mu_);  // one writer per source rank
  // Open connections, each served by its own thread; finished ones (done)
  // are joined by the accept thread.
  struct Conn {
    int fd = -1;
    bool done = false;
    std::thread thread;
  };
  std::list<Conn> conns_ ABSL_GUARDED_BY(mu_);
};

// Sends image[0, bytes) of (rank, world, step) to the server at addr.
absl::Status PutReplica(const std::string& addr, const std::string& token, int rank, int world, uint64_t step,
                        const uint8_t* image, uint64_t bytes, double timeout_s);
// Copies the replica of (rank, step; 0 = the newest held) at addr into `into`
// as a committed step of origin kReplica, over up to `streams` connections
// at once (the caller is not the store's writer afterwards). Returns the
// step copied.
absl::StatusOr<uint64_t> FetchReplica(const std::string& addr, const std::string& token, int rank, uint64_t step,
                                      ckpt::SlotStore* into, double timeout_s, int streams = 4);

struct ReplicaPeer {
  std::string node_id;
  std::string addr;  // host:port of its data channel; "" = look it up in the KV store
};

class ReplicaSender {
 public:
  using KvSet = std::function<absl::Status(const std::string& key, const std::string& value)>;
  using KvGet = std::function<absl::StatusOr<std::string>(const std::string& key)>;  // no wait
  // stores: the agent's own stores by local rank (not owned; must outlive
  // the sender). kv_set records where replicas are; kv_get finds a peer's
  // data endpoint (ReplicaEndpointKey) when a ReplicaPeer has no addr.
  // copy_nice: the sending thread's nice value (LowerThisThread; 0: the agent's).
  ReplicaSender(std::string node_id, std::string token, std::vector<ckpt::SlotStore*> stores, KvSet kv_set,
                KvGet kv_get, double poll_interval_s = 0.025, int copy_nice = 0);
  ~ReplicaSender();
  ReplicaSender(const ReplicaSender&) = delete;
  ReplicaSender& operator=(const ReplicaSender&) = delete;

  // The round: the holders (the next K nodes in ring order; empty stops
  // sending) and the global rank of local rank 0 and the world size, which
  // label the steps saved from now on (steps saved before are not sent).
  void SetPeers(std::vector<ReplicaPeer> peers, int rank_offset, int world);
  // One pass (the thread calls it; tests too): sends every store's
  // requested (else newest) step that a holder lacks. Returns the number of
  // puts that succeeded.
  int PollOnce();

 private:
  void Loop();

  const std::string node_id_;
  const std::string token_;
  const std::vector<ckpt::SlotStore*> stores_;
  const KvSet kv_set_;
  const KvGet kv_get_;
  const double poll_interval_s_;
  const int copy_nice_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<ReplicaPeer> peers_ ABSL_GUARDED_BY(mu_);
  int rank_offset_ ABSL_GUARDED_BY(mu_) = 0;
  int world_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> baseline_ ABSL_GUARDED_BY(mu_);  // per local rank: commit order at SetPeers
  // (holder node id, local rank) -> commit order of the newest image it acknowledged.
  std::map<std::pair<std::string, int>, uint64_t> sent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::chrono::steady_clock::time_point> retry_at_;  // thread only
  std::map<std::string, std::string> warned_;                              // thread only
  std::map<std::string, std::string> endpoints_;                           // thread only: node id -> addr
  // thread only: KV key -> (holder, address and world recorded, when)
  std::map<std::string, std::pair<std::string, std::chrono::steady_clock::time_point>> recorded_;
  static constexpr std::chrono::seconds kRecordRefresh{5};
  std::thread thread_;
};

}  // namespace ballast::agent
