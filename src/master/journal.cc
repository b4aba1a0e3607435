#include "master/journal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ckpt/checksum.h"
#include "common/status_macros.h"
#include "master/failure_log.h"
#include "master/node_table.h"
#include "spdlog/spdlog.h"

namespace ballast::master {
namespace {

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLE(std::string_view data, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(data[at + i])) << (8 * i);
  return v;
}

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open", dir);
  int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : Errno("cannot fsync", dir);
}

// Writes `data` to path via path.tmp: write, fsync, rename, fsync the dir.
absl::Status WriteFileDurably(const std::string& dir, const std::string& path, std::string_view data) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot create", tmp);
  absl::Status s = WriteAll(fd, data, tmp);
  if (s.ok() && ::fsync(fd) != 0) s = Errno("cannot fsync", tmp);
  ::close(fd);
  if (!s.ok()) return s;
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Errno("cannot rename into", path);
  return SyncDir(dir);
}

absl::StatusOr<std::string> ReadFile(const std::string& path, bool* exists) {
  *exists = std::filesystem::exists(path);
  if (!*exists) return std::string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::PermissionDeniedError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

template <typename T>
void KeepNewest(google::protobuf::RepeatedPtrField<T>* list, size_t max) {
  if (static_cast<size_t>(list->size()) > max) list->DeleteSubrange(0, list->size() - static_cast<int>(max));
}

}  // namespace

void ApplyJournalRecord(const v1::JournalRecord& r, v1::MasterSnapshot* s, CkptCommitTracker* ckpt) {
  s->set_last_seq(std::max(s->last_seq(), r.seq()));
  switch (r.kind_case()) {
    case v1::JournalRecord::kJob:
      *s->mutable_job() = r.job();
      break;
    case v1::JournalRecord::kNodeUp:
      if (r.node_up().node_id().empty()) break;
      // A re-join (an agent reconnecting) keeps its place in join order.
      if (s->nodes().count(r.node_up().node_id()) == 0) {
        (*s->mutable_joined_seq())[r.node_up().node_id()] = r.seq();
      }
      (*s->mutable_nodes())[r.node_up().node_id()] = r.node_up();
      break;
    case v1::JournalRecord::kNodeGone:
      s->mutable_nodes()->erase(r.node_gone().node_id());
      s->mutable_joined_seq()->erase(r.node_gone().node_id());
      *s->add_gone() = r.node_gone();
      KeepNewest(s->mutable_gone(), NodeTable::kMaxRemembered);
      break;
    case v1::JournalRecord::kRound: {
      // The rollback's own record (the first with its round and step): the
      // master dropped every commit from that step on just before writing
      // it, so replay drops them here, between the same shard records. Later
      // records of the same rollback drop nothing (the re-trained steps
      // committed since must stay).
      const v1::JournalRound& jr = r.round();
      if (jr.rolled_back_below() > 0 && (jr.rollback_round() != s->round().rollback_round() ||
                                         jr.rolled_back_below() != s->round().rolled_back_below())) {
        ckpt->Rewind(jr.rolled_back_below());
      }
      const bool new_round = r.round().round() != s->round().round();
      *s->mutable_round() = r.round();
      if (new_round) s->clear_done();
      // Held reports of an older round were decided (or made stale) by it.
      auto* held = s->mutable_held();
      for (int i = held->size() - 1; i >= 0; --i) {
        if (held->Get(i).report().round() != r.round().round()) held->DeleteSubrange(i, 1);
      }
      if (r.round().state() != "running") held->Clear();
      break;
    }
    case v1::JournalRecord::kNodeDone:
      if (r.node_done().round() == s->round().round()) *s->add_done() = r.node_done();
      break;
    case v1::JournalRecord::kKv:
      (*s->mutable_kv())[r.kv().key()] = r.kv().value();
      break;
    case v1::JournalRecord::kShard: {
      const v1::ShardDurableReport& sh = r.shard();
      if (sh.dir().empty() || sh.world_size() < 1 || sh.rank() < 0 || sh.rank() >= sh.world_size()) break;
      ckpt->Report(sh.dir(), sh.step(), sh.rank(), sh.world_size());
      break;
    }
    case v1::JournalRecord::kFailure: {
      // A resumed record completes the open one it was written as.
      const v1::FailureRecord& f = r.failure();
      if (f.resumed()) {
        auto* list = s->mutable_failures();
        for (int i = list->size() - 1; i >= 0; --i) {
          v1::FailureRecord* old = list->Mutable(i);
          if (old->round() == f.round() && old->node_id() == f.node_id() && old->at_s() == f.at_s()) {
            *old = f;
            break;
          }
        }
        break;
      }
      *s->add_failures() = f;
      KeepNewest(s->mutable_failures(), FailureLog::kMaxRecords);
      s->set_failures_total(s->failures_total() + 1);
      break;
    }
    case v1::JournalRecord::kFailureHeld:
      if (r.failure_held().report().round() == s->round().round()) *s->add_held() = r.failure_held();
      break;
    case v1::JournalRecord::kExcluded:
      (*s->mutable_excluded())[r.excluded().node_id()] = r.excluded().reason();
      break;
    case v1::JournalRecord::kPassed:
      (*s->mutable_passed())[r.passed().node_id()] = r.passed().check_time_s();
      break;
    case v1::JournalRecord::kGoodput:
      *s->mutable_goodput() = r.goodput();
      break;
    case v1::JournalRecord::kSchedulerLost:
      (*s->mutable_scheduler_lost())[r.scheduler_lost().node_id()] = r.scheduler_lost().reason();
      break;
    case v1::JournalRecord::KIND_NOT_SET:
      break;
  }
}

