// Restore after a node loss, from a peer's in-memory replica vs from disk, at
// one rank's state (default 1 GiB). Not a test: run it by hand.
//
//   build/bin/replica_bench [--mb 1024] [--trials 3] [--dir DIR]
//
// Each path ends with the rank's tensors filled and verified, the way a
// worker's Checkpointer.load(into=...) leaves them (one fused copy+checksum
// pass into buffers that already exist):
//   replica: the replacement's agent copies the replica over TCP (loopback
//            here) into its own shared-memory store, then the copy out;
//   disk:    the shard file read with the page cache dropped for it
//            (posix_fadvise DONTNEED after an fsync; a fresh node has never
//            read it), then the copy out; also with the file cached.
// Also reports what sending the replica costs the source node (in the
// background of training).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/replica.h"
#include "ckpt/checkpoint.h"
#include "ckpt/copy_pool.h"
#include "ckpt/format.h"
#include "ckpt/persister.h"
#include "ckpt/reader.h"

namespace ballast::agent {
namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A one-tensor image of `bytes` data bytes, as a save writes it.
std::vector<uint8_t> MakeImage(uint64_t step, uint64_t bytes) {
  std::vector<uint8_t> data(bytes);
  for (uint64_t i = 0; i < bytes; i += 8) data[i] = static_cast<uint8_t>(i >> 12);
  std::vector<ckpt::Entry> entries = {
      ckpt::Entry{"w", ckpt::DType::kUInt8, {static_cast<int64_t>(bytes)}, 0, bytes}};
  ckpt::Layout layout = *ckpt::PlanLayout(&entries);
  std::vector<uint8_t> image(layout.image_bytes);
  std::vector<const void*> sources = {data.data()};
  uint64_t sum = ckpt::CopyDataAndChecksum(image.data() + layout.data_offset, layout.data_bytes, entries, sources,
                                           nullptr, 0, 0);
  ckpt::WriteHeaderAndIndex(step, entries, layout, sum, image.data());
  return image;
}

// The worker's verified load into existing tensors: one copy+checksum pass.
bool CopyOut(const ckpt::Snapshot& snap, uint8_t* dst, ckpt::CopyPool* pool) {
  const ckpt::Entry& e = snap.entries()[0];
  std::vector<ckpt::Extract> ex = {{e.offset, e.nbytes, dst}};
  return ckpt::CopyOutAndChecksum(snap.Data(e) - e.offset, snap.data_bytes(), ex, pool) == snap.data_checksum();
}

int Main(int argc, char** argv) {
  uint64_t mb = 1024;
  int trials = 3;
  std::string dir = "/var/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i];
    if (f == "--mb") mb = std::strtoull(argv[i + 1], nullptr, 10);
    else if (f == "--trials") trials = std::atoi(argv[i + 1]);
    else if (f == "--dir") dir = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: replica_bench [--mb N] [--trials N] [--dir DIR]\n");
      return 2;
    }
  }
  const uint64_t bytes = mb << 20;
  const std::string tag = absl::StrCat("/ballast-bench-", getpid());
  std::printf("replica_bench: %llu MiB per rank, %d trials, disk in %s\n", static_cast<unsigned long long>(mb),
              trials, dir.c_str());
  std::vector<uint8_t> image = MakeImage(1, bytes);
  std::vector<uint8_t> tensor(bytes, 1);  // the model's existing tensor (faulted in)
  ckpt::CopyPool pool(static_cast<int>(std::max(1L, std::min(8L, sysconf(_SC_NPROCESSORS_ONLN)))));

  auto server = ReplicaServer::Start(tag + "-holder", "t");
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string addr = absl::StrCat("127.0.0.1:", (*server)->port());
  std::vector<double> put, rep, rep_fetch, disk_cold, disk_warm;
  for (int t = 0; t < trials; ++t) {
    double t0 = Now();
    if (absl::Status s = PutReplica(addr, "t", 0, 1, 1, image.data(), image.size(), 120); !s.ok()) {
      std::fprintf(stderr, "put: %s\n", s.ToString().c_str());
      return 1;
    }
    put.push_back(Now() - t0);

    auto store = ckpt::SlotStore::Create(absl::StrCat(tag, "-into-", t));
    t0 = Now();
    auto step = FetchReplica(addr, "t", 0, 1, store->get(), 120);
    const double fetched = Now() - t0;
    ckpt::RestoreOptions ro;
    ro.verify_data = false;
    auto snap = ckpt::RestoreFromShm(store->get(), ro);
    if (!step.ok() || !snap.ok() || !CopyOut(*snap, tensor.data(), &pool)) {
      std::fprintf(stderr, "replica restore failed\n");
      return 1;
    }
    rep.push_back(Now() - t0);
    rep_fetch.push_back(fetched);
  }
  const std::string ckdir = absl::StrCat(dir, "/ballast-replica-bench-", getpid());
  if (absl::Status s = ckpt::WriteShardFile(ckdir, 1, 0, image.data(), image.size()); !s.ok()) {
    std::fprintf(stderr, "write: %s\n", s.ToString().c_str());
    return 1;
  }
  const std::string path = ckpt::ShardPath(ckdir, 1, 0);
  for (int t = 0; t < trials; ++t) {
    for (bool cold : {true, false}) {
      if (cold) {
        int fd = open(path.c_str(), O_RDONLY);
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
      }
      double t0 = Now();
      ckpt::ReadOptions ro;
      ro.verify_data = false;
      auto snap = ckpt::ReadCheckpointFile(path, ro);
      if (!snap.ok() || !CopyOut(*snap, tensor.data(), &pool)) {
        std::fprintf(stderr, "disk restore failed\n");
        return 1;
      }
      (cold ? disk_cold : disk_warm).push_back(Now() - t0);
    }
  }
  std::filesystem::remove_all(ckdir);
  std::printf("  send the replica (source node, background): %7.3f s\n", Median(put));
  std::printf("  restore from the peer replica:              %7.3f s  (copy into shm %.3f s, verified load %.3f s)\n",
              Median(rep), Median(rep_fetch), Median(rep) - Median(rep_fetch));
  std::printf("  restore from disk, not in page cache:       %7.3f s  (%.1fx the replica)\n", Median(disk_cold),
              Median(disk_cold) / Median(rep));
  std::printf("  restore from disk, in page cache:           %7.3f s\n", Median(disk_warm));
  return 0;
}

}  // namespace
}  // namespace ballast::agent

int main(int argc, char** argv) { return ballast::agent::Main(argc, argv); }
