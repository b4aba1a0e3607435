#include "ckpt/persister.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/format.h"
#include "ckpt/reader.h"
#include "common/status_macros.h"

namespace ballast::ckpt {
namespace {

namespace fs = std::filesystem;

constexpr char kCompleteMarker[] = "COMPLETE";
constexpr char kLockFile[] = ".commit.lock";

absl::Status IoError(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) {
    return absl::ResourceExhaustedError(absl::StrCat(msg, " (checkpoint disk is full)"));
  }
  if (err == EACCES || err == EPERM || err == EROFS) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

// A directory entry is durable only once its directory is fsync'ed.
absl::Status FsyncDir(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, absl::StrCat("open directory ", dir));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0 && err != EINVAL) return IoError(err, absl::StrCat("fsync directory ", dir));
  return absl::OkStatus();
}

// mkdir -p; fsyncs the parent of every directory it creates.
absl::Status MakeDirs(const std::string& path) {
  if (fs::is_directory(path)) return absl::OkStatus();
  const fs::path p(path);
  if (p.has_parent_path() && p.parent_path() != p) RETURN_IF_ERROR(MakeDirs(p.parent_path()));
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    return IoError(errno, absl::StrCat("create directory ", path));
  }
  return FsyncDir(p.has_parent_path() ? p.parent_path().string() : ".");
}

absl::Status WriteAll(int fd, const uint8_t* data, uint64_t n, const std::string& path,
                      const ShardWriteOptions* options) {
  uint64_t done = 0;
  const uint64_t chunk = options != nullptr ? std::max<uint64_t>(options->chunk_bytes, 4096) : n;
  while (done < n) {
    const uint64_t want = std::min(chunk, n - done);
    uint64_t chunk_done = 0;
    while (chunk_done < want) {
      ssize_t w = write(fd, data + done + chunk_done, want - chunk_done);
      if (w < 0) {
        if (errno == EINTR) continue;
        return IoError(errno, absl::StrCat("write ", path));
      }
      chunk_done += static_cast<uint64_t>(w);
    }
    done += want;
    if (options != nullptr && options->after_chunk_for_test) options->after_chunk_for_test(done);
  }
  return absl::OkStatus();
}

// Writes `n` bytes to `tmp`, fsyncs them, renames `tmp` to `path` and fsyncs
// the directory: after a crash `path` holds either the old content or the
// new, never a mix or a renamed but empty file, and the rename is durable
// before this returns (nobody counts the file before that).
absl::Status WriteDurably(const std::string& path, const std::string& tmp, const uint8_t* data, uint64_t n,
                          const ShardWriteOptions* options) {
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(errno, absl::StrCat("create ", tmp));
  absl::Status s = WriteAll(fd, data, n, tmp, options);
  if (s.ok() && fsync(fd) != 0) s = IoError(errno, absl::StrCat("fsync ", tmp));
  close(fd);
  if (s.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    s = IoError(errno, absl::StrCat("rename ", tmp, " -> ", path));
  }
  if (!s.ok()) {
    unlink(tmp.c_str());
    return s;
  }
  return FsyncDir(fs::path(path).parent_path().string());
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view content) {
  return WriteDurably(path, absl::StrCat(path, ".tmp.", getpid()), reinterpret_cast<const uint8_t*>(content.data()),
                      content.size(), nullptr);
}

std::optional<uint64_t> ParseStepDirName(const std::string& name) {
  const std::string kPrefix = "step-";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) {
    return std::nullopt;
  }
  const std::string digits = name.substr(kPrefix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  uint64_t step = 0;
  if (!absl::SimpleAtoi(digits, &step)) return std::nullopt;
  return step;
}

// Holds flock(<dir>/.commit.lock) for its lifetime.
class CommitLock {
 public:
  static absl::StatusOr<std::unique_ptr<CommitLock>> Acquire(const std::string& dir) {
    const std::string path = absl::StrCat(dir, "/", kLockFile);
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return IoError(errno, absl::StrCat("open ", path));
    while (flock(fd, LOCK_EX) != 0) {
      if (errno != EINTR) {
        const int err = errno;
        close(fd);
        return IoError(err, absl::StrCat("flock ", path));
      }
    }
    return std::unique_ptr<CommitLock>(new CommitLock(fd));
  }
  ~CommitLock() { close(fd_); }  // releases the flock

 private:
  explicit CommitLock(int fd) : fd_(fd) {}
  int fd_;
};

