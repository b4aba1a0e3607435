// Replays thousands of deterministic mutations of a valid image through the
// fuzz entry point (reader_fuzz.cc) and the file reader. Passing means: no
// crash, and every mutation is either rejected with kDataLoss or still a
// self-consistent image. Run it under ASan for the full effect:
//   cmake -B build-asan -DCMAKE_CXX_FLAGS=-fsanitize=address ...
#include <random>

#include "ckpt/checksum.h"
#include "ckpt/format.h"
#include "ckpt/test_util.h"
#include "common/fuzz_seed.h"
#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace ballast::ckpt {
namespace {

using test_util::BuildImage;
using test_util::State;

std::vector<uint8_t> ValidImage() {
  State st;
  st.Add("model.w", DType::kFloat32, {7, 9}, 1);
  st.Add("model.b", DType::kBFloat16, {9}, 2);
  st.Add("scalar", DType::kInt64, {}, 3);
  st.Add("empty", DType::kComplex64, {0, 4}, 4);
  st.Add("opt", DType::kBlob, {}, 300, 5);
  return BuildImage(77, st.views);
}

template <typename T>
void Put(std::vector<uint8_t>& v, size_t off, T x) {
  if (off + sizeof(T) <= v.size()) std::memcpy(v.data() + off, &x, sizeof(T));
}

// Recomputes the index and header checksums (when the geometry allows), so a
// mutation gets past the checksums and reaches the structural checks.
void Reseal(std::vector<uint8_t>& v) {
  if (v.size() < kHeaderBytes) return;
  uint64_t index_bytes = 0;
  std::memcpy(&index_bytes, v.data() + 32, 8);
  if (index_bytes <= v.size() - kHeaderBytes) {
    Put<uint64_t>(v, 56, ChecksumBytes(v.data() + kHeaderBytes, index_bytes));
  }
  Put<uint64_t>(v, 120, ChecksumBytes(v.data(), 120));
}

struct Tally {
  int ok = 0;
  int rejected = 0;
};

void Feed(const std::vector<uint8_t>& input, Tally* tally) {
  // Copy into an exactly-sized heap buffer so ASan flags any overread.
  std::unique_ptr<uint8_t[]> buf(new uint8_t[input.size() + (input.empty() ? 1 : 0)]);
  if (!input.empty()) std::memcpy(buf.get(), input.data(), input.size());
  LLVMFuzzerTestOneInput(buf.get(), input.size());
  auto parsed = ParseImage(buf.get(), input.size(), "mutant");
  if (parsed.ok()) {
    ++tally->ok;
  } else {
    ASSERT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << parsed.status();
    ASSERT_NE(parsed.status().message().find("mutant"), absl::string_view::npos);
    ++tally->rejected;
  }
}

TEST(CkptReaderFuzzReplay, ValidImageParses) {
  auto img = ValidImage();
  WriteFuzzSeed("ckpt_reader_fuzz", "valid_image",
                std::string_view(reinterpret_cast<const char*>(img.data()), img.size()));
  Tally t;
  Feed(img, &t);
  EXPECT_EQ(t.ok, 1);
}

TEST(CkptReaderFuzzReplay, EveryTruncationIsRejected) {
  auto img = ValidImage();
  Tally t;
  for (size_t len = 0; len < img.size(); ++len) {
    Feed(std::vector<uint8_t>(img.begin(), img.begin() + len), &t);
    // Resealed truncations too (the header is made consistent again).
    auto cut = std::vector<uint8_t>(img.begin(), img.begin() + len);
    Reseal(cut);
    Feed(cut, &t);
  }
  EXPECT_EQ(t.ok, 0);
}

TEST(CkptReaderFuzzReplay, SingleBitFlipsAreAllRejected) {
  auto img = ValidImage();
  Tally t;
  for (size_t i = 0; i < img.size(); ++i) {
    for (int bit : {0, 3, 7}) {
      auto m = img;
      m[i] ^= static_cast<uint8_t>(1u << bit);
      Feed(m, &t);
    }
  }
  // Unresealed: every flip hits a checksum (or a reserved byte).
  EXPECT_EQ(t.ok, 0);
}

TEST(CkptReaderFuzzReplay, ResealedRandomMutationsNeverCrash) {
  auto img = ValidImage();
  std::mt19937_64 rng(12345);
  Tally t;
  for (int iter = 0; iter < 20000; ++iter) {
    auto m = img;
    const int kind = static_cast<int>(rng() % 6);
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (kind) {
        case 0:  // bit flips anywhere
          m[rng() % m.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:  // random bytes in header + index
          m[rng() % std::min<size_t>(m.size(), 600)] = static_cast<uint8_t>(rng());
          break;
        case 2: {  // extreme 64-bit values at 8-byte positions of header + index
          const uint64_t vals[] = {0, 1, 63, 64, 0x7fffffffffffffffULL, ~0ULL, ~0ULL - 63,
                                   1ULL << 32, img.size(), rng()};
          Put<uint64_t>(m, (rng() % 75) * 8, vals[rng() % 10]);
          break;
        }
        case 3: {  // extreme 32-bit values (key lengths, counts, versions)
          const uint32_t vals[] = {0, 1, 2, 255, 65536, 0x7fffffff, 0xffffffff,
                                   static_cast<uint32_t>(rng())};
          Put<uint32_t>(m, rng() % 600, vals[rng() % 8]);
          break;
        }
        case 4:  // truncate
          m.resize(rng() % m.size());
          break;
        case 5:  // extend with garbage
          for (int k = 0, n = static_cast<int>(rng() % 200); k < n; ++k) {
            m.push_back(static_cast<uint8_t>(rng()));
          }
          break;
      }
      if (m.empty()) break;
    }
    if (rng() % 4 != 0) Reseal(m);
    Feed(m, &t);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(t.rejected, 15000);
}

TEST(CkptReaderFuzzReplay, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(99);
  Tally t;
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> m(rng() % 2048);
    for (auto& b : m) b = static_cast<uint8_t>(rng());
    if (m.size() >= 8 && iter % 2 == 0) std::memcpy(m.data(), kMagic, 8);
    if (iter % 3 == 0) {
      Put<uint32_t>(m, 8, kFormatVersion);
      Put<uint32_t>(m, 12, static_cast<uint32_t>(kHeaderBytes));
      Put<uint32_t>(m, 24, 2);
      Reseal(m);
    }
    Feed(m, &t);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(t.ok, 0);
}

}  // namespace
}  // namespace ballast::ckpt
