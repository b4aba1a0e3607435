#include "ckpt/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checksum.h"
#include "common/status_macros.h"
#include "common/tunables.h"

namespace ballast::ckpt {
namespace {

// Copy and checksum in windows that fit in L2 (see FillAndChecksum).
constexpr uint64_t kWindowBytes = 256u << 10;

struct Source {
  uint64_t offset;
  uint64_t nbytes;
  const uint8_t* data;
};

// Writes dst[lo, hi) of the data region: entry bytes where entries are, zero
// elsewhere. `sources` is sorted by offset and non-overlapping.
void Fill(uint8_t* dst, uint64_t lo, uint64_t hi, const std::vector<Source>& sources) {
  // First entry that ends after lo (ends ascend with offsets).
  auto it = std::partition_point(sources.begin(), sources.end(),
                                 [&](const Source& s) { return s.offset + s.nbytes <= lo; });
  uint64_t pos = lo;
  for (; it != sources.end() && pos < hi; ++it) {
    if (it->nbytes == 0) continue;
    if (it->offset >= hi) break;
    if (it->offset > pos) {
      std::memset(dst + pos, 0, it->offset - pos);
      pos = it->offset;
    }
    const uint64_t end = std::min(it->offset + it->nbytes, hi);
    std::memcpy(dst + pos, it->data + (pos - it->offset), end - pos);
    pos = end;
  }
  if (pos < hi) std::memset(dst + pos, 0, hi - pos);
}

// Copies a chunk window by window and checksums each window right after
// copying it, while it is still in L2: the checksum costs an L2 read, not a
// second pass over DRAM. (glibc's memcpy is kept for the copy itself: its
// "rep movsb" path avoids the read-for-ownership of destination lines that a
// hand-written fused copy+sum loop pays; measured slower on x86-64.)
Checksum64 FillAndChecksum(uint8_t* dst, uint64_t lo, uint64_t hi,
                           const std::vector<Source>& sources) {
  Checksum64 cs;
  for (uint64_t w = lo; w < hi; w += kWindowBytes) {
    const uint64_t we = std::min(hi, w + kWindowBytes);
    Fill(dst, w, we, sources);
    cs.Update(dst + w, we - w);
  }
  return cs;
}

uint64_t ChunkSize(uint64_t n, CopyPool* pool, uint64_t chunk_bytes) {
  // At least a few chunks per thread, so a slow thread does not hold up the rest.
  const uint64_t per_thread = n / (static_cast<uint64_t>(pool->threads()) * 2) + 1;
  uint64_t chunk = std::min(std::max<uint64_t>(chunk_bytes, 64), per_thread);
  chunk = std::max<uint64_t>(chunk, kWindowBytes);
  return AlignUp(chunk, Checksum64::kRowBytes);
}

// The digest of a region of n bytes whose checksum part(lo, hi) computes for
// [lo, hi): in one call on the calling thread, or in chunks over `pool` when
// it has threads and n >= threshold (linear sums: the parts combine to the
// checksum of the whole region).
template <typename Part>
uint64_t ChunkedDigest(uint64_t n, CopyPool* pool, uint64_t threshold, uint64_t chunk_bytes, const Part& part) {
  if (pool == nullptr || pool->threads() == 1 || n < threshold) return part(0, n).Digest();
  const uint64_t chunk = ChunkSize(n, pool, chunk_bytes);
  const size_t count = (n + chunk - 1) / chunk;
  std::vector<Checksum64> parts(count);
  pool->Run(count, [&](size_t i) {
    const uint64_t lo = i * chunk;
    parts[i] = part(lo, std::min(n, lo + chunk));
  });
  Checksum64 total;
  for (const Checksum64& p : parts) total.Append(p);
  return total.Digest();
}

}  // namespace

int DefaultCopyThreads() {
  if (const int n = Tunables::Get().ckpt_copy_threads; n >= 1) return std::min(n, 256);  // BALLAST_CKPT_COPY_THREADS
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw, 1, 8);
}

uint64_t CopyDataAndChecksum(uint8_t* dst, uint64_t data_bytes, const std::vector<Entry>& planned,
                             const std::vector<const void*>& sources, CopyPool* pool,
                             uint64_t threshold, uint64_t chunk_bytes) {
  std::vector<Source> srcs;
  srcs.reserve(planned.size());
  for (size_t i = 0; i < planned.size(); ++i) {
    srcs.push_back({planned[i].offset, planned[i].nbytes, static_cast<const uint8_t*>(sources[i])});
  }
  return ChunkedDigest(data_bytes, pool, threshold, chunk_bytes,
                       [&](uint64_t lo, uint64_t hi) { return FillAndChecksum(dst, lo, hi, srcs); });
}

namespace {

// Copies the extracts that overlap [lo, hi) and checksums the source window
// by window (see CopyOutAndChecksum).
Checksum64 CopyOutWindowed(const uint8_t* data, uint64_t lo, uint64_t hi, const std::vector<Extract>& extracts) {
  Checksum64 cs;
  auto first = std::partition_point(extracts.begin(), extracts.end(),
                                    [&](const Extract& e) { return e.offset + e.nbytes <= lo; });
  for (uint64_t w = lo; w < hi; w += kWindowBytes) {
    const uint64_t we = std::min(hi, w + kWindowBytes);
    while (first != extracts.end() && first->offset + first->nbytes <= w) ++first;
    for (auto it = first; it != extracts.end() && it->offset < we; ++it) {
      const uint64_t a = std::max(w, it->offset);
      const uint64_t b = std::min(we, it->offset + it->nbytes);
      if (b > a) std::memcpy(it->dst + (a - it->offset), data + a, b - a);
    }
    cs.Update(data + w, we - w);
  }
  return cs;
}

}  // namespace

