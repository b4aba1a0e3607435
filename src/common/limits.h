// Size limits of the control plane. A report above a field's limit is
// truncated (its end kept: the last lines of a stderr tail say most), not
// refused; a name or key above its limit is refused with INVALID_ARGUMENT
// saying which; the KV store refuses writes past its bounds with
// RESOURCE_EXHAUSTED. gRPC refuses any message above kMaxMessageBytes.
// DLRover's master was OOMed by oversized reports (their #1723): every field
// an agent sends has a bound here.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"

namespace ballast {

inline constexpr size_t kMaxMessageBytes = 64u << 20;   // any one gRPC message, both ways
inline constexpr size_t kMaxTextBytes = 16u << 10;      // stderr tails, causes, errors, reasons
inline constexpr size_t kMaxNameBytes = 256;            // node ids, hosts, job ids
inline constexpr size_t kMaxKvKeyBytes = 1024;
inline constexpr size_t kMaxKvValueBytes = 1u << 20;
inline constexpr size_t kMaxKvKeys = 200000;            // a few per node at 10,000+ nodes
inline constexpr size_t kMaxHeldFailures = 100000;      // held failure reports (one or two per member)

// Keeps the last `max` bytes of *text, marked "[... N bytes cut] ". Returns
// whether it cut.
inline bool TruncateFront(std::string* text, size_t max = kMaxTextBytes) {
  if (text->size() <= max) return false;
  const size_t cut = text->size() - max;
  *text = absl::StrCat("[... ", cut, " bytes cut] ", text->substr(cut));
  return true;
}

}  // namespace ballast
