// ShmSegment: one POSIX shared-memory object (shm_open, i.e. a file under
// /dev/shm) mapped into this process.
//
// Ownership: the creator (the agent, so the memory survives a worker's death)
// owns the name and unlinks it when destroyed; other processes Open() it. The
// object only ever grows (EnsureCapacity: ftruncate + remap), so a stale, smaller
// mapping in another process stays valid; that process calls Refresh() when it
// learns of a larger size.
//
// Mappings are reference counted (Mapping): a remap creates a new Mapping and
// the old one is unmapped only when the last holder (e.g. a pinned slot being
// persisted by another thread) drops it.
//
// Growth allocates the new pages with fallocate first (a full /dev/shm is a
// clean error, and populating allocated pages is cheaper than allocating them
// from the fault path); with prefault, one thread allocates while the others
// populate behind it.
//
// Pre-faulting: first-touch page faults make a cold copy 10-50x slower, so
// Prefault() populates the page tables with MADV_POPULATE_WRITE (Linux 5.14+)
// and falls back to touching one byte per page with an atomic add of 0 (safe
// even if another process writes the page concurrently). Each process that
// maps the object must prefault its own mapping.
//
// Thread safety: not thread-safe; the owner (SlotStore) serializes calls.
// Mapping objects are immutable and may be shared across threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast::ckpt {

// An mmap'ed range; unmapped on destruction.
class Mapping {
 public:
  Mapping(uint8_t* addr, uint64_t size) : addr_(addr), size_(size) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint8_t* data() const { return addr_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* addr_;
  uint64_t size_;
};

class ShmSegment {
 public:
  // Creates `name` ("/something", no other '/') with `bytes` capacity and maps
  // it. With replace_existing, a stale object of that name (left by a crashed
  // creator) is unlinked first; otherwise an existing one is kAlreadyExists.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(const std::string& name, uint64_t bytes,
                                                            bool replace_existing);
  // Opens and maps an existing object (kNotFound if there is none).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(const std::string& name);
  // Removes the name; existing mappings stay valid. OK if it does not exist.
  static absl::Status Unlink(const std::string& name);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Grows the object to at least `bytes` (never shrinks) and remaps. With
  // prefault, the newly mapped tail is prefaulted.
  absl::Status EnsureCapacity(uint64_t bytes, bool prefault);
  // Remaps if the object grew (another process called EnsureCapacity).
  absl::Status Refresh(bool prefault);
  // Populates page tables for [offset, offset + len) of the current mapping.
  absl::Status Prefault(uint64_t offset, uint64_t len);

  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }
  // The current mapping (never null; size 0 for an empty object).
  const std::shared_ptr<Mapping>& mapping() const { return mapping_; }
  uint8_t* data() const { return mapping_->data(); }
  uint64_t size() const { return mapping_->size(); }

 private:
  ShmSegment(std::string name, int fd, bool owner);
  absl::Status MapSize(uint64_t size);
  // Populates [offset, end) of the current mapping, allocating the pages of
  // [allocate_from, end) with fallocate first (see EnsureCapacity).
  absl::Status PopulateRange(uint64_t offset, uint64_t end, uint64_t allocate_from);

  std::string name_;
  int fd_ = -1;
  bool owner_ = false;
  std::shared_ptr<Mapping> mapping_;
};

}  // namespace ballast::ckpt