uint64_t CopyOutAndChecksum(const uint8_t* data, uint64_t data_bytes, const std::vector<Extract>& extracts,
                            CopyPool* pool) {
  return ChunkedDigest(data_bytes, pool, kDefaultParallelCopyThreshold, 4u << 20,
                       [&](uint64_t lo, uint64_t hi) { return CopyOutWindowed(data, lo, hi, extracts); });
}

uint64_t ParallelChecksum(const uint8_t* data, uint64_t n, CopyPool* pool, uint64_t chunk_bytes) {
  return ChunkedDigest(n, pool, kDefaultParallelCopyThreshold, chunk_bytes, [&](uint64_t lo, uint64_t hi) {
    Checksum64 cs;
    cs.Update(data + lo, hi - lo);
    return cs;
  });
}

CheckpointWriter::CheckpointWriter(SlotStore* store, const WriterOptions& options)
    : store_(store),
      options_(options),
      pool_(options.copy_threads > 0 ? options.copy_threads : DefaultCopyThreads(), options.background) {}

absl::StatusOr<SaveStats> CheckpointWriter::Save(uint64_t step, const std::vector<EntryView>& views,
                                                 bool parallel) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Entry> entries;
  std::vector<const void*> sources;
  entries.reserve(views.size());
  sources.reserve(views.size());
  for (const EntryView& v : views) {
    if (v.data == nullptr && v.nbytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint entry '", v.key,
                                                     "' has no data pointer"));
    }
    entries.push_back(Entry{v.key, v.dtype, v.shape, 0, v.nbytes});
    sources.push_back(v.data);
  }
  ASSIGN_OR_RETURN(Layout layout, PlanLayout(&entries));
  ASSIGN_OR_RETURN(SlotWrite write, store_->BeginSave(step, layout.image_bytes, /*grow_others=*/true,
                                                      /*keep_newest=*/options_.background ? 2 : 1));
  // Order inside the slot does not matter for crash safety: the slot's seq is
  // odd until Commit, so no reader looks at these bytes before they are whole.
  uint8_t* image = write.image();
  const uint64_t data_checksum =
      CopyDataAndChecksum(image + layout.data_offset, layout.data_bytes, entries, sources, parallel ? &pool_ : nullptr,
                          options_.parallel_threshold_bytes, options_.chunk_bytes);
  if (options_.before_commit_for_test) options_.before_commit_for_test();
  WriteHeaderAndIndex(step, entries, layout, data_checksum, image);
  SaveStats stats;
  stats.step = step;
  stats.slot = write.slot();
  stats.image_bytes = layout.image_bytes;
  stats.data_checksum = data_checksum;
  if (absl::Status s = store_->Commit(&write, layout.image_bytes); !s.ok()) {
    store_->Abort(&write);
    return s;
  }
  stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

absl::StatusOr<uint64_t> CheckpointWriter::Reserve(const std::vector<EntryView>& views) {
  std::vector<Entry> entries;
  entries.reserve(views.size());
  for (const EntryView& v : views) entries.push_back(Entry{v.key, v.dtype, v.shape, 0, v.nbytes});
  ASSIGN_OR_RETURN(Layout layout, PlanLayout(&entries));
  (void)ReserveForImage(store_, layout.image_bytes);
  return layout.image_bytes;
}

bool ReserveForImage(SlotStore* store, uint64_t image_bytes) {
  // The slot the first save takes; that save grows the others in the
  // background (a save waits while any slot grows, so growing them all now
  // would only delay it). 64 KiB of slack: the real saves' metadata (step
  // numbers, small values) can come out a little bigger than the sized one.
  return store->Reserve(image_bytes + (64u << 10), 1);
}

absl::StatusOr<Snapshot> RestoreFromShm(SlotStore* store, const RestoreOptions& options) {
  absl::StatusOr<PinnedSlot> pinned =
      options.step.has_value() ? store->PinStep(*options.step) : store->PinLatest();
  if (!pinned.ok()) return pinned.status();
  // "replica:" marks a step the agent copied in from a peer node's replica.
  const std::string source =
      absl::StrCat(pinned->origin() == SlotOrigin::kReplica ? "replica:" : "", "shm:",
                   SlotStore::SlotName(store->name(), pinned->slot()));
  ParseOptions parse;
  parse.verify_data = false;  // verified below, in parallel
  parse.exact_size = true;
  ASSIGN_OR_RETURN(ParsedImage image,
                   ParseImage(pinned->image(), pinned->image_bytes(), source, parse));
  if (image.header.step != pinned->step()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", source, " holds step ",
                                            image.header.step, " but was committed as step ",
                                            pinned->step()));
  }
  if (options.verify_data &&
      ParallelChecksum(image.data, image.header.data_bytes, options.pool) !=
          image.header.data_checksum) {
    return absl::DataLossError(absl::StrCat("checkpoint ", source, " is corrupt: data checksum ",
                                            "mismatch; restore from disk instead"));
  }
  auto keep = std::make_shared<PinnedSlot>(std::move(*pinned));
  return Snapshot::Of(std::move(image), keep->image(), keep->image_bytes(), source,
                      std::shared_ptr<const void>(keep, keep.get()), options.verify_data);
}

}  // namespace ballast::ckpt
