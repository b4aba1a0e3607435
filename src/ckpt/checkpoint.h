// Flash checkpoint, in-process side: CheckpointWriter saves a state (a list of
// byte buffers with keys, dtypes and shapes) into a SlotStore; RestoreFromShm
// reads the newest committed step back. The training loop blocks only for
// Save(): a parallel copy into pre-faulted shared memory fused with the
// checksum, then a commit; persistence to disk happens elsewhere (persister.h).
//
//   auto store = SlotStore::Open("/ballast-job1-r0");  // the agent created it
//   WriterOptions options;
//   options.copy_threads = 8;
//   CheckpointWriter writer(store->get(), options);
//   writer.Save(step, {{"model.w", DType::kFloat32, {1024, 1024}, ptr, 4 << 20}});
//   absl::StatusOr<Snapshot> snap = RestoreFromShm(store->get());
//
// Ownership: the writer borrows the store (which must outlive it) and owns its
// copy threads. Thread safety: one Save at a time per writer (calls are
// serialized by the caller: a training loop); RestoreFromShm is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/copy_pool.h"
#include "ckpt/format.h"
#include "ckpt/slot_store.h"
#include "ckpt/snapshot.h"

namespace ballast::ckpt {

// One value to save: `nbytes` contiguous bytes at `data`. For tensors nbytes
// must equal numel(shape) * DTypeSize(dtype); a kBlob has an empty shape.
// The bytes must stay valid and unchanged until Save returns.
struct EntryView {
  std::string key;
  DType dtype = DType::kBlob;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  uint64_t nbytes = 0;
};

struct WriterOptions {
  // Threads (including the caller) for copies at or above parallel_threshold.
  // Default: BALLAST_CKPT_COPY_THREADS if set, else min(8, hardware threads).
  int copy_threads = 0;
  // Smaller saves are copied on the calling thread.
  uint64_t parallel_threshold_bytes = kDefaultParallelCopyThreshold;
  // Unit of parallel work (rounded to 64 bytes).
  uint64_t chunk_bytes = 4u << 20;
  // Copy on idle-priority threads (a save that overlaps training: it takes
  // only CPU time the training does not use). Such a save also keeps the two
  // newest committed steps (SlotStore::BeginSave keep_newest = 2): ranks that
  // overlap their saves can be two saves apart when one of them dies.
  bool background = false;
  // Test hook: runs after the data is copied into the slot and before the
  // header is written and the slot committed (used to SIGKILL a writer in the
  // middle of a save).
  std::function<void()> before_commit_for_test;
};

struct SaveStats {
  uint64_t step = 0;
  int slot = -1;
  uint64_t image_bytes = 0;
  uint64_t data_checksum = 0;
  double seconds = 0;  // blocking time of Save
};

class CheckpointWriter {
 public:
  CheckpointWriter(SlotStore* store, const WriterOptions& options = {});

  // Copies `entries` (in this order) into a free slot and commits it as
  // `step`. kInvalidArgument for bad entries; kUnavailable when every slot is
  // pinned (the save is skipped, nothing changes); other errors from shm.
  // parallel = false copies on the calling thread alone (the copy threads stay
  // idle): an overlapped save that has a whole step to finish in, where more
  // copy threads only take more of the cores training runs on.
  absl::StatusOr<SaveStats> Save(uint64_t step, const std::vector<EntryView>& entries, bool parallel = true);

  // Prepares the store for saves of `entries` (their data pointers are not
  // read): sizes and faults the slot the first save uses, in the background
  // (SlotStore::Reserve); that save grows the others. Returns the image size
  // planned; kInvalidArgument for bad entries.
  absl::StatusOr<uint64_t> Reserve(const std::vector<EntryView>& entries);
  int copy_threads() const { return pool_.threads(); }

 private:
  SlotStore* store_;
  WriterOptions options_;
  CopyPool pool_;
};

struct RestoreOptions {
  // Verify the data checksum (a parallel pass over the data). Without it the
  // snapshot is not verified() and a reader may verify as it copies.
  bool verify_data = true;
  // Restore this step instead of the newest committed one.
  std::optional<uint64_t> step;
  // Threads for the verification pass; null: calling thread only.
  CopyPool* pool = nullptr;
};

// A piece of a snapshot's data region to copy out: [offset, offset + nbytes) to dst.
struct Extract {
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  uint8_t* dst = nullptr;
};

// Copies `extracts` (sorted by offset, non-overlapping) out of the data
// region data[0, data_bytes) and returns the Checksum64 digest of the whole
// region, in one pass: window by window, the copies first, then the checksum
// of the source window while it is still in cache. Parallel over `pool` (null:
// the calling thread) at or above the parallel threshold.
uint64_t CopyOutAndChecksum(const uint8_t* data, uint64_t data_bytes, const std::vector<Extract>& extracts,
                            CopyPool* pool);

// Sizes and faults, in the background, the slot the next save of an image of
// about `image_bytes` takes (CheckpointWriter::Reserve's plan, or a shard just
// read from disk), with slack for the metadata a real save's image may add
// (step numbers, small values). That save grows the other slots. False when
// nothing was started (SlotStore::Reserve).
bool ReserveForImage(SlotStore* store, uint64_t image_bytes);

// The newest committed step in the store (never a torn one), validated.
// kNotFound when the store holds no committed step. The snapshot pins its slot
// until destroyed and must not outlive the store.
absl::StatusOr<Snapshot> RestoreFromShm(SlotStore* store, const RestoreOptions& options = {});

// Copies entries (sorted by their planned offsets) into the data region
// dst[0, data_bytes), zero-filling padding, and returns the Checksum64 digest
// of the region. Splits into 64-byte aligned chunks over `pool` at or above
// `threshold` bytes. Exposed for benchmarks.
uint64_t CopyDataAndChecksum(uint8_t* dst, uint64_t data_bytes, const std::vector<Entry>& planned,
                             const std::vector<const void*>& sources, CopyPool* pool,
                             uint64_t threshold, uint64_t chunk_bytes);

// Checksum64 digest of [data, data + n), split over `pool` (may be null).
uint64_t ParallelChecksum(const uint8_t* data, uint64_t n, CopyPool* pool,
                          uint64_t chunk_bytes = 4u << 20);

// Default copy thread count (see WriterOptions::copy_threads).
int DefaultCopyThreads();

}  // namespace ballast::ckpt
