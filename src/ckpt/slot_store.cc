#include "ckpt/slot_store.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif

namespace ballast::ckpt {

// Lives at offset 0 of the control object, shared by processes. Only
// lock-free atomics (checked below) are used, which are address-free and so
// work across processes on shared mappings.
struct alignas(64) SlotControl {
  // Seqlock: odd while the slot is being written (or was torn by a crash).
  std::atomic<uint64_t> seq;
  std::atomic<uint64_t> step;
  std::atomic<uint64_t> image_bytes;
  // Larger = committed later; picks the newest committed slot.
  std::atomic<uint64_t> commit_order;
  std::atomic<uint32_t> state;  // SlotState
  std::atomic<uint32_t> origin;  // SlotOrigin of the committed image
  // Reader pins: 0 = free, else the pid of the reader.
  std::atomic<int32_t> pins[SlotStore::kPinCells];
};

// The worker -> agent persistence channel (see PersistConfig in the header).
// The config is written under its own seqlock (config_seq odd while written);
// request/durable steps are single monotonic words.
struct PersistChannel {
  std::atomic<uint64_t> config_seq;
  int32_t rank;
  int32_t world_size;
  int32_t keep_last;
  uint32_t dir_len;
  char dir[PersistConfig::kMaxDirBytes];
  std::atomic<uint64_t> request_step;  // newest step the writer asked to persist (0: none)
  std::atomic<uint64_t> durable_step;  // newest step the persister made durable
  std::atomic<uint64_t> committed_step;  // newest step globally committed (latest)
  // How long the persister took to write durable_step (ns; 0: not said): what
  // a persist costs, for the writer's pacing of its requests (--ckpt-copy-share).
  std::atomic<uint64_t> durable_write_ns;
  // The persister's last failure, for the writer's wait(): seqlocked like the
  // config (error_seq odd while written).
  std::atomic<uint64_t> error_seq;
  uint64_t error_step;
  uint32_t error_len;
  char error[SlotStore::kMaxPersistErrorBytes];
};

struct ControlBlock {
  char magic[8];
  uint32_t version;
  uint32_t num_slots;
  std::atomic<int32_t> writer_pid;  // 0 = none
  std::atomic<uint64_t> commit_counter;
  SlotControl slots[SlotStore::kMaxSlots];
  PersistChannel persist;
  // The agent copying a replica in (SetIncoming): readers wait for it.
  std::atomic<int32_t> incoming_pid;
  // The worker -> agent replica channel: the step the writer asks the agent
  // to copy to peer nodes (0: none asked; then the agent sends the newest),
  // the newest step every holder acknowledged, and what that took (ns).
  std::atomic<uint64_t> replica_request_step;
  std::atomic<uint64_t> replicated_step;
  std::atomic<uint64_t> replicated_prev_step;  // the one before: kept too
  std::atomic<uint64_t> replica_put_ns;
};

namespace {

constexpr char kControlMagic[8] = {'B', 'A', 'L', 'C', 'T', 'R', 'L', '1'};
constexpr uint32_t kControlVersion = 6;
constexpr uint64_t kControlBytes = 4096;
constexpr uint64_t kGrowGranularity = 2u << 20;
// The capacity a slot grows to for an image of `bytes`.
uint64_t GrowTarget(uint64_t bytes) { return (bytes + kGrowGranularity - 1) / kGrowGranularity * kGrowGranularity; }

static_assert(sizeof(ControlBlock) <= kControlBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int32_t>::is_always_lock_free);

bool ProcessAlive(pid_t pid) {
  if (pid <= 0) return false;
  return kill(pid, 0) == 0 || errno != ESRCH;
}

}  // namespace

PinnedSlot::PinnedSlot(PinnedSlot&& other) noexcept { *this = std::move(other); }

PinnedSlot& PinnedSlot::operator=(PinnedSlot&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    slot_ = other.slot_;
    pin_cell_ = other.pin_cell_;
    step_ = other.step_;
    image_bytes_ = other.image_bytes_;
    origin_ = other.origin_;
    mapping_ = std::move(other.mapping_);
  }
  return *this;
}

