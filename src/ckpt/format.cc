#include "ckpt/format.h"

#include <cstring>
#include <string_view>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "ckpt/checksum.h"

namespace ballast::ckpt {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  absl::string_view name;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, 4, "float32"},
    {DType::kFloat64, 8, "float64"},
    {DType::kFloat16, 2, "float16"},
    {DType::kBFloat16, 2, "bfloat16"},
    {DType::kComplex32, 4, "complex32"},
    {DType::kComplex64, 8, "complex64"},
    {DType::kComplex128, 16, "complex128"},
    {DType::kUInt8, 1, "uint8"},
    {DType::kInt8, 1, "int8"},
    {DType::kInt16, 2, "int16"},
    {DType::kInt32, 4, "int32"},
    {DType::kInt64, 8, "int64"},
    {DType::kBool, 1, "bool"},
    {DType::kUInt16, 2, "uint16"},
    {DType::kUInt32, 4, "uint32"},
    {DType::kUInt64, 8, "uint64"},
    {DType::kFloat8E4M3FN, 1, "float8_e4m3fn"},
    {DType::kFloat8E5M2, 1, "float8_e5m2"},
    {DType::kFloat8E4M3FNUZ, 1, "float8_e4m3fnuz"},
    {DType::kFloat8E5M2FNUZ, 1, "float8_e5m2fnuz"},
    {DType::kBlob, 1, "blob"},
};

const DTypeInfo* FindDType(uint8_t v) {
  for (const auto& info : kDTypes) {
    if (static_cast<uint8_t>(info.dtype) == v) return &info;
  }
  return nullptr;
}

// Little-endian field access (the format is little-endian; checksum.cc asserts
// the host is too, so these are plain unaligned loads/stores).
template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

constexpr uint64_t kHeaderChecksumOffset = 120;
// Smallest index record: key_len + 1 key byte + dtype + ndim + reserved + offset + nbytes.
constexpr uint64_t kMinRecordBytes = 4 + 1 + 1 + 1 + 2 + 8 + 8;

uint64_t RecordSize(const Entry& e) { return 4 + e.key.size() + 4 + 8 * e.shape.size() + 16; }

absl::Status Corrupt(absl::string_view source, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(
      "checkpoint ", source, " is corrupt: ", what,
      "; it cannot be loaded: restore from an older step or delete this step directory"));
}

}  // namespace

size_t DTypeSize(DType dtype) {
  const DTypeInfo* info = FindDType(static_cast<uint8_t>(dtype));
  return info == nullptr ? 0 : info->size;
}

bool IsValidDType(uint8_t value) { return FindDType(value) != nullptr; }

absl::string_view DTypeName(DType dtype) {
  const DTypeInfo* info = FindDType(static_cast<uint8_t>(dtype));
  return info == nullptr ? "invalid" : info->name;
}

absl::StatusOr<DType> DTypeFromName(absl::string_view name) {
  if (name.substr(0, 6) == "torch.") name.remove_prefix(6);
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

absl::StatusOr<uint64_t> NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension ", d));
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      return absl::InvalidArgumentError("shape has more elements than fit in 64 bits");
    }
  }
  return n;
}

namespace {

// Shared by PlanLayout (caller error -> kInvalidArgument) and ParseIndex
// (untrusted input -> kDataLoss): "" when the entry is consistent.
std::string CheckEntryShape(const Entry& e) {
  if (e.key.empty()) return "empty key";
  if (e.key.size() > kMaxKeyBytes) return absl::StrCat("key longer than ", kMaxKeyBytes, " bytes");
  if (!IsValidDType(static_cast<uint8_t>(e.dtype))) {
    return absl::StrCat("unknown dtype ", static_cast<int>(e.dtype));
  }
  if (e.shape.size() > kMaxDims) return absl::StrCat("more than ", kMaxDims, " dimensions");
  if (e.dtype == DType::kBlob) {
    if (!e.shape.empty()) return "a blob must have an empty shape";
    return "";
  }
  absl::StatusOr<uint64_t> numel = NumElements(e.shape);
  if (!numel.ok()) return std::string(numel.status().message());
  uint64_t expect = 0;
  if (__builtin_mul_overflow(*numel, static_cast<uint64_t>(DTypeSize(e.dtype)), &expect)) {
    return "byte size overflows 64 bits";
  }
  if (expect != e.nbytes) {
    return absl::StrCat("byte size ", e.nbytes, " does not match shape and dtype ",
                        DTypeName(e.dtype), " (", expect, " bytes)");
  }
  return "";
}

}  // namespace

