#include "ckpt/checksum.h"

#include <bit>
#include <cstdlib>
#include <cstring>

namespace ballast::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format is little-endian; big-endian hosts need byte swaps");

// Four uint64 lanes. With AVX2 this is one vpaddq per 32 bytes; on other
// targets GCC lowers it to pairs of SSE2 paddq (or NEON adds).
typedef uint64_t V4 __attribute__((vector_size(32)));

// Adds `rows` full 64-byte rows to the lane sums. Compiled twice (AVX2 and
// baseline x86-64) and picked at load time by the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void AddRows(uint64_t* a, uint64_t* b, const unsigned char* p, size_t rows) {
  V4 a0, a1, b0, b1;
  std::memcpy(&a0, a, 32);
  std::memcpy(&a1, a + 4, 32);
  std::memcpy(&b0, b, 32);
  std::memcpy(&b1, b + 4, 32);
  for (size_t r = 0; r < rows; ++r, p += 64) {
    V4 w0, w1;  // unaligned loads
    std::memcpy(&w0, p, 32);
    std::memcpy(&w1, p + 32, 32);
    a0 += w0;
    a1 += w1;
    b0 += a0;
    b1 += a1;
  }
  std::memcpy(a, &a0, 32);
  std::memcpy(a + 4, &a1, 32);
  std::memcpy(b, &b0, 32);
  std::memcpy(b + 4, &b1, 32);
}

inline uint64_t Mix(uint64_t z) {  // splitmix64 finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

void Checksum64::Update(const void* data, size_t n) {
  if (n == 0) return;
  if (partial_) std::abort();  // programming error: data after a partial row
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t full_rows = n / kRowBytes;
  AddRows(a_, b_, p, full_rows);
  size_t rows = full_rows;
  const size_t tail = n - full_rows * kRowBytes;
  if (tail != 0) {
    unsigned char last[kRowBytes] = {};
    std::memcpy(last, p + full_rows * kRowBytes, tail);
    AddRows(a_, b_, last, 1);
    ++rows;
    partial_ = true;
  }
  rows_ += rows;
  bytes_ += n;
}

void Checksum64::Append(const Checksum64& next) {
  if (partial_ && next.bytes_ != 0) std::abort();  // programming error
  for (int i = 0; i < 8; ++i) {
    // b over the concatenation: each of next's rows adds the final a of *this.
    b_[i] = b_[i] + next.rows_ * a_[i] + next.b_[i];
    a_[i] += next.a_[i];
  }
  rows_ += next.rows_;
  bytes_ += next.bytes_;
  partial_ = next.partial_;
}

uint64_t Checksum64::Digest() const {
  uint64_t h = Mix(0x42414c4c41535443ULL ^ bytes_);  // "BALLASTC"
  for (int i = 0; i < 8; ++i) {
    h = Mix(h ^ a_[i]) + 0x9e3779b97f4a7c15ULL;
    h = Mix(h ^ b_[i]);
  }
  return h;
}

uint64_t ChecksumBytes(const void* data, size_t n) {
  Checksum64 c;
  c.Update(data, n);
  return c.Digest();
}

}  // namespace ballast::ckpt