void PinnedSlot::Release() {
  if (store_ != nullptr) {
    store_->Unpin(slot_, pin_cell_);
    store_ = nullptr;
  }
}

SlotStore::SlotStore(std::string name, bool owner, bool prefault)
    : name_(std::move(name)), owner_(owner), prefault_(prefault), pid_(getpid()) {}

SlotStore::~SlotStore() {
  stop_populate_ = true;
  // A process forked while a thread ran (a DataLoader worker, say) has the
  // std::thread objects but not the threads: nothing to join there.
  const bool forked = getpid() != pid_;
  for (std::thread* t : {&populate_thread_, &grow_thread_}) {
    if (!t->joinable()) continue;
    if (forked) {
      t->detach();
    } else {
      t->join();
    }
  }
  if (writer_ && block_ != nullptr) {
    int32_t me = pid_;
    block_->writer_pid.compare_exchange_strong(me, 0);
  }
  // ShmSegment destructors unlink the names when we own them.
}

std::string SlotStore::SlotName(const std::string& name, int slot) {
  return absl::StrCat(name, ".s", slot);
}

SlotControl& SlotStore::slot_control(int i) const { return block_->slots[i]; }

absl::StatusOr<std::unique_ptr<SlotStore>> SlotStore::Create(const std::string& name,
                                                             const SlotStoreOptions& options) {
  if (options.num_slots < 2 || options.num_slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_slots must be 2..", kMaxSlots, ", got ", options.num_slots));
  }
  std::unique_ptr<SlotStore> store(new SlotStore(name, /*owner=*/true, options.prefault));
  // Slots first, control last: an opener that finds the control block (with
  // its magic) also finds every slot object.
  for (int i = 0; i < options.num_slots; ++i) {
    ASSIGN_OR_RETURN(auto seg, ShmSegment::Create(SlotName(name, i), options.initial_slot_bytes,
                                                  options.replace_existing));
    if (options.prefault) RETURN_IF_ERROR(seg->Prefault(0, seg->size()));
    store->slots_.push_back(std::move(seg));
  }
  ASSIGN_OR_RETURN(store->control_,
                   ShmSegment::Create(name, kControlBytes, options.replace_existing));
  // The new object is zero-filled, which is a valid initial state for every
  // atomic (empty slots, seq 0, no pins, no writer).
  auto* block = new (store->control_->data()) ControlBlock;
  block->version = kControlVersion;
  block->num_slots = static_cast<uint32_t>(options.num_slots);
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(block->magic, kControlMagic, sizeof(kControlMagic));
  store->block_ = block;
  store->num_slots_ = options.num_slots;
  return store;
}

absl::StatusOr<std::unique_ptr<SlotStore>> SlotStore::Open(const std::string& name,
                                                           bool prefault) {
  std::unique_ptr<SlotStore> store(new SlotStore(name, /*owner=*/false, prefault));
  ASSIGN_OR_RETURN(store->control_, ShmSegment::Open(name));
  if (store->control_->size() < kControlBytes ||
      std::memcmp(store->control_->data(), kControlMagic, sizeof(kControlMagic)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory '", name, "' is not a Ballast checkpoint store"));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  auto* block = reinterpret_cast<ControlBlock*>(store->control_->data());
  if (block->version != kControlVersion || block->num_slots < 2 || block->num_slots > kMaxSlots) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint store '", name, "' has control version ", block->version,
        " / ", block->num_slots, " slots; agent and worker run different Ballast versions"));
  }
  store->block_ = block;
  store->num_slots_ = static_cast<int>(block->num_slots);
  for (int i = 0; i < store->num_slots_; ++i) {
    ASSIGN_OR_RETURN(auto seg, ShmSegment::Open(SlotName(name, i)));
    std::lock_guard<std::mutex> lock(store->mu_);
    store->slots_.push_back(std::move(seg));
  }
  if (prefault) store->PopulateInBackground();
  return store;
}