absl::StatusOr<Layout> PlanLayout(std::vector<Entry>* entries) {
  std::unordered_set<std::string_view> keys;
  keys.reserve(entries->size());
  uint64_t index_bytes = 0;
  uint64_t data = 0;
  for (Entry& e : *entries) {
    if (std::string err = CheckEntryShape(e); !err.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint entry '", e.key, "': ", err));
    }
    if (!keys.insert(e.key).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate checkpoint key '", e.key, "'"));
    }
    e.offset = AlignUp(data, kDataAlignment);
    data = e.offset + e.nbytes;
    index_bytes += RecordSize(e);
  }
  if (entries->size() > UINT32_MAX || index_bytes > kMaxIndexBytes) {
    return absl::InvalidArgumentError("checkpoint index too large");
  }
  Layout layout;
  layout.index_bytes = index_bytes;
  layout.data_offset = AlignUp(kHeaderBytes + index_bytes, kDataAlignment);
  layout.data_bytes = AlignUp(data, kDataAlignment);
  layout.image_bytes = layout.data_offset + layout.data_bytes;
  return layout;
}

uint64_t SerializedIndexSize(const std::vector<Entry>& entries) {
  uint64_t n = 0;
  for (const Entry& e : entries) n += RecordSize(e);
  return n;
}

void SerializeIndexTo(const std::vector<Entry>& entries, uint8_t* out) {
  for (const Entry& e : entries) {
    Put<uint32_t>(out, static_cast<uint32_t>(e.key.size()));
    out += 4;
    std::memcpy(out, e.key.data(), e.key.size());
    out += e.key.size();
    out[0] = static_cast<uint8_t>(e.dtype);
    out[1] = static_cast<uint8_t>(e.shape.size());
    out[2] = 0;
    out[3] = 0;
    out += 4;
    for (int64_t d : e.shape) {
      Put<int64_t>(out, d);
      out += 8;
    }
    Put<uint64_t>(out, e.offset);
    Put<uint64_t>(out + 8, e.nbytes);
    out += 16;
  }
}

