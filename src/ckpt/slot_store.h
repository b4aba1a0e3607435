// SlotStore: the shared-memory side of flash checkpoint for one local rank.
//
// Objects (POSIX shm under /dev/shm), all created and owned by the agent so
// they survive a worker's death, and opened by the worker:
//   <name>      control block (4 KiB): per-slot seqlock, state, step, size
//   <name>.s<i> slot i (i < num_slots; the agent makes 3): one checkpoint image in the
//               format of format.h; grows when a larger state arrives
// (One object per slot instead of one big segment, so a slot grows by
// ftruncate without moving the other slot's committed data.)
//
// Roles:
//  - one writer (the worker; enforced by a writer pid in the control block,
//    taken over from a dead holder): BeginSave -> write image -> Commit;
//  - readers (the agent's persister, a restoring worker) Pin a committed slot.
//    A pin is a reader's pid in one of the slot's pin cells; a pinned slot is
//    never chosen by the writer, so a save never waits for persistence and the
//    persister reads the bytes in place without a copy.
//
// Crash-safety reasoning (order of writes):
//  1. BeginSave never picks the newest committed slot while another slot is
//     free, so the newest complete step survives any crash during a save.
//  2. BeginSave makes the slot's seq odd *before* the first byte of the image
//     is touched; readers never accept an odd seq. A writer killed mid-save
//     leaves seq odd forever (until the next writer reuses the slot), so the
//     torn image is never read.
//  3. Commit writes step/size/order while seq is still odd, then makes seq even
//     with a release store; a reader loads seq with acquire, reads the fields,
//     and re-checks seq, so it sees a consistent (step, size, image) or retries.
//  4. Writer vs pin is a Dekker handshake on seq_cst atomics: the writer stores
//     odd seq then checks the pins; a pinner CASes a pin then re-checks seq.
//     At least one of them sees the other and backs off, so the writer never
//     writes into a pinned slot.
//  5. Pins and the writer lock hold pids; a holder that died (kill(pid, 0) ==
//     ESRCH) is cleared, so a crashed reader cannot block a slot forever.
//  6. The image itself carries header/index/data checksums, verified on restore.
// The step the writer asked to persist is kept too until it is durable (a
// persister still writing an older step pins that slot; a slow disk must not
// lose the request), and the step it asked to replicate until the agent's
// sender sent it. If every slot other than the kept ones (BeginSave's
// keep_newest newest committed, the pending requests) is pinned, the writer
// overwrites a kept one, oldest first and the pending request last (the
// pinned older step is still whole and being made durable) rather than wait.
//
// Thread safety: a SlotStore may be shared by threads of one process (a mutex
// guards the mappings); BeginSave/Commit must come from one thread at a time.
// PinnedSlot and SlotWrite must not outlive their SlotStore.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <atomic>
#include <mutex>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/shm_segment.h"

