// The versioned binary layout of a flash-checkpoint "image". The same bytes
// live in a shared-memory slot and in a `<dir>/step-<N>/rank-<R>.ballast` file,
// so the persister writes a slot to disk without re-encoding it.
//
//   [0, 128)                 header (fixed size, little-endian)
//   [128, 128 + index_bytes) index: one record per entry
//   [data_offset, +data_bytes) data; data_offset and every entry offset are
//                             64-byte aligned (relative to data_offset); padding
//                             between entries is zero
//
// Header fields (byte offset: type name):
//    0: char[8]  magic "BALLASTC"        8: u32 format_version (1)
//   12: u32 header_bytes (128)          16: u64 step
//   24: u32 state (2 = committed)       28: u32 num_entries
//   32: u64 index_bytes                 40: u64 data_offset
//   48: u64 data_bytes                  56: u64 index_checksum
//   64: u64 data_checksum               72..119: reserved (zero)
//  120: u64 header_checksum (Checksum64 of bytes [0, 120))
//
// Index record: u32 key_len, key bytes (UTF-8, no terminator), u8 dtype,
// u8 ndim, u16 reserved (0), i64 shape[ndim], u64 offset, u64 nbytes.
// Entries are stored in offset order, do not overlap, and keys are unique.
// Checksums are Checksum64 (see checksum.h); the data checksum covers the whole
// data region, padding included.
//
// Every parser here treats its input as untrusted: all lengths, offsets and
// products are bounds- and overflow-checked and a violation is kDataLoss with a
// message naming the source and what is wrong. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ballast::ckpt {

inline constexpr char kMagic[8] = {'B', 'A', 'L', 'L', 'A', 'S', 'T', 'C'};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint64_t kHeaderBytes = 128;
inline constexpr uint64_t kDataAlignment = 64;
inline constexpr uint32_t kMaxDims = 64;
inline constexpr uint32_t kMaxKeyBytes = 64 * 1024;
inline constexpr uint64_t kMaxIndexBytes = 1ULL << 30;

// Element types. Values are part of the on-disk format: never renumber.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kComplex32 = 4,  // torch.complex32 / chalf
  kComplex64 = 5,
  kComplex128 = 6,
  kUInt8 = 7,
  kInt8 = 8,
  kInt16 = 9,
  kInt32 = 10,
  kInt64 = 11,
  kBool = 12,
  kUInt16 = 13,
  kUInt32 = 14,
  kUInt64 = 15,
  kFloat8E4M3FN = 16,
  kFloat8E5M2 = 17,
  kFloat8E4M3FNUZ = 18,
  kFloat8E5M2FNUZ = 19,
  kBlob = 255,  // opaque bytes (a pickled non-tensor value); shape must be empty
};

// Bytes per element; 1 for kBlob; 0 for a value that is not a DType.
size_t DTypeSize(DType dtype);
bool IsValidDType(uint8_t value);
// "float32", "bfloat16", "blob", ... (torch names without "torch.").
absl::string_view DTypeName(DType dtype);
absl::StatusOr<DType> DTypeFromName(absl::string_view name);

enum class ImageState : uint32_t { kEmpty = 0, kWriting = 1, kCommitted = 2 };

struct Entry {
  std::string key;
  DType dtype = DType::kBlob;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // relative to the start of the data region
  uint64_t nbytes = 0;
};

struct Header {
  uint32_t format_version = kFormatVersion;
  uint64_t step = 0;
  ImageState state = ImageState::kCommitted;
  uint32_t num_entries = 0;
  uint64_t index_bytes = 0;
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
  uint64_t index_checksum = 0;
  uint64_t data_checksum = 0;

  uint64_t image_bytes() const { return data_offset + data_bytes; }
};

struct Layout {
  uint64_t index_bytes = 0;
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
  uint64_t image_bytes = 0;
};

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Number of elements of `shape` (1 for a scalar), or an error on a negative
// dimension or overflow.
absl::StatusOr<uint64_t> NumElements(const std::vector<int64_t>& shape);

// Assigns 64-byte aligned data offsets in the given order and returns the
// layout. kInvalidArgument on an empty or duplicate key, an unknown dtype, too
// many dims, a blob with a shape, or nbytes != numel * DTypeSize(dtype).
absl::StatusOr<Layout> PlanLayout(std::vector<Entry>* entries);

// Encodes the index (entries must be planned: offsets ascending).
std::string SerializeIndex(const std::vector<Entry>& entries);
// Writes exactly SerializedIndexSize(entries) bytes to out.
void SerializeIndexTo(const std::vector<Entry>& entries, uint8_t* out);
uint64_t SerializedIndexSize(const std::vector<Entry>& entries);

// Decodes and validates an index of num_entries records against a data region
// of data_bytes. `source` names the file or slot in error messages.
absl::StatusOr<std::vector<Entry>> ParseIndex(const uint8_t* data, uint64_t size,
                                              uint32_t num_entries, uint64_t data_bytes,
                                              absl::string_view source);

// Encodes the 128-byte header (computes header_checksum).
void EncodeHeader(const Header& header, uint8_t out[kHeaderBytes]);
// Decodes and validates the header fields alone (magic, version, header
// checksum, state, index/data geometry). Does not look at index or data.
absl::StatusOr<Header> DecodeHeader(const uint8_t* data, uint64_t size, absl::string_view source);

struct ParsedImage {
  Header header;
  std::vector<Entry> entries;
  const uint8_t* data = nullptr;  // start of the data region (inside the input)
};

struct ParseOptions {
  // Verify the data checksum (a full pass over the data).
  bool verify_data = true;
  // The input must be exactly the image (files); otherwise it may be longer
  // (a shared-memory slot larger than the image).
  bool exact_size = true;
};

// Validates a whole image: header, bounds, index checksum and index, and
// (optionally) the data checksum. kDataLoss with a message on any problem.
absl::StatusOr<ParsedImage> ParseImage(const uint8_t* data, uint64_t size, absl::string_view source,
                                       const ParseOptions& options = {});

// Computes header fields for planned entries (step, sizes, index checksum) and
// writes header + index into image[0, data_offset). The data checksum must be
// provided (it is computed while copying the data).
void WriteHeaderAndIndex(uint64_t step, const std::vector<Entry>& entries, const Layout& layout,
                         uint64_t data_checksum, uint8_t* image);

}  // namespace ballast::ckpt