std::string SerializeIndex(const std::vector<Entry>& entries) {
  std::string out(SerializedIndexSize(entries), '\0');
  SerializeIndexTo(entries, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

absl::StatusOr<std::vector<Entry>> ParseIndex(const uint8_t* data, uint64_t size,
                                              uint32_t num_entries, uint64_t data_bytes,
                                              absl::string_view source) {
  // Cheap plausibility check before reserving memory for num_entries.
  if (num_entries > size / kMinRecordBytes) {
    return Corrupt(source, absl::StrCat("index of ", size, " bytes cannot hold ", num_entries,
                                        " entries"));
  }
  std::vector<Entry> entries;
  entries.reserve(num_entries);
  std::unordered_set<std::string_view> keys;
  keys.reserve(num_entries);
  uint64_t pos = 0;
  uint64_t prev_end = 0;
  for (uint32_t i = 0; i < num_entries; ++i) {
    auto need = [&](uint64_t n, const char* what) -> absl::Status {
      if (n > size - pos) {
        return Corrupt(source, absl::StrCat("entry ", i, " ", what, " runs past the end of the ",
                                            size, "-byte index"));
      }
      return absl::OkStatus();
    };
    if (auto s = need(4, "key length"); !s.ok()) return s;
    uint32_t key_len = Get<uint32_t>(data + pos);
    pos += 4;
    if (key_len == 0 || key_len > kMaxKeyBytes) {
      return Corrupt(source, absl::StrCat("entry ", i, " has invalid key length ", key_len));
    }
    if (auto s = need(key_len, "key"); !s.ok()) return s;
    Entry e;
    e.key.assign(reinterpret_cast<const char*>(data + pos), key_len);
    pos += key_len;
    if (auto s = need(4, "dtype"); !s.ok()) return s;
    uint8_t dtype = data[pos];
    uint8_t ndim = data[pos + 1];
    if (data[pos + 2] != 0 || data[pos + 3] != 0) {
      return Corrupt(source, absl::StrCat("entry ", i, " has nonzero reserved bytes"));
    }
    pos += 4;
    if (!IsValidDType(dtype)) {
      return Corrupt(source, absl::StrCat("entry ", i, " has unknown dtype ", dtype));
    }
    e.dtype = static_cast<DType>(dtype);
    if (ndim > kMaxDims) {
      return Corrupt(source, absl::StrCat("entry ", i, " has ", ndim, " dimensions (max ",
                                          kMaxDims, ")"));
    }
    if (auto s = need(8ULL * ndim + 16, "shape/offset"); !s.ok()) return s;
    e.shape.resize(ndim);
    for (uint8_t d = 0; d < ndim; ++d) {
      e.shape[d] = Get<int64_t>(data + pos);
      pos += 8;
    }
    e.offset = Get<uint64_t>(data + pos);
    e.nbytes = Get<uint64_t>(data + pos + 8);
    pos += 16;
    if (std::string err = CheckEntryShape(e); !err.empty()) {
      return Corrupt(source, absl::StrCat("entry ", i, " ('", e.key, "'): ", err));
    }
    if (e.offset % kDataAlignment != 0) {
      return Corrupt(source, absl::StrCat("entry ", i, " data offset ", e.offset,
                                          " is not 64-byte aligned"));
    }
    if (e.offset < prev_end) {
      return Corrupt(source, absl::StrCat("entry ", i, " data offset ", e.offset,
                                          " overlaps the previous entry (ends at ", prev_end, ")"));
    }
    if (e.offset > data_bytes || e.nbytes > data_bytes - e.offset) {
      uint64_t end = 0;
      const bool overflow = __builtin_add_overflow(e.offset, e.nbytes, &end);
      return Corrupt(source, absl::StrCat("entry ", i, " data range [", e.offset, ",",
                                          overflow ? std::string(">2^64") : absl::StrCat(end),
                                          ") exceeds data size ", data_bytes));
    }
    prev_end = e.offset + e.nbytes;
    entries.push_back(std::move(e));
  }
  if (pos != size) {
    return Corrupt(source, absl::StrCat("index has ", size - pos, " trailing bytes after ",
                                        num_entries, " entries"));
  }
  for (uint32_t i = 0; i < entries.size(); ++i) {
    if (!keys.insert(entries[i].key).second) {
      return Corrupt(source, absl::StrCat("entry ", i, " repeats key '", entries[i].key, "'"));
    }
  }
  return entries;
}

void EncodeHeader(const Header& h, uint8_t out[kHeaderBytes]) {
  std::memset(out, 0, kHeaderBytes);
  std::memcpy(out, kMagic, 8);
  Put<uint32_t>(out + 8, h.format_version);
  Put<uint32_t>(out + 12, static_cast<uint32_t>(kHeaderBytes));
  Put<uint64_t>(out + 16, h.step);
  Put<uint32_t>(out + 24, static_cast<uint32_t>(h.state));
  Put<uint32_t>(out + 28, h.num_entries);
  Put<uint64_t>(out + 32, h.index_bytes);
  Put<uint64_t>(out + 40, h.data_offset);
  Put<uint64_t>(out + 48, h.data_bytes);
  Put<uint64_t>(out + 56, h.index_checksum);
  Put<uint64_t>(out + 64, h.data_checksum);
  Put<uint64_t>(out + kHeaderChecksumOffset, ChecksumBytes(out, kHeaderChecksumOffset));
}

absl::StatusOr<Header> DecodeHeader(const uint8_t* data, uint64_t size, absl::string_view source) {
  if (size < kHeaderBytes) {
    return Corrupt(source, absl::StrCat("truncated: ", size, " bytes, shorter than the ",
                                        kHeaderBytes, "-byte header"));
  }
  if (std::memcmp(data, kMagic, 8) != 0) {
    return Corrupt(source, "bad magic (not a Ballast checkpoint file)");
  }
  Header h;
  h.format_version = Get<uint32_t>(data + 8);
  if (h.format_version != kFormatVersion) {
    if (h.format_version > kFormatVersion) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", source, " has format version ", h.format_version,
          " but this build reads version ", kFormatVersion, ": load it with a newer Ballast"));
    }
    return Corrupt(source, absl::StrCat("unknown format version ", h.format_version));
  }
  uint32_t header_bytes = Get<uint32_t>(data + 12);
  if (header_bytes != kHeaderBytes) {
    return Corrupt(source, absl::StrCat("header size ", header_bytes, " (expected ",
                                        kHeaderBytes, ")"));
  }
  if (Get<uint64_t>(data + kHeaderChecksumOffset) != ChecksumBytes(data, kHeaderChecksumOffset)) {
    return Corrupt(source, "header checksum mismatch");
  }
  h.step = Get<uint64_t>(data + 16);
  uint32_t state = Get<uint32_t>(data + 24);
  if (state != static_cast<uint32_t>(ImageState::kCommitted)) {
    return Corrupt(source, absl::StrCat("image state ", state, " is not committed"));
  }
  h.state = ImageState::kCommitted;
  h.num_entries = Get<uint32_t>(data + 28);
  h.index_bytes = Get<uint64_t>(data + 32);
  h.data_offset = Get<uint64_t>(data + 40);
  h.data_bytes = Get<uint64_t>(data + 48);
  h.index_checksum = Get<uint64_t>(data + 56);
  h.data_checksum = Get<uint64_t>(data + 64);
  if (h.index_bytes > kMaxIndexBytes) {
    return Corrupt(source, absl::StrCat("index size ", h.index_bytes, " is implausible"));
  }
  if (h.data_offset != AlignUp(kHeaderBytes + h.index_bytes, kDataAlignment)) {
    return Corrupt(source, absl::StrCat("data offset ", h.data_offset,
                                        " does not follow the index"));
  }
  if (h.data_bytes > UINT64_MAX - h.data_offset) {
    return Corrupt(source, absl::StrCat("data size ", h.data_bytes, " overflows"));
  }
  return h;
}