absl::Status ApplyRetentionLocked(const std::string& dir, int keep_last) {
  absl::StatusOr<uint64_t> latest = ReadLatestStep(dir);
  if (!latest.ok()) return absl::IsNotFound(latest.status()) ? absl::OkStatus() : latest.status();
  std::vector<uint64_t> complete = ListCompleteSteps(dir);
  complete.erase(std::remove_if(complete.begin(), complete.end(),
                                [&](uint64_t s) { return s > *latest; }),
                 complete.end());
  std::sort(complete.rbegin(), complete.rend());
  const size_t keep = static_cast<size_t>(std::max(keep_last, 1));
  if (complete.size() > keep) complete.resize(keep);
  const uint64_t cutoff = complete.empty() ? *latest : complete.back();
  for (uint64_t step : ListSteps(dir)) {
    if (step >= *latest) continue;  // latest itself and in-progress newer steps stay
    const bool kept = std::find(complete.begin(), complete.end(), step) != complete.end();
    if (kept && step >= cutoff) continue;
    // Older than the K newest complete steps, or an incomplete step that the
    // newer complete `latest` superseded (no rank writes it any more).
    std::error_code ec;
    fs::remove_all(StepDir(dir, step), ec);
    if (ec) {
      return absl::UnavailableError(absl::StrCat("delete old checkpoint ", StepDir(dir, step),
                                                 ": ", ec.message()));
    }
  }
  return FsyncDir(dir);
}

}  // namespace

absl::Status WriteShardFile(const std::string& dir, uint64_t step, int rank, const uint8_t* image,
                            uint64_t bytes, const ShardWriteOptions& options) {
  const std::string step_dir = StepDir(dir, step);
  RETURN_IF_ERROR(MakeDirs(step_dir));
  const std::string path = ShardPath(dir, step, rank);
  return WriteDurably(path, path + ".tmp", image, bytes, &options);
}

bool AllShardsDurable(const std::string& dir, uint64_t step, int world_size) {
  for (int r = 0; r < world_size; ++r) {
    struct stat st;
    if (stat(ShardPath(dir, step, r).c_str(), &st) != 0) return false;
  }
  return world_size > 0;
}

std::vector<uint64_t> ListSteps(const std::string& dir) {
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    if (!de.is_directory(ec)) continue;
    if (auto step = ParseStepDirName(de.path().filename().string())) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::vector<uint64_t> ListCompleteSteps(const std::string& dir) {
  std::vector<uint64_t> out;
  for (uint64_t step : ListSteps(dir)) {
    std::error_code ec;
    if (fs::exists(absl::StrCat(StepDir(dir, step), "/", kCompleteMarker), ec)) out.push_back(step);
  }
  return out;
}

absl::Status ApplyRetention(const std::string& dir, int keep_last) {
  ASSIGN_OR_RETURN(auto lock, CommitLock::Acquire(dir));
  return ApplyRetentionLocked(dir, keep_last);
}

absl::Status CommitStep(const std::string& dir, uint64_t step, int world_size, int keep_last) {
  if (!AllShardsDurable(dir, step, world_size)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot commit step ", step, " in ", dir, ": not all ", world_size, " shards are durable"));
  }
  ASSIGN_OR_RETURN(auto lock, CommitLock::Acquire(dir));
  // 0. The step may have been committed before by a larger world (a job that
  //    scaled down and redid the step): its shards of ranks >= world_size
  //    belong to that other history, and a later load by a larger world must
  //    not read them as this step's. They go before the marker says who
  //    saved the step.
  const std::string marker = absl::StrCat(StepDir(dir, step), "/", kCompleteMarker);
  const std::string want = absl::StrCat("world_size=", world_size, "\n");
  std::string have;
  if (std::ifstream in(marker); in) have.assign(std::istreambuf_iterator<char>(in), {});
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(StepDir(dir, step), ec)) {
    int rank = -1;
    const std::string name = de.path().filename().string();
    if (absl::StartsWith(name, "rank-") && absl::EndsWith(name, ".ballast") &&
        absl::SimpleAtoi(name.substr(5, name.size() - 5 - 8), &rank) && rank >= world_size) {
      fs::remove(de.path(), ec);
    }
  }
  // 1. COMPLETE marker (durable) before `latest` may name the step, so
  //    retention never counts a step as complete that `latest` did not reach.
  if (have != want) RETURN_IF_ERROR(WriteFileAtomically(marker, want));
  // 2. Move `latest` forward only.
  absl::StatusOr<uint64_t> latest = ReadLatestStep(dir);
  if (!latest.ok() || *latest < step) {
    RETURN_IF_ERROR(WriteFileAtomically(LatestPath(dir), absl::StrCat(step, "\n")));
  }
  // 3. Only now may older steps go.
  return ApplyRetentionLocked(dir, keep_last);
}