std::string FrameJournalRecord(const v1::JournalRecord& record) {
  std::string payload;
  record.SerializeToString(&payload);
  std::string out;
  out.reserve(payload.size() + 12);
  PutU32(&out, static_cast<uint32_t>(payload.size()));
  PutU64(&out, ckpt::ChecksumBytes(payload.data(), payload.size()));
  out += payload;
  return out;
}

ParsedJournal ParseJournalRecords(std::string_view data) {
  ParsedJournal p;
  size_t at = 0;
  while (at < data.size()) {
    if (data.size() - at < 12) {
      p.tail_error = absl::StrCat("a record header cut short (", data.size() - at, " bytes)");
      break;
    }
    const uint64_t len = GetLE(data, at, 4);
    const uint64_t sum = GetLE(data, at + 4, 8);
    if (len > kMaxJournalRecordBytes) {
      p.tail_error = absl::StrCat("a record length of ", len, " bytes (corrupt header)");
      break;
    }
    if (data.size() - at - 12 < len) {
      p.tail_error = absl::StrCat("a record of ", len, " bytes cut short at ", data.size() - at - 12);
      break;
    }
    std::string_view payload = data.substr(at + 12, len);
    if (ckpt::ChecksumBytes(payload.data(), payload.size()) != sum) {
      p.tail_error = "a record whose checksum does not match (corrupt)";
      break;
    }
    v1::JournalRecord r;
    if (!r.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      p.tail_error = "a record that does not parse";
      break;
    }
    p.records.push_back(std::move(r));
    at += 12 + len;
    p.good_bytes = at;
  }
  return p;
}

Journal::~Journal() {
  if (fd_ >= 0) ::close(fd_);
}

std::string Journal::LogPath() const { return options_.dir + "/journal.log"; }
std::string Journal::SnapshotPath() const { return options_.dir + "/snapshot.pb"; }

absl::StatusOr<std::unique_ptr<Journal>> Journal::Open(Options options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("--journal needs a directory");
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create the journal directory ", options.dir, ": ",
                                                   ec.message(), " (pass a writable --journal DIR)"));
  }
  std::unique_ptr<Journal> j(new Journal(std::move(options)));
  if (absl::Status s = j->Recover(); !s.ok()) return s;
  return j;
}

absl::Status Journal::Recover() {
  bool exists = false;
  absl::StatusOr<std::string> snap = ReadFile(SnapshotPath(), &exists);
  if (!snap.ok()) return snap.status();
  if (exists) {
    const std::string& d = *snap;
    const std::string bad = absl::StrCat(
        "the journal snapshot ", SnapshotPath(), " is corrupt (");
    const std::string fix =
        "): the master cannot resume the job from it. Restore the file from a backup, or move the "
        "directory away to start the job afresh (its state is then lost)";
    if (d.size() < kSnapshotMagic.size() + 16 || std::string_view(d).substr(0, kSnapshotMagic.size()) != kSnapshotMagic) {
      return absl::DataLossError(absl::StrCat(bad, "no snapshot header", fix));
    }
    const uint64_t len = GetLE(d, kSnapshotMagic.size(), 8);
    const uint64_t sum = GetLE(d, kSnapshotMagic.size() + 8, 8);
    const size_t at = kSnapshotMagic.size() + 16;
    if (d.size() - at != len) {
      return absl::DataLossError(absl::StrCat(bad, d.size() - at, " bytes where the header says ", len, fix));
    }
    if (ckpt::ChecksumBytes(d.data() + at, len) != sum) {
      return absl::DataLossError(absl::StrCat(bad, "checksum mismatch", fix));
    }
    if (!state_.ParseFromArray(d.data() + at, static_cast<int>(len))) {
      return absl::DataLossError(absl::StrCat(bad, "it does not parse", fix));
    }
    ckpt_.FromProto(state_.ckpt_dirs());
    state_.clear_ckpt_dirs();
  }
  absl::StatusOr<std::string> log = ReadFile(LogPath(), &exists);
  if (!log.ok()) return log.status();
  size_t replayed = 0;
  std::string note;
  if (exists && !log->empty()) {
    std::string_view data = *log;
    size_t keep = 0;
    if (data.substr(0, kJournalMagic.size()) != kJournalMagic) {
      note = absl::StrCat("; ", LogPath(), " has no journal header: its ", data.size(), " bytes are cut off");
    } else {
      ParsedJournal p = ParseJournalRecords(data.substr(kJournalMagic.size()));
      for (const auto& r : p.records) {
        if (r.seq() <= state_.last_seq() && state_.last_seq() != 0) continue;  // in the snapshot
        ApplyJournalRecord(r, &state_, &ckpt_);
        ++replayed;
      }
      keep = kJournalMagic.size() + p.good_bytes;
      if (!p.tail_error.empty()) {
        note = absl::StrCat("; cut off ", data.size() - keep, " bytes at the end of ", LogPath(), " after ",
                            p.tail_error, " (a crash mid-write)");
      }
    }
    if (keep < data.size()) {
      spdlog::warn("journal {}: the last good record ends at byte {}{}", options_.dir, keep, note);
      if (::truncate(LogPath().c_str(), static_cast<off_t>(keep)) != 0) return Errno("cannot truncate", LogPath());
    }
    log_bytes_ = keep;
  }
  recovered_ = state_.has_job();
  recovery_note_ = absl::StrCat(exists ? "replayed " : "new journal: ", exists ? absl::StrCat(replayed, " records") : "",
                                state_.last_seq() > 0 ? absl::StrCat(" (last seq ", state_.last_seq(), ")") : "", note);
  return OpenLogForAppend();
}