absl::StatusOr<ParsedImage> ParseImage(const uint8_t* data, uint64_t size, absl::string_view source,
                                       const ParseOptions& options) {
  absl::StatusOr<Header> header = DecodeHeader(data, size, source);
  if (!header.ok()) return header.status();
  const Header& h = *header;
  const uint64_t image_bytes = h.image_bytes();
  if (size < image_bytes) {
    return Corrupt(source, absl::StrCat("truncated: ", size, " bytes but the header describes ",
                                        image_bytes, " bytes"));
  }
  if (options.exact_size && size != image_bytes) {
    return Corrupt(source, absl::StrCat(size - image_bytes, " unexpected bytes after the ",
                                        image_bytes, "-byte image"));
  }
  const uint8_t* index = data + kHeaderBytes;
  if (ChecksumBytes(index, h.index_bytes) != h.index_checksum) {
    return Corrupt(source, "index checksum mismatch");
  }
  // The gap between index and data is covered by no checksum: require zeros.
  for (uint64_t i = kHeaderBytes + h.index_bytes; i < h.data_offset; ++i) {
    if (data[i] != 0) return Corrupt(source, "nonzero padding between index and data");
  }
  absl::StatusOr<std::vector<Entry>> entries =
      ParseIndex(index, h.index_bytes, h.num_entries, h.data_bytes, source);
  if (!entries.ok()) return entries.status();
  if (options.verify_data && ChecksumBytes(data + h.data_offset, h.data_bytes) != h.data_checksum) {
    return Corrupt(source, absl::StrCat("data checksum mismatch over ", h.data_bytes, " bytes"));
  }
  ParsedImage out;
  out.header = h;
  out.entries = std::move(*entries);
  out.data = data + h.data_offset;
  return out;
}

void WriteHeaderAndIndex(uint64_t step, const std::vector<Entry>& entries, const Layout& layout,
                         uint64_t data_checksum, uint8_t* image) {
  uint8_t* index = image + kHeaderBytes;
  SerializeIndexTo(entries, index);
  // Zero the gap between index and data so the image is deterministic.
  std::memset(index + layout.index_bytes, 0,
              layout.data_offset - kHeaderBytes - layout.index_bytes);
  Header h;
  h.step = step;
  h.state = ImageState::kCommitted;
  h.num_entries = static_cast<uint32_t>(entries.size());
  h.index_bytes = layout.index_bytes;
  h.data_offset = layout.data_offset;
  h.data_bytes = layout.data_bytes;
  h.index_checksum = ChecksumBytes(index, layout.index_bytes);
  h.data_checksum = data_checksum;
  EncodeHeader(h, image);
}

}  // namespace ballast::ckpt