namespace ballast::ckpt {

struct ControlBlock;
struct SlotControl;
class SlotStore;

struct SlotStoreOptions {
  // Number of image slots (2..4). 2 lets a save proceed while the previous
  // step is persisted; 3 also keeps the step before the newest for an
  // overlapped saver (keep_newest = 2). A slot takes memory only once used.
  int num_slots = 2;
  // Initial capacity of each slot in bytes (slots grow on demand).
  uint64_t initial_slot_bytes = 0;
  // Prefault the mapped pages of every slot (on create and growth; on open
  // in the background).
  bool prefault = true;
  // Create(): replace a stale object of the same name left by a crashed agent.
  bool replace_existing = true;
};

// Where and as what the writer's steps are persisted. The writer (worker) sets
// it; the persister (the agent under `ballast run`, else a thread of the
// worker itself) reads it with each persist request.
struct PersistConfig {
  static constexpr size_t kMaxDirBytes = 2048;
  std::string dir;     // checkpoint directory (step-<N>/rank-<R>.ballast)
  int rank = 0;        // global rank of the writer's shard
  int world_size = 1;  // ranks whose shards make a step complete
  int keep_last = 3;   // complete steps to keep
};

// The persister's last failure to make a requested step durable.
struct PersistError {
  uint64_t step = 0;
  std::string message;
};

enum class SlotState : uint32_t { kEmpty = 0, kWriting = 1, kCommitted = 2 };

// Who produced a committed image: the store's own writer saving its state, or
// the agent copying in a peer node's replica of this rank (a replacement node
// restoring state it never saved itself).
enum class SlotOrigin : uint32_t { kSaved = 0, kReplica = 1 };

// What Inspect() reports about one slot (a racy snapshot, for logs and tests).
struct SlotInfo {
  int slot = 0;
  SlotState state = SlotState::kEmpty;
  uint64_t seq = 0;
  uint64_t step = 0;
  uint64_t image_bytes = 0;
  uint64_t commit_order = 0;
  SlotOrigin origin = SlotOrigin::kSaved;
  uint64_t capacity = 0;
  std::vector<pid_t> pins;
};

// A slot being written. Obtained from BeginSave; finished by Commit or Abort.
class SlotWrite {
 public:
  SlotWrite() = default;
  SlotWrite(SlotWrite&&) = default;
  SlotWrite& operator=(SlotWrite&&) = default;
  int slot() const { return slot_; }
  uint64_t step() const { return step_; }
  uint8_t* image() const { return mapping_->data(); }
  uint64_t capacity() const { return mapping_->size(); }

 private:
  friend class SlotStore;
  int slot_ = -1;
  uint64_t step_ = 0;
  uint64_t seq_ = 0;  // the odd seq this write holds
  std::shared_ptr<Mapping> mapping_;
};

// A committed slot pinned against overwriting; unpinned on destruction.
class PinnedSlot {
 public:
  PinnedSlot() = default;
  PinnedSlot(PinnedSlot&& other) noexcept;
  PinnedSlot& operator=(PinnedSlot&& other) noexcept;
  PinnedSlot(const PinnedSlot&) = delete;
  PinnedSlot& operator=(const PinnedSlot&) = delete;
  ~PinnedSlot() { Release(); }

  int slot() const { return slot_; }
  uint64_t step() const { return step_; }
  const uint8_t* image() const { return mapping_->data(); }
  uint64_t image_bytes() const { return image_bytes_; }
  SlotOrigin origin() const { return origin_; }
  // Keeps the mapping alive as long as the caller holds it.
  const std::shared_ptr<Mapping>& mapping() const { return mapping_; }
  bool valid() const { return store_ != nullptr; }
  void Release();

 private:
  friend class SlotStore;
  SlotStore* store_ = nullptr;
  int slot_ = -1;
  int pin_cell_ = -1;
  uint64_t step_ = 0;
  uint64_t image_bytes_ = 0;
  SlotOrigin origin_ = SlotOrigin::kSaved;
  std::shared_ptr<Mapping> mapping_;
};

class SlotStore {
 public:
  static constexpr int kMaxSlots = 4;
  static constexpr int kPinCells = 8;

  // Agent side: creates the control block and slots; the store owns the names
  // and unlinks them when destroyed.
  static absl::StatusOr<std::unique_ptr<SlotStore>> Create(const std::string& name,
                                                           const SlotStoreOptions& options = {});
  // Worker (or other reader) side: opens an existing store. With prefault,
  // the slots' pages are faulted on a background thread (populating three
  // 64 MiB slots took ~60 ms, and a restarted worker opens its store on the
  // way to its first step); a save or read of a page not faulted yet faults
  // it itself.
  static absl::StatusOr<std::unique_ptr<SlotStore>> Open(const std::string& name,
                                                         bool prefault = true);
  // Waits for the background faulting Open started (tests, benchmarks).
  void WaitPrefaulted();
  ~SlotStore();

