// Test helpers for src/ckpt tests (not part of the library).
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "ckpt/format.h"
#include "gtest/gtest.h"

namespace ballast::ckpt::test_util {

// Crash injection: closes the write end the child inherited, waits for the
// child's one "ready" byte on read_fd, sleeps delay_us, then SIGKILLs and
// reaps the child. True when the child died by that signal (not earlier).
inline bool KillChildWhenReady(pid_t child, int read_fd, int write_fd, useconds_t delay_us = 0) {
  close(write_fd);
  char c;
  bool ready = read(read_fd, &c, 1) == 1;
  close(read_fd);
  if (delay_us > 0) usleep(delay_us);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  return ready && WIFSIGNALED(status);
}

// A shm name unique to this process and call.
inline std::string UniqueShmName(const std::string& tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("/ballast-test-", tag, "-", getpid(), "-", counter.fetch_add(1));
}

// A temp directory, removed by the caller if it likes.
inline std::string MakeTempDir(const std::string& tag) {
  std::string tmpl = absl::StrCat(::testing::TempDir(), "/ckpt-", tag, "-XXXXXX");
  char* p = mkdtemp(tmpl.data());
  return p == nullptr ? std::string() : std::string(p);
}

// Owned buffers plus the EntryViews that point at them.
struct State {
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<EntryView> views;

  void Add(const std::string& key, DType dtype, std::vector<int64_t> shape, uint8_t seed) {
    uint64_t n = dtype == DType::kBlob ? 0 : *NumElements(shape) * DTypeSize(dtype);
    Add(key, dtype, std::move(shape), n, seed);
  }
  void Add(const std::string& key, DType dtype, std::vector<int64_t> shape, uint64_t nbytes,
           uint8_t seed) {
    buffers.emplace_back(nbytes);
    for (uint64_t i = 0; i < nbytes; ++i) buffers.back()[i] = static_cast<uint8_t>(seed + i * 7);
    views.push_back({key, dtype, std::move(shape), buffers.back().data(), nbytes});
  }
  // Re-points views after buffers were moved (vector growth).
  void Fix() {
    for (size_t i = 0; i < views.size(); ++i) views[i].data = buffers[i].data();
  }
};

// Builds a whole image in memory, as a save would write it.
inline std::vector<uint8_t> BuildImage(uint64_t step, const std::vector<EntryView>& views) {
  std::vector<Entry> entries;
  std::vector<const void*> sources;
  for (const auto& v : views) {
    entries.push_back(Entry{v.key, v.dtype, v.shape, 0, v.nbytes});
    sources.push_back(v.data);
  }
  Layout layout = *PlanLayout(&entries);
  std::vector<uint8_t> image(layout.image_bytes);
  uint64_t sum = CopyDataAndChecksum(image.data() + layout.data_offset, layout.data_bytes, entries,
                                     sources, nullptr, 0, 0);
  WriteHeaderAndIndex(step, entries, layout, sum, image.data());
  return image;
}

}  // namespace ballast::ckpt::test_util
