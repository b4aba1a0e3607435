#include "ckpt/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "common/status_macros.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace ballast::ckpt {
namespace {

absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(
          absl::StrCat(msg, " (is /dev/shm large enough? raise its size, e.g. docker --shm-size)"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CheckName(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 200) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory name '", name, "' must be '/name' with no other '/'"));
  }
  return absl::OkStatus();
}

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

Mapping::~Mapping() {
  if (addr_ != nullptr && size_ != 0) munmap(addr_, size_);
}

ShmSegment::ShmSegment(std::string name, int fd, bool owner)
    : name_(std::move(name)), fd_(fd), owner_(owner), mapping_(std::make_shared<Mapping>(nullptr, 0)) {}

ShmSegment::~ShmSegment() {
  mapping_.reset();
  if (fd_ >= 0) close(fd_);
  if (owner_) shm_unlink(name_.c_str());
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(const std::string& name,
                                                               uint64_t bytes,
                                                               bool replace_existing) {
  RETURN_IF_ERROR(CheckName(name));
  if (replace_existing) shm_unlink(name.c_str());
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("shm_open(", name, ", O_CREAT)"));
  std::unique_ptr<ShmSegment> seg(new ShmSegment(name, fd, /*owner=*/true));
  RETURN_IF_ERROR(seg->EnsureCapacity(bytes, /*prefault=*/false));
  return seg;
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Open(const std::string& name) {
  RETURN_IF_ERROR(CheckName(name));
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("shm_open(", name, ")"));
  std::unique_ptr<ShmSegment> seg(new ShmSegment(name, fd, /*owner=*/false));
  RETURN_IF_ERROR(seg->Refresh(/*prefault=*/false));
  return seg;
}

absl::Status ShmSegment::Unlink(const std::string& name) {
  RETURN_IF_ERROR(CheckName(name));
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat("shm_unlink(", name, ")"));
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::MapSize(uint64_t size) {
  if (size == mapping_->size()) return absl::OkStatus();
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (addr == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mmap(", name_, ", ", size, ")"));
  // The old mapping is unmapped when its last holder lets go.
  mapping_ = std::make_shared<Mapping>(static_cast<uint8_t*>(addr), size);
  return absl::OkStatus();
}

absl::Status ShmSegment::EnsureCapacity(uint64_t bytes, bool prefault) {
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, absl::StrCat("fstat(", name_, ")"));
  uint64_t size = static_cast<uint64_t>(st.st_size);
  const uint64_t old_size = size;
  if (size < bytes) {
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      return ErrnoStatus(errno, absl::StrCat("ftruncate(", name_, ", ", bytes, ")"));
    }
    // Reserve the tmpfs pages now, so running out of /dev/shm is a clean
    // error here instead of a SIGBUS in the middle of a save. With prefault
    // the populate below allocates them (PopulateRange: fallocate on one
    // thread while the others populate what it allocated).
    if (!prefault) {
      int err = posix_fallocate(fd_, static_cast<off_t>(size), static_cast<off_t>(bytes - size));
      if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
        return ErrnoStatus(err, absl::StrCat("fallocate(", name_, ", ", bytes, ")"));
      }
    }
    size = bytes;
  }
  const uint64_t old = mapping_->size();
  RETURN_IF_ERROR(MapSize(size));
  if (prefault && size > old) {
    absl::Status s = PopulateRange(0, size, std::min(old_size, size));
    if (!s.ok() && size > old_size && old_size > 0) {
      // Keep no half-allocated growth behind (its pages would SIGBUS): map
      // the old size again and give the rest back; a later save retries.
      if (MapSize(old_size).ok()) (void)!ftruncate(fd_, static_cast<off_t>(old_size));
    }
    return s;
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::Refresh(bool prefault) {
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, absl::StrCat("fstat(", name_, ")"));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size <= mapping_->size()) return absl::OkStatus();
  RETURN_IF_ERROR(MapSize(size));
  if (prefault) return Prefault(0, size);
  return absl::OkStatus();
}

absl::Status ShmSegment::Prefault(uint64_t offset, uint64_t len) {
  const uint64_t size = mapping_->size();
  if (offset >= size || len == 0) return absl::OkStatus();
  len = std::min(len, size - offset);
  return PopulateRange(offset, offset + len, /*allocate_from=*/size);
}