  // Writer: picks a slot for `step` (see the header comment), grows it to
  // image_bytes, and marks it writing. kFailedPrecondition if another live
  // process is the writer; kUnavailable if every slot is pinned. A save that
  // grew its slot grows the other slots in the background (holding the
  // mappings' lock, so a Pin waits for it) from its Commit or Abort on, so
  // the growth does not compete with the save's copy, unless grow_others is
  // false: a replica copied in just before the worker restores it.
  // keep_newest: how many of the newest committed steps the save must not
  // overwrite while another slot is free (1: a blocking saver; 2: an
  // overlapped one, whose ranks can be two saves apart when one dies, so the
  // world's common step is the one before the newest; needs 3 slots).
  absl::StatusOr<SlotWrite> BeginSave(uint64_t step, uint64_t image_bytes, bool grow_others = true,
                                      int keep_newest = 1);
  // Sizes and faults, on the background thread, the first `slots` slots
  // (clamped to num_slots()) for images of image_bytes, so that the first
  // saves of a state that big only copy: a job's first save otherwise pays
  // for creating and faulting its memory (a third of a second per GiB here).
  // Returns at once; false when nothing was started (the slots are big enough
  // already, prefault is off, or a growth is under way). Safe beside saves and
  // readers: a save that needs a slot being grown waits for it (mu_).
  bool Reserve(uint64_t image_bytes, int slots);
  // True while the background thread grows slots (Reserve, or after a save
  // that grew its own).
  bool growing() const { return growing_.load(); }

  // Publishes the slot: image[0, image_bytes) must hold a complete image whose
  // header is written. After Commit returns, readers see this step.
  absl::Status Commit(SlotWrite* write, uint64_t image_bytes, SlotOrigin origin = SlotOrigin::kSaved);
  // Gives up a write; the slot becomes empty.
  void Abort(SlotWrite* write);
  // Stops being the writer (no write in progress), so another process can
  // take the role: the agent, after copying a replica in, before the worker
  // that saves next starts.
  void ReleaseWriter();
  // The agent marks a store whose step it is copying in from a peer's
  // replica while the worker starts; the worker's load waits for it (a
  // marker left by a dead process does not count).
  void SetIncoming(bool incoming);
  bool incoming() const;
  // Waits until !incoming(); false on timeout.
  bool WaitIncoming(double timeout_s) const;

  // Reader: pins the newest committed slot (kNotFound when none), or the slot
  // holding `step`.
  absl::StatusOr<PinnedSlot> PinLatest();
  absl::StatusOr<PinnedSlot> PinStep(uint64_t step);
  // The newest committed step <= limit: the requested step itself when it is
  // still in memory, else an older committed one. kNotFound when every
  // committed slot holds a newer step (the request was overwritten).
  absl::StatusOr<PinnedSlot> PinNewestAtMost(uint64_t limit);

  std::vector<SlotInfo> Inspect() const;

  // A rollback (training health): every committed step >= `step` disappears
  // (its slot becomes empty; a reader that pinned it before keeps its
  // bytes), and the persistence channel's steps are clamped below `step` so
  // the re-trained steps of those numbers persist again. Takes the writer
  // role for the call (kFailedPrecondition while a live writer holds it: stop
  // the worker first). Returns how many slots it emptied.
  absl::StatusOr<int> DiscardFrom(uint64_t step);

