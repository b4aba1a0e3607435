// Snapshot: a validated checkpoint image as seen by a reader, whether it lives
// in a pinned shared-memory slot or in a mapped `.ballast` file. Byte-oriented
// on purpose: a binding turns (dtype, shape, bytes) into tensors.
//
// Ownership: the snapshot keeps its memory alive (the slot stays pinned, the
// file stays mapped) until the last copy of it is destroyed. Data is
// read-only. Thread safety: immutable; safe to share across threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "ckpt/format.h"

namespace ballast::ckpt {

class Snapshot {
 public:
  Snapshot() = default;
  // data_checksum: the header's checksum of the data region; verified: it was
  // checked against the data already (else a reader checks it as it copies:
  // CopyOutAndChecksum).
  Snapshot(uint64_t step, std::vector<Entry> entries, const uint8_t* data, uint64_t data_bytes,
           std::string source, std::shared_ptr<const void> keepalive, uint64_t data_checksum = 0,
           bool verified = true)
      : step_(step),
        entries_(std::move(entries)),
        data_(data),
        data_bytes_(data_bytes),
        data_checksum_(data_checksum),
        verified_(verified),
        source_(std::move(source)),
        keepalive_(std::move(keepalive)) {}

  // The snapshot of `parsed`, the image parsed from [image, image + image_bytes).
  static Snapshot Of(ParsedImage parsed, const uint8_t* image, uint64_t image_bytes, std::string source,
                     std::shared_ptr<const void> keepalive, bool verified) {
    Snapshot s(parsed.header.step, std::move(parsed.entries), parsed.data, parsed.header.data_bytes,
               std::move(source), std::move(keepalive), parsed.header.data_checksum, verified);
    s.image_ = image;
    s.image_bytes_ = image_bytes;
    return s;
  }

  uint64_t step() const { return step_; }
  const std::vector<Entry>& entries() const { return entries_; }
  // Bytes of entry i: [EntryData(i), EntryData(i) + entries()[i].nbytes).
  const uint8_t* EntryData(size_t i) const { return data_ + entries_[i].offset; }
  // The entry called key, or nullptr.
  const Entry* Find(absl::string_view key) const;
  const uint8_t* Data(const Entry& e) const { return data_ + e.offset; }
  uint64_t data_bytes() const { return data_bytes_; }
  const uint8_t* data() const { return data_; }
  uint64_t data_checksum() const { return data_checksum_; }
  bool verified() const { return verified_; }
  // Where it came from: "shm:/name.s1" or a file path.
  const std::string& source() const { return source_; }
  // The whole image (header, index, data) the snapshot was parsed from, for
  // sending it elsewhere as it is; null unless made by Of().
  const uint8_t* image() const { return image_; }
  uint64_t image_bytes() const { return image_bytes_; }

 private:
  uint64_t step_ = 0;
  std::vector<Entry> entries_;
  const uint8_t* data_ = nullptr;
  uint64_t data_bytes_ = 0;
  uint64_t data_checksum_ = 0;
  bool verified_ = true;
  std::string source_;
  std::shared_ptr<const void> keepalive_;
  const uint8_t* image_ = nullptr;
  uint64_t image_bytes_ = 0;
};

inline const Entry* Snapshot::Find(absl::string_view key) const {
  for (const Entry& e : entries_) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

}  // namespace ballast::ckpt