void SlotStore::PopulateInBackground() {
  std::vector<std::pair<uint64_t, int>> order;  // (commit order, slot): the newest last
  for (int i = 0; i < num_slots_; ++i) {
    const SlotControl& c = slot_control(i);
    const bool committed = c.state.load(std::memory_order_relaxed) == static_cast<uint32_t>(SlotState::kCommitted);
    order.emplace_back(committed ? c.commit_order.load(std::memory_order_relaxed) : 0, i);
  }
  std::stable_sort(order.begin(), order.end());
  std::vector<std::shared_ptr<Mapping>> maps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [unused, i] : order) {
      if (slots_[i]->mapping() != nullptr && slots_[i]->mapping()->size() > 0) maps.push_back(slots_[i]->mapping());
    }
  }
  if (maps.empty()) return;
  populate_thread_ = std::thread([this, maps = std::move(maps)] {
    // At the lowest priority: the process is starting (a restarted worker
    // restores and builds its model now), and a page this thread has not
    // reached yet is faulted by the save or read that touches it.
    pthread_setname_np(pthread_self(), "ckpt-populate");
    (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
    constexpr uint64_t kChunk = 4u << 20;
    for (const auto& m : maps) {
      for (uint64_t lo = 0; lo < m->size(); lo += kChunk) {
        if (stop_populate_.load(std::memory_order_relaxed)) return;
        // Best effort: a kernel without MADV_POPULATE_WRITE (before 5.14)
        // leaves the faults to the first save and read of each page.
        if (madvise(m->data() + lo, std::min(kChunk, m->size() - lo), MADV_POPULATE_WRITE) != 0) return;
      }
    }
  });
}

void SlotStore::WaitPrefaulted() {
  if (populate_thread_.joinable() && getpid() == pid_) populate_thread_.join();
}

absl::Status SlotStore::AcquireWriter() {
  if (writer_) return absl::OkStatus();
  int32_t holder = block_->writer_pid.load();
  while (true) {
    if (holder == pid_) break;
    if (holder != 0 && ProcessAlive(holder)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint store '", name_, "' is already written by live process ", holder,
          "; only one worker per local rank may save"));
    }
    // Free, or the holder died (e.g. a worker killed mid-save): take over.
    if (block_->writer_pid.compare_exchange_weak(holder, pid_)) break;
  }
  writer_ = true;
  return absl::OkStatus();
}

void SlotStore::SetIncoming(bool incoming) { block_->incoming_pid.store(incoming ? pid_ : 0); }

bool SlotStore::incoming() const {
  const int32_t pid = block_->incoming_pid.load();
  return pid != 0 && ProcessAlive(pid);
}

