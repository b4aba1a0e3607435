#include "ckpt/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
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
  if (size < bytes) {
    // posix_fallocate reserves the tmpfs pages now, so running out of /dev/shm
    // is a clean error here instead of a SIGBUS in the middle of a save.
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      return ErrnoStatus(errno, absl::StrCat("ftruncate(", name_, ", ", bytes, ")"));
    }
    int err = posix_fallocate(fd_, static_cast<off_t>(size), static_cast<off_t>(bytes - size));
    if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
      return ErrnoStatus(err, absl::StrCat("fallocate(", name_, ", ", bytes, ")"));
    }
    size = bytes;
  }
  const uint64_t old = mapping_->size();
  RETURN_IF_ERROR(MapSize(size));
  if (prefault && size > old) return Prefault(0, size);
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
  const uint64_t page = PageSize();
  uint64_t begin = offset / page * page;
  const uint64_t end = offset + len;  // madvise rounds the length up to a page
  uint8_t* base = mapping_->data();
  if (madvise(base + begin, end - begin, MADV_POPULATE_WRITE) == 0) {
    return absl::OkStatus();
  }
  // Older kernel (EINVAL): touch one byte per page. An atomic add of 0 writes
  // the page (a write fault, so it is mapped writable) without changing data.
  for (uint64_t p = begin; p < end; p += page) {
    __atomic_fetch_add(base + p, static_cast<uint8_t>(0), __ATOMIC_RELAXED);
  }
  return absl::OkStatus();
}

}  // namespace ballast::ckpt