absl::Status ShmSegment::PopulateRange(uint64_t offset, uint64_t end, uint64_t allocate_from) {
  const uint64_t page = PageSize();
  const uint64_t begin = offset / page * page;  // madvise rounds the length up to a page
  allocate_from = std::clamp(allocate_from / page * page, begin, end);
  uint8_t* base = mapping_->data();
  // In parallel: populating a fresh tmpfs range allocates and zeroes its
  // pages, which costs more than the checkpoint copy itself (about 1 s per
  // GiB on one thread).
  constexpr uint64_t kParallelBytes = 64u << 20;
  const int threads = end - begin >= kParallelBytes ? std::max(1, DefaultCopyThreads()) : 1;
  // Pages not allocated yet ([allocate_from, end)) are allocated with
  // fallocate, ahead of the populate: populating allocated pages only zeroes
  // and maps them, and the two together take a quarter less CPU than
  // populating unallocated pages (ckpt_microbench BM_FirstWrite modes 1 and
  // 3). fallocate runs under the file's lock, one call at a time, so with
  // threads to spare thread 0 allocates chunk by chunk while the others
  // populate the chunks it has allocated, then joins them. (Populating a
  // chunk that is not allocated yet would be correct too, only slower.)
  constexpr uint64_t kAllocChunk = 16u << 20;
  constexpr uint64_t kPopulateChunk = 4u << 20;
  std::atomic<uint64_t> allocated{allocate_from};  // [begin, allocated) is allocated
  std::atomic<bool> allocating{allocate_from < end};
  std::atomic<int> alloc_err{0};
  auto allocate = [&] {
    for (uint64_t lo = allocate_from; lo < end; lo += kAllocChunk) {
      const uint64_t hi = std::min(end, lo + kAllocChunk);
      const int err = posix_fallocate(fd_, static_cast<off_t>(lo), static_cast<off_t>(hi - lo));
      if (err == EOPNOTSUPP || err == EINVAL) break;  // not tmpfs: the populate allocates
      if (err != 0) {
        alloc_err = err;
        break;
      }
      allocated.store(hi, std::memory_order_release);
    }
    allocating.store(false, std::memory_order_release);
  };
  if (threads == 1 && allocate_from < end) allocate();
  std::atomic<uint64_t> next{begin};
  std::vector<int> errs(static_cast<size_t>(threads), 0);
  auto populate = [&](int i) {
    if (i == 0 && allocating.load()) allocate();
    while (alloc_err.load() == 0) {
      const uint64_t lo = next.fetch_add(kPopulateChunk);
      if (lo >= end) return;
      const uint64_t hi = std::min(end, lo + kPopulateChunk);
      while (allocating.load(std::memory_order_acquire) && allocated.load(std::memory_order_acquire) < hi) {
        std::this_thread::yield();
      }
      if (alloc_err.load() != 0) return;
      if (madvise(base + lo, hi - lo, MADV_POPULATE_WRITE) == 0) continue;
      if (errno != EINVAL) {
        errs[static_cast<size_t>(i)] = errno;
        return;
      }
      // Older kernel: touch one byte per page. An atomic add of 0 writes the
      // page (a write fault, so it is mapped writable) without changing data.
      for (uint64_t p = lo; p < hi; p += page) __atomic_fetch_add(base + p, static_cast<uint8_t>(0), __ATOMIC_RELAXED);
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(populate, i);
  populate(0);
  for (std::thread& t : pool) t.join();
  if (const int err = alloc_err.load(); err != 0) {
    return ErrnoStatus(err, absl::StrCat("fallocate(", name_, ", ", end, ")"));
  }
  for (int err : errs) {
    if (err == 0) continue;
    // EFAULT: a page could not be allocated (the access would SIGBUS): /dev/shm is full.
    return ErrnoStatus(err == EFAULT ? ENOSPC : err,
                       absl::StrCat("populating ", end - begin, " bytes of shared memory ", name_,
                                    err == EFAULT ? " (is /dev/shm full? see df -h /dev/shm)" : ""));
  }
  return absl::OkStatus();
}

}  // namespace ballast::ckpt