absl::Status Journal::OpenLogForAppend() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = ::open(LogPath().c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd_ < 0) return Errno("cannot open the journal", LogPath());
  if (log_bytes_ == 0) {
    if (::ftruncate(fd_, 0) != 0) return Errno("cannot truncate", LogPath());
    if (absl::Status s = WriteAll(fd_, kJournalMagic, LogPath()); !s.ok()) return s;
    if (::fdatasync(fd_) != 0) return Errno("cannot sync", LogPath());
    log_bytes_ = kJournalMagic.size();
    if (absl::Status s = SyncDir(options_.dir); !s.ok()) return s;
  }
  return absl::OkStatus();
}

v1::MasterSnapshot Journal::state() const {
  v1::MasterSnapshot s = state_;
  for (v1::CkptDirState& d : ckpt_.ToProto()) *s.add_ckpt_dirs() = std::move(d);
  return s;
}

absl::Status Journal::Append(v1::JournalRecord record, bool sync) {
  record.set_seq(state_.last_seq() + 1);
  ApplyJournalRecord(record, &state_, &ckpt_);
  std::string framed = FrameJournalRecord(record);
  if (absl::Status s = WriteAll(fd_, framed, LogPath()); !s.ok()) return s;
  log_bytes_ += framed.size();
  ++records_written_;
  if (sync && ::fdatasync(fd_) != 0) return Errno("cannot sync", LogPath());
  if (log_bytes_ >= options_.compact_bytes) return Compact();
  return absl::OkStatus();
}

absl::Status Journal::WriteSnapshot(const v1::MasterSnapshot& snapshot) {
  std::string payload;
  snapshot.SerializeToString(&payload);
  std::string file(kSnapshotMagic);
  PutU64(&file, payload.size());
  PutU64(&file, ckpt::ChecksumBytes(payload.data(), payload.size()));
  file += payload;
  if (absl::Status s = WriteFileDurably(options_.dir, SnapshotPath(), file); !s.ok()) return s;
  // The snapshot holds every record: start an empty log (the header alone).
  if (absl::Status s = WriteFileDurably(options_.dir, LogPath(), kJournalMagic); !s.ok()) return s;
  log_bytes_ = kJournalMagic.size();
  spdlog::info("journal {}: a snapshot of {} bytes (seq {})", options_.dir, file.size(), snapshot.last_seq());
  return absl::OkStatus();
}

absl::Status Journal::Compact() {
  if (absl::Status s = WriteSnapshot(state()); !s.ok()) return s;
  return OpenLogForAppend();
}

absl::StatusOr<bool> Journal::Seed(const std::string& dir, const v1::MasterSnapshot& snapshot) {
  ASSIGN_OR_RETURN(std::unique_ptr<Journal> j, Open(Options{dir}));
  if (j->recovered()) return false;
  if (!snapshot.has_job()) return absl::InvalidArgumentError("the snapshot to seed the journal with holds no job");
  if (j->fd_ >= 0) {
    ::close(j->fd_);
    j->fd_ = -1;
  }
  RETURN_IF_ERROR(j->WriteSnapshot(snapshot));
  return true;
}

}  // namespace ballast::master