absl::StatusOr<std::vector<uint64_t>> RewindSteps(const std::string& dir, uint64_t below) {
  std::vector<uint64_t> deleted;
  if (!fs::is_directory(dir)) return deleted;
  ASSIGN_OR_RETURN(auto lock, CommitLock::Acquire(dir));
  std::error_code ec;
  for (uint64_t step : ListSteps(dir)) {
    if (step < below) continue;
    const std::string sdir = StepDir(dir, step);
    fs::remove(absl::StrCat(sdir, "/", kCompleteMarker), ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      return IoError(ec.value(), absl::StrCat("remove ", sdir, "/", kCompleteMarker));
    }
    fs::remove_all(sdir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) return IoError(ec.value(), absl::StrCat("remove ", sdir));
    deleted.push_back(step);
  }
  absl::StatusOr<uint64_t> latest = ReadLatestStep(dir);
  if (latest.ok() && *latest >= below) {
    std::vector<uint64_t> complete = ListCompleteSteps(dir);
    if (complete.empty()) {
      fs::remove(LatestPath(dir), ec);
    } else {
      RETURN_IF_ERROR(WriteFileAtomically(LatestPath(dir), absl::StrCat(complete.back(), "\n")));
    }
  }
  return deleted;
}

absl::StatusOr<bool> LocalCommitCoordinator::OnShardDurable(uint64_t step, int rank) {
  if (!AllShardsDurable(dir_, step, world_size_)) return false;
  RETURN_IF_ERROR(CommitStep(dir_, step, world_size_, keep_last_));
  return true;
}

Persister::Persister(SlotStore* store, CommitCoordinatorInterface* coordinator,
                     PersisterOptions options)
    : store_(store), coordinator_(coordinator), options_(std::move(options)) {}

absl::StatusOr<PersistResult> Persister::Persist(std::optional<uint64_t> limit) {
  // The pin keeps the writer off this slot while we write it, without a copy.
  absl::StatusOr<PinnedSlot> pinned = limit.has_value() ? store_->PinNewestAtMost(*limit) : store_->PinLatest();
  if (limit.has_value() && absl::IsNotFound(pinned.status())) pinned = store_->PinLatest();  // overwritten: newer
  ASSIGN_OR_RETURN(PinnedSlot pin, std::move(pinned));
  PersistResult result;
  result.step = pin.step();
  if (last_durable_.has_value() && pin.step() <= *last_durable_) return result;
  const std::string source = absl::StrCat("shm:", SlotStore::SlotName(store_->name(), pin.slot()));
  // Header and index only: the data checksum travels in the header and is
  // verified by whoever reads the file.
  ParseOptions parse;
  parse.verify_data = false;
  ASSIGN_OR_RETURN(ParsedImage image, ParseImage(pin.image(), pin.image_bytes(), source, parse));
  RETURN_IF_ERROR(WriteShardFile(options_.dir, pin.step(), options_.rank, pin.image(),
                                 pin.image_bytes(), options_.write));
  pin.Release();
  last_durable_ = result.step;
  result.written = true;
  result.bytes = image.header.image_bytes();
  if (coordinator_ != nullptr) {
    ASSIGN_OR_RETURN(result.committed, coordinator_->OnShardDurable(result.step, options_.rank));
  }
  return result;
}

AsyncPersister::AsyncPersister(Persister* persister)
    : persister_(persister), thread_([this] { Loop(); }) {}

AsyncPersister::~AsyncPersister() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void AsyncPersister::Request(uint64_t step) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!requested_.has_value() || *requested_ < step) requested_ = step;
  }
  cv_.notify_all();
}

void AsyncPersister::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || requested_.has_value(); });
    if (!requested_.has_value()) return;  // stop_ with nothing pending
    const uint64_t want = *requested_;
    lock.unlock();
    absl::StatusOr<PersistResult> r = persister_->Persist(want);
    lock.lock();
    ++attempts_;
    if (r.ok()) {
      if (!durable_.has_value() || *durable_ < r->step) durable_ = r->step;
      last_error_ = absl::OkStatus();
    } else {
      last_error_ = r.status();
    }
    // Done with this request unless a newer one arrived meanwhile.
    if (requested_.has_value() && *requested_ == want) requested_.reset();
    if (r.ok() && requested_.has_value() && *requested_ <= r->step) requested_.reset();
    cv_.notify_all();
  }
}

absl::Status AsyncPersister::WaitDurable(uint64_t step, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [&] {
    if (durable_.has_value() && *durable_ >= step) return true;
    return !requested_.has_value() && !last_error_.ok();
  };
  if (timeout_s < 0) {
    cv_.wait(lock, done);
  } else if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), done)) {
    return absl::DeadlineExceededError(
        absl::StrCat("step ", step, " not durable after ", timeout_s, " s"));
  }
  if (durable_.has_value() && *durable_ >= step) return absl::OkStatus();
  return last_error_;
}

}  // namespace ballast::ckpt