bool SlotStore::WaitIncoming(double timeout_s) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (incoming()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void SlotStore::ReleaseWriter() {
  if (!writer_) return;
  int32_t me = pid_;
  block_->writer_pid.compare_exchange_strong(me, 0);
  writer_ = false;
}

bool SlotStore::HasLivePin(SlotControl& c) {
  bool live = false;
  for (auto& cell : c.pins) {
    int32_t pid = cell.load();  // seq_cst: the Dekker handshake with Pin()
    if (pid == 0) continue;
    if (ProcessAlive(pid)) {
      live = true;
    } else {
      cell.compare_exchange_strong(pid, 0);  // a reader died holding the pin
    }
  }
  return live;
}

absl::StatusOr<SlotWrite> SlotStore::BeginSave(uint64_t step, uint64_t image_bytes, bool grow_others,
                                                int keep_newest) {
  RETURN_IF_ERROR(AcquireWriter());
  keep_newest = std::clamp(keep_newest, 1, std::max(1, num_slots_ - 1));
  // Rank candidates: slots that are not kept first (empty or torn before
  // committed, older commits before newer; a slot already big enough before
  // one that would have to grow, so a writer that keeps one step sizes a
  // third slot only while the persister pins or still needs an older one),
  // then the kept ones (used only when all others are pinned), in this
  // order: the keep_newest newest committed but the newest, oldest first;
  // the two steps the agent's replica sender last saw every peer holder take
  // (the older first: a restore after a node loss needs the survivors' side
  // of the lost node's replica step, and a node lost while sending step S+k
  // leaves S on its holder while the survivors sent S+k); the newest
  // committed; last the pending requests: the step the worker asked to
  // persist while it is not durable (a persister still writing an older step
  // (a slow disk) pins that one's slot, and overwriting the requested step
  // would lose the request: the worker's wait() would wait for a step no
  // longer there), and the step it asked to replicate until it is sent.
  enum Keep : int { kFree = 0, kRecent = 1, kReplicatedPrev = 2, kReplicated = 3, kNewest = 4, kPending = 5 };
  struct Cand {
    int slot;
    uint64_t order;  // commit order; 0 = not committed
    int keep = kFree;
    bool small = false;
  };
  const uint64_t requested = block_->persist.request_step.load();
  const bool request_pending = requested > block_->persist.durable_step.load();
  const uint64_t replica_requested = block_->replica_request_step.load();
  const uint64_t replicated = block_->replicated_step.load();
  const uint64_t replicated_prev = block_->replicated_prev_step.load();
  const bool replica_pending = replica_requested > 0 && replica_requested != replicated;
  std::vector<Cand> cands;
  {
    std::lock_guard<std::mutex> lock(mu_);  // slot sizes
    for (int i = 0; i < num_slots_; ++i) {
      SlotControl& c = slot_control(i);
      const uint64_t seq = c.seq.load(std::memory_order_acquire);
      const bool committed =
          seq % 2 == 0 && c.state.load() == static_cast<uint32_t>(SlotState::kCommitted);
      const uint64_t slot_step = c.step.load();
      int keep = kFree;
      if (committed) {
        if ((request_pending && slot_step == requested) || (replica_pending && slot_step == replica_requested)) {
          keep = kPending;
        } else if (slot_step > 0 && slot_step == replicated) {
          keep = kReplicated;
        } else if (slot_step > 0 && slot_step == replicated_prev) {
          keep = kReplicatedPrev;
        }
      }
      cands.push_back({i, committed ? c.commit_order.load() : 0, keep, slots_[i]->size() < image_bytes});
    }
  }
  std::vector<Cand*> by_order;
  for (Cand& c : cands) {
    if (c.order > 0) by_order.push_back(&c);
  }
  std::sort(by_order.begin(), by_order.end(), [](const Cand* a, const Cand* b) { return a->order > b->order; });
  for (int k = 0; k < keep_newest && k < static_cast<int>(by_order.size()); ++k) {
    by_order[k]->keep = std::max(by_order[k]->keep, k == 0 ? int{kNewest} : int{kRecent});
  }
  std::sort(cands.begin(), cands.end(), [&](const Cand& a, const Cand& b) {
    if (a.keep != b.keep) return a.keep < b.keep;
    if (a.keep == kFree && a.small != b.small) return !a.small;
    return a.order < b.order;
  });
  // The slots this writer needs sized: the kept ones and the one it writes.
  const int want_sized = keep_newest + 1;
  for (const Cand& cand : cands) {
    SlotControl& c = slot_control(cand.slot);
    if (HasLivePin(c)) continue;
    // Only the writer changes seq, so this load is stable.
    const uint64_t old_seq = c.seq.load(std::memory_order_relaxed);
    const uint64_t held = old_seq % 2 == 0 ? old_seq + 1 : old_seq + 2;
    // Odd seq first (seq_cst), then look at the pins again (seq_cst): see
    // point 4 of the header comment.
    c.seq.store(held);
    if (HasLivePin(c)) {
      // A reader pinned it in between; nothing was written yet, so the slot
      // is still intact: restore it (to a new even seq if it was committed).
      c.seq.store(old_seq % 2 == 0 ? old_seq + 2 : held);
      continue;
    }
    c.state.store(static_cast<uint32_t>(SlotState::kWriting), std::memory_order_relaxed);
    SlotWrite w;
    w.slot_ = cand.slot;
    w.step_ = step;
    w.seq_ = held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ShmSegment& seg = *slots_[cand.slot];
      const uint64_t want = GrowTarget(image_bytes);
      if (seg.size() < image_bytes) {
        absl::Status s = seg.EnsureCapacity(want, prefault_);
        if (!s.ok()) {
          c.state.store(static_cast<uint32_t>(SlotState::kEmpty), std::memory_order_relaxed);
          return s;
        }
      }
      // The next saves would pay the same for their slots: grow the ones
      // this writer uses (want_sized of them, the biggest first) in the
      // background once this save is committed or aborted: started now, the
      // growth would compete with this save's copy for the CPUs (a first
      // save of 1 GiB took 0.15 s instead of 0.09 s after Reserve). Also when
      // this save found its own slot sized (Reserve).
      deferred_grow_.clear();
      if (grow_others && prefault_ && !growing_.load()) {
        std::vector<int> order(slots_.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
        std::stable_sort(order.begin(), order.end(),
                         [&](int a, int b) { return slots_[a]->size() > slots_[b]->size(); });
        std::vector<int> to_grow;
        int sized = 1;  // this one
        for (int i : order) {
          if (i == cand.slot || sized >= want_sized) continue;
          ++sized;
          if (slots_[i]->size() < want) to_grow.push_back(i);
        }
        deferred_want_ = want;
        deferred_grow_ = std::move(to_grow);
      }
      w.mapping_ = seg.mapping();
    }
    return w;
  }
  return absl::UnavailableError(absl::StrCat(
      "every slot of checkpoint store '", name_,
      "' is pinned by a reader (persisting or restoring); save of step ", step, " skipped"));
}

bool SlotStore::GrowInBackground(uint64_t want, std::vector<int> slots) {
  if (growing_.exchange(true)) return false;
  if (grow_thread_.joinable()) grow_thread_.join();  // finished: growing_ was false
  grow_thread_ = std::thread([this, want, slots = std::move(slots)] {
    for (int i : slots) {
      // One slot at a time, so a save whose slot is ready does not wait for
      // the others. Best effort: a failure shows again, as an error, when a
      // save needs the slot.
      std::lock_guard<std::mutex> lock(mu_);
      if (slots_[i]->size() < want) (void)slots_[i]->EnsureCapacity(want, /*prefault=*/true);
    }
    growing_ = false;
  });
  return true;
}

void SlotStore::StartDeferredGrowth() {
  std::vector<int> slots;
  uint64_t want = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slots.swap(deferred_grow_);
    want = deferred_want_;
  }
  if (!slots.empty()) (void)GrowInBackground(want, std::move(slots));
}

