#include "ckpt/reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/format.h"
#include "ckpt/shm_segment.h"
#include "common/status_macros.h"

namespace ballast::ckpt {

std::string StepDir(const std::string& dir, uint64_t step) {
  return absl::StrCat(dir, "/step-", step);
}

std::string ShardPath(const std::string& dir, uint64_t step, int rank) {
  return absl::StrCat(StepDir(dir, step), "/rank-", rank, ".ballast");
}

std::string LatestPath(const std::string& dir) { return absl::StrCat(dir, "/latest"); }

absl::StatusOr<Snapshot> ReadCheckpointFile(const std::string& path, const ReadOptions& options) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string msg = absl::StrCat("cannot open checkpoint ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == EACCES) return absl::PermissionDeniedError(msg);
    return absl::UnavailableError(msg);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot stat checkpoint ", path, ": ",
                                               std::strerror(err)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  std::shared_ptr<Mapping> mapping;
  if (size > 0) {
    void* addr = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat("cannot map checkpoint ", path, ": ",
                                                 std::strerror(err)));
    }
    madvise(addr, size, MADV_SEQUENTIAL);
    mapping = std::make_shared<Mapping>(static_cast<uint8_t*>(addr), size);
  }
  close(fd);  // the mapping stays valid
  static const uint8_t kEmpty[1] = {0};
  const uint8_t* bytes = mapping ? mapping->data() : kEmpty;
  ParseOptions parse;
  parse.verify_data = options.verify_data;
  parse.exact_size = true;
  ASSIGN_OR_RETURN(ParsedImage image, ParseImage(bytes, size, path, parse));
  return Snapshot::Of(std::move(image), bytes, size, path, std::shared_ptr<const void>(mapping, mapping.get()),
                      options.verify_data);
}

absl::StatusOr<uint64_t> ReadLatestStep(const std::string& dir) {
  const std::string path = LatestPath(dir);
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", dir, " (", path,
                                            " does not exist)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  uint64_t step = 0;
  if (text.size() > 32 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &step)) {
    return absl::DataLossError(absl::StrCat(path, " is corrupt (expected a step number, found '",
                                            absl::CHexEscape(text.substr(0, 32)),
                                            "'); delete it or write the last good step into it"));
  }
  return step;
}

absl::StatusOr<Snapshot> ReadLatest(const std::string& dir, int rank, const ReadOptions& options) {
  ASSIGN_OR_RETURN(uint64_t step, ReadLatestStep(dir));
  absl::StatusOr<Snapshot> snap = ReadCheckpointFile(ShardPath(dir, step, rank), options);
  if (snap.ok() && snap->step() != step) {
    return absl::DataLossError(absl::StrCat("checkpoint ", ShardPath(dir, step, rank),
                                            " holds step ", snap->step(), " instead of ", step));
  }
  if (absl::IsNotFound(snap.status())) {
    return absl::NotFoundError(absl::StrCat(
        snap.status().message(), "; ", LatestPath(dir), " names step ", step,
        " but rank ", rank, " has no shard there (was the job run with a different world size?)"));
  }
  return snap;
}

}  // namespace ballast::ckpt
