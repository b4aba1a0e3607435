// Checksum64: the data and index checksum of the flash-checkpoint format.
//
// Why not CRC32C: Debian 12's Abseil (20220623) has no absl::crc32c, and a
// software slice-by-8 CRC runs at ~1-2 GB/s, far below memcpy, while a save must
// stay within ~1.2x of a plain memcpy. So the format uses a vectorizable
// Fletcher-style 64-bit checksum:
//
//   The input is read as "rows" of 64 bytes = 8 little-endian uint64 words (the
//   last row zero-padded). Lane i (0..7) keeps, modulo 2^64,
//       a_i = sum over rows r of w[r][i]
//       b_i = sum over rows r of a_i after row r   (= sum (R - r) * w[r][i])
//   The digest mixes the byte length and all 16 sums with the splitmix64
//   finalizer.
//
// Properties: every single-word change (any number of flipped bits inside one
// 8-byte word) changes a_i, so it is always detected; truncation and extension
// change the length; swapping two different words in a lane changes b_i. It is
// not cryptographic and two compensating changes in one lane can cancel
// (like any Fletcher sum), which is acceptable for detecting torn writes, bit
// rot and truncation. It runs at tens of GB/s (two vector adds per 32 bytes with
// AVX2, chosen at load time; SSE2 otherwise), so
// it can be fused with the copy while the data is still in cache.
//
// Because the sums are linear, the checksum of a concatenation is computed from
// the checksums of its parts (Append), so threads checksum disjoint 64-byte
// aligned chunks in parallel and the result does not depend on the split.
//
// Thread safety: a Checksum64 is a plain value; use one per thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ballast::ckpt {

class Checksum64 {
 public:
  static constexpr size_t kRowBytes = 64;

  // Adds n bytes. Every update except the last must be a multiple of 64 bytes
  // (the last may leave a partial row, which is zero-padded); updating after a
  // partial row is a programming error (checked).
  void Update(const void* data, size_t n);

  // Makes *this the checksum of (bytes of *this) followed by (bytes of next).
  // *this must not end in a partial row.
  void Append(const Checksum64& next);

  // The 64-bit digest. Does not change the state.
  uint64_t Digest() const;

  uint64_t bytes() const { return bytes_; }

 private:
  uint64_t a_[8] = {};
  uint64_t b_[8] = {};
  uint64_t rows_ = 0;
  uint64_t bytes_ = 0;
  bool partial_ = false;
};

// Checksum of one contiguous buffer.
uint64_t ChecksumBytes(const void* data, size_t n);

}  // namespace ballast::ckpt