bool SlotStore::Reserve(uint64_t image_bytes, int slots) {
  if (!prefault_ || image_bytes == 0) return false;
  const uint64_t want = GrowTarget(image_bytes);
  std::vector<int> to_grow;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int n = std::clamp(slots, 1, num_slots_);
    for (int i = 0; i < n; ++i) {
      if (slots_[i]->size() < want) to_grow.push_back(i);
    }
  }
  if (to_grow.empty()) return false;
  return GrowInBackground(want, std::move(to_grow));
}

absl::Status SlotStore::Commit(SlotWrite* w, uint64_t image_bytes, SlotOrigin origin) {
  if (w == nullptr || w->slot_ < 0) return absl::FailedPreconditionError("no save in progress");
  if (image_bytes > w->capacity()) {
    return absl::InvalidArgumentError("image larger than the slot");
  }
  SlotControl& c = slot_control(w->slot_);
  // The image bytes were written with plain stores; everything below is
  // published by the release store of the even seq at the end.
  c.step.store(w->step_, std::memory_order_relaxed);
  c.image_bytes.store(image_bytes, std::memory_order_relaxed);
  c.commit_order.store(block_->commit_counter.fetch_add(1) + 1, std::memory_order_relaxed);
  c.state.store(static_cast<uint32_t>(SlotState::kCommitted), std::memory_order_relaxed);
  c.origin.store(static_cast<uint32_t>(origin), std::memory_order_relaxed);
  c.seq.store(w->seq_ + 1, std::memory_order_release);
  w->slot_ = -1;
  w->mapping_.reset();
  StartDeferredGrowth();
  return absl::OkStatus();
}