  // --- Persistence channel (worker <-> persister), in the control block. ---
  // Monotonic step words: a smaller value than the current one is ignored.
  // Writer: where persisted steps go (seqlocked; kInvalidArgument if bad).
  absl::Status SetPersistConfig(const PersistConfig& config);
  // Anyone: the config, or nullopt before the writer set one.
  std::optional<PersistConfig> GetPersistConfig() const;
  // Writer: asks for `step` (committed in a slot) to be made durable.
  void RequestPersist(uint64_t step);
  uint64_t requested_persist_step() const;
  // Persister: this process's shard of `step` is durable on disk; write_s:
  // how long writing it took (0: not measured), kept while it is the newest.
  void MarkDurable(uint64_t step, double write_s = 0);
  uint64_t durable_step() const;
  // The write time of durable_step() as the persister said it (0: not said).
  double durable_write_s() const;
  // Persister: `step` is globally committed (every rank durable; `latest`).
  void MarkCommitted(uint64_t step);
  uint64_t committed_step() const;
  // Persister: `step` cannot be made durable (write failed, or the step was
  // overwritten in memory before it was pinned), so the writer's wait() can
  // fail with `message` instead of timing out. The newest report wins.
  static constexpr size_t kMaxPersistErrorBytes = 512;
  void ReportPersistError(uint64_t step, const std::string& message);
  std::optional<PersistError> GetPersistError() const;
  // --- Replica channel (worker <-> the agent's replica sender). ---
  // Writer: asks for `step` (committed) to be copied to the peer nodes that
  // hold this rank's replicas; the newest request replaces the last (every
  // rank asks for the same steps: a restore needs one step of every rank).
  // The requested step is kept from overwriting like a pending persist
  // request until it is replicated. Never asked (0): the sender copies the
  // newest step.
  void RequestReplica(uint64_t step);
  uint64_t requested_replica_step() const;
  // Sender: every holder acknowledged `step`; put_s: how long sending it to
  // them took (0: not measured), what the writer paces its requests by.
  void MarkReplicated(uint64_t step, double put_s = 0);
  uint64_t replicated_step() const;
  double replica_put_s() const;
  const std::string& name() const { return name_; }
  int num_slots() const { return num_slots_; }
  bool owner() const { return owner_; }

  // Names of the shm objects of a store called `name`.
  static std::string SlotName(const std::string& name, int slot);

 private:
  SlotStore(std::string name, bool owner, bool prefault);
  absl::Status AcquireWriter();
  absl::StatusOr<PinnedSlot> Pin(std::optional<uint64_t> step);
  bool HasLivePin(SlotControl& c);
  void Unpin(int slot, int cell);
  SlotControl& slot_control(int i) const;
  // Starts grow_thread_ on `slots` (to `want` bytes each, faulted) unless a
  // growth is running; false if it is.
  bool GrowInBackground(uint64_t want, std::vector<int> slots);
  // Starts the growth BeginSave chose, if any (from Commit and Abort).
  void StartDeferredGrowth();
  // Open's background faulting: every slot's current mapping, the newest
  // committed slot last (a restore reads it, and faults it doing so).
  void PopulateInBackground();

  const std::string name_;
  const bool owner_;
  const bool prefault_;
  int num_slots_ = 0;
  pid_t pid_;
  bool writer_ = false;
  std::unique_ptr<ShmSegment> control_;
  ControlBlock* block_ = nullptr;
  mutable std::mutex mu_;  // guards the slot segments' mappings
  std::vector<std::unique_ptr<ShmSegment>> slots_ ABSL_GUARDED_BY(mu_);
  // After a save grew its slot (or on Reserve), slots are grown on this
  // thread (holding mu_ for one slot at a time), while training goes on: the
  // next save finds its slot sized and faulted. growing_ is true until it is
  // done.
  std::thread grow_thread_;
  std::atomic<bool> growing_{false};
  // Open's faulting of the slots it mapped; stopped between chunks by the
  // destructor. It only maps pages (MADV_POPULATE_WRITE writes no data), so
  // it runs beside saves and reads, on mappings it holds a reference to.
  std::thread populate_thread_;
  std::atomic<bool> stop_populate_{false};
  // The slots the save in progress grows when it is committed or aborted.
  std::vector<int> deferred_grow_ ABSL_GUARDED_BY(mu_);
  uint64_t deferred_want_ ABSL_GUARDED_BY(mu_) = 0;

  friend class PinnedSlot;
};

}  // namespace ballast::ckpt