void SlotStore::Abort(SlotWrite* w) {
  if (w == nullptr || w->slot_ < 0) return;
  SlotControl& c = slot_control(w->slot_);
  c.state.store(static_cast<uint32_t>(SlotState::kEmpty), std::memory_order_relaxed);
  c.seq.store(w->seq_ + 1, std::memory_order_release);
  w->slot_ = -1;
  w->mapping_.reset();
  StartDeferredGrowth();
}

absl::StatusOr<int> SlotStore::DiscardFrom(uint64_t step) {
  const bool was_writer = writer_;
  RETURN_IF_ERROR(AcquireWriter());
  int emptied = 0;
  for (int i = 0; i < num_slots_; ++i) {
    SlotControl& c = slot_control(i);
    const uint64_t seq = c.seq.load(std::memory_order_acquire);
    if (seq % 2 != 0 || c.state.load() != static_cast<uint32_t>(SlotState::kCommitted) || c.step.load() < step) {
      continue;
    }
    c.seq.store(seq + 1);
    c.state.store(static_cast<uint32_t>(SlotState::kEmpty), std::memory_order_relaxed);
    c.seq.store(seq + 2, std::memory_order_release);
    ++emptied;
  }
  PersistChannel& p = block_->persist;
  for (std::atomic<uint64_t>* word : {&p.request_step, &p.durable_step, &p.committed_step}) {
    if (word->load() >= step) word->store(step > 0 ? step - 1 : 0);
  }
  for (std::atomic<uint64_t>* word :
       {&block_->replica_request_step, &block_->replicated_step, &block_->replicated_prev_step}) {
    if (word->load() >= step) word->store(0);
  }
  if (!was_writer) ReleaseWriter();
  return emptied;
}

absl::StatusOr<PinnedSlot> SlotStore::PinLatest() { return Pin(std::nullopt); }
absl::StatusOr<PinnedSlot> SlotStore::PinStep(uint64_t step) { return Pin(step); }

absl::StatusOr<PinnedSlot> SlotStore::Pin(std::optional<uint64_t> want_step) {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    // Pick the newest committed slot (or the one holding want_step) from a
    // consistent read of each slot's control fields.
    int best = -1;
    uint64_t best_order = 0, best_seq = 0, best_step = 0, best_bytes = 0;
    uint32_t best_origin = 0;
    for (int i = 0; i < num_slots_; ++i) {
      SlotControl& c = slot_control(i);
      const uint64_t s1 = c.seq.load(std::memory_order_acquire);
      if (s1 % 2 != 0) continue;
      const uint32_t state = c.state.load(std::memory_order_relaxed);
      const uint64_t step = c.step.load(std::memory_order_relaxed);
      const uint64_t bytes = c.image_bytes.load(std::memory_order_relaxed);
      const uint64_t order = c.commit_order.load(std::memory_order_relaxed);
      const uint32_t origin = c.origin.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (c.seq.load(std::memory_order_relaxed) != s1) continue;
      if (state != static_cast<uint32_t>(SlotState::kCommitted)) continue;
      if (want_step.has_value() && step != *want_step) continue;
      if (best < 0 || order > best_order) {
        best = i;
        best_order = order;
        best_seq = s1;
        best_step = step;
        best_bytes = bytes;
        best_origin = origin;
      }
    }
    if (best < 0) {
      return absl::NotFoundError(
          want_step.has_value()
              ? absl::StrCat("step ", *want_step, " is not in checkpoint store '", name_, "'")
              : absl::StrCat("checkpoint store '", name_, "' holds no committed step"));
    }
    SlotControl& c = slot_control(best);
    int cell = -1;
    for (int k = 0; k < kPinCells && cell < 0; ++k) {
      int32_t expected = 0;
      if (c.pins[k].compare_exchange_strong(expected, pid_)) cell = k;  // seq_cst
    }
    if (cell < 0) {
      HasLivePin(c);  // clears pins of dead readers
      continue;
    }
    // seq_cst load after the seq_cst CAS: if the writer has not made seq odd
    // yet, it will see our pin (point 4 of the header comment).
    if (c.seq.load() != best_seq) {
      c.pins[cell].store(0);
      continue;
    }
    PinnedSlot pin;
    pin.store_ = this;
    pin.slot_ = best;
    pin.pin_cell_ = cell;
    pin.step_ = best_step;
    pin.image_bytes_ = best_bytes;
    pin.origin_ = static_cast<SlotOrigin>(best_origin);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ShmSegment& seg = *slots_[best];
      if (seg.size() < best_bytes) {
        // The writer (another process) grew the slot: map the new size.
        absl::Status s = seg.Refresh(prefault_);
        if (!s.ok()) {
          pin.Release();
          return s;
        }
      }
      if (seg.size() < best_bytes) {
        pin.Release();
        return absl::DataLossError(absl::StrCat("checkpoint slot ", SlotName(name_, best),
                                                " is smaller than its committed image"));
      }
      pin.mapping_ = seg.mapping();
    }
    return pin;
  }
  return absl::UnavailableError(
      absl::StrCat("could not pin a slot of checkpoint store '", name_, "' (contention)"));
}

absl::StatusOr<PinnedSlot> SlotStore::PinNewestAtMost(uint64_t limit) {
  absl::StatusOr<PinnedSlot> pin = PinStep(limit);
  if (pin.ok() || !absl::IsNotFound(pin.status())) return pin;
  std::optional<uint64_t> best;
  for (const SlotInfo& info : Inspect()) {
    if (info.state != SlotState::kCommitted || info.step > limit) continue;
    if (!best.has_value() || info.step > *best) best = info.step;
  }
  if (!best.has_value()) return absl::NotFoundError(absl::StrCat("no committed step <= ", limit, " in memory"));
  // Inspect is a racy snapshot: the slot may have been overwritten since, and
  // then PinStep says kNotFound, which is the truth by now.
  return PinStep(*best);
}

void SlotStore::Unpin(int slot, int cell) {
  int32_t me = pid_;
  slot_control(slot).pins[cell].compare_exchange_strong(me, 0);
}

std::vector<SlotInfo> SlotStore::Inspect() const {
  std::vector<SlotInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < num_slots_; ++i) {
    SlotControl& c = slot_control(i);
    SlotInfo info;
    info.slot = i;
    info.seq = c.seq.load();
    info.state = static_cast<SlotState>(c.state.load());
    if (info.seq % 2 != 0) info.state = SlotState::kWriting;
    info.step = c.step.load();
    info.image_bytes = c.image_bytes.load();
    info.commit_order = c.commit_order.load();
    info.origin = static_cast<SlotOrigin>(c.origin.load());
    info.capacity = slots_[i]->size();
    for (auto& p : c.pins) {
      if (int32_t pid = p.load(); pid != 0) info.pins.push_back(pid);
    }
    out.push_back(info);
  }
  return out;
}

// ---------------------------------------------------------------------------
// Persistence channel.

absl::Status SlotStore::SetPersistConfig(const PersistConfig& config) {
  if (config.dir.empty() || config.dir.size() >= PersistConfig::kMaxDirBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint directory must be 1..", PersistConfig::kMaxDirBytes - 1, " bytes, got '",
        config.dir, "'"));
  }
  if (config.rank < 0 || config.world_size < 1 || config.rank >= config.world_size ||
      config.keep_last < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad checkpoint persist config: rank ", config.rank,
                                                   ", world size ", config.world_size, ", keep ",
                                                   config.keep_last));
  }
  PersistChannel& p = block_->persist;
  // Seqlock write: odd while the fields change, so a reader never mixes two
  // configurations (the directory of one with the rank of another).
  uint64_t seq = p.config_seq.load(std::memory_order_relaxed);
  if (seq % 2 == 1) ++seq;  // a writer died mid-update: start from even
  p.config_seq.store(seq + 1, std::memory_order_seq_cst);
  p.rank = config.rank;
  p.world_size = config.world_size;
  p.keep_last = config.keep_last;
  p.dir_len = static_cast<uint32_t>(config.dir.size());
  std::memcpy(p.dir, config.dir.data(), config.dir.size());
  p.config_seq.store(seq + 2, std::memory_order_release);
  return absl::OkStatus();
}

std::optional<PersistConfig> SlotStore::GetPersistConfig() const {
  const PersistChannel& p = block_->persist;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    uint64_t before = p.config_seq.load(std::memory_order_acquire);
    if (before == 0) return std::nullopt;  // never configured
    if (before % 2 == 1) continue;
    PersistConfig c;
    c.rank = p.rank;
    c.world_size = p.world_size;
    c.keep_last = p.keep_last;
    uint32_t len = std::min<uint32_t>(p.dir_len, PersistConfig::kMaxDirBytes - 1);
    c.dir.assign(p.dir, len);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (p.config_seq.load(std::memory_order_relaxed) == before) return c;
  }
  return std::nullopt;
}

namespace {
void StoreMax(std::atomic<uint64_t>& word, uint64_t value) {
  uint64_t cur = word.load();
  while (cur < value && !word.compare_exchange_weak(cur, value)) {
  }
}
}  // namespace

void SlotStore::RequestPersist(uint64_t step) { StoreMax(block_->persist.request_step, step); }
uint64_t SlotStore::requested_persist_step() const { return block_->persist.request_step.load(); }
void SlotStore::MarkDurable(uint64_t step, double write_s) {
  if (write_s > 0 && step > block_->persist.durable_step.load()) {
    block_->persist.durable_write_ns.store(static_cast<uint64_t>(write_s * 1e9));
  }
  StoreMax(block_->persist.durable_step, step);
}
double SlotStore::durable_write_s() const { return static_cast<double>(block_->persist.durable_write_ns.load()) / 1e9; }
uint64_t SlotStore::durable_step() const { return block_->persist.durable_step.load(); }
void SlotStore::RequestReplica(uint64_t step) { block_->replica_request_step.store(step); }
uint64_t SlotStore::requested_replica_step() const { return block_->replica_request_step.load(); }
void SlotStore::MarkReplicated(uint64_t step, double put_s) {
  if (put_s > 0) block_->replica_put_ns.store(static_cast<uint64_t>(put_s * 1e9));
  const uint64_t last = block_->replicated_step.load();
  if (last == step) return;
  block_->replicated_prev_step.store(last);
  block_->replicated_step.store(step);
}
uint64_t SlotStore::replicated_step() const { return block_->replicated_step.load(); }
double SlotStore::replica_put_s() const { return static_cast<double>(block_->replica_put_ns.load()) / 1e9; }
void SlotStore::MarkCommitted(uint64_t step) { StoreMax(block_->persist.committed_step, step); }
uint64_t SlotStore::committed_step() const { return block_->persist.committed_step.load(); }

void SlotStore::ReportPersistError(uint64_t step, const std::string& message) {
  PersistChannel& p = block_->persist;
  uint64_t seq = p.error_seq.load(std::memory_order_relaxed);
  if (seq % 2 == 1) ++seq;
  p.error_seq.store(seq + 1, std::memory_order_seq_cst);
  p.error_step = step;
  size_t n = std::min(message.size(), kMaxPersistErrorBytes - 1);
  p.error_len = static_cast<uint32_t>(n);
  std::memcpy(p.error, message.data(), n);
  p.error_seq.store(seq + 2, std::memory_order_release);
}

std::optional<PersistError> SlotStore::GetPersistError() const {
  const PersistChannel& p = block_->persist;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    uint64_t before = p.error_seq.load(std::memory_order_acquire);
    if (before == 0) return std::nullopt;
    if (before % 2 == 1) continue;
    PersistError e;
    e.step = p.error_step;
    e.message.assign(p.error, std::min<uint32_t>(p.error_len, kMaxPersistErrorBytes - 1));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (p.error_seq.load(std::memory_order_relaxed) == before) return e;
  }
  return std::nullopt;
}

}  // namespace ballast::ckpt
