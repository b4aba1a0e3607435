// libFuzzer entry point for the checkpoint image parser: arbitrary bytes must
// give OK or an error Status, never a crash, hang or out-of-bounds read.
// Built as a fuzzer with clang (-DBALLAST_FUZZ=ON); the gtest
// reader_fuzz_replay_test links the same function and replays thousands of
// deterministic mutations of a valid image in every build.
#include <cstddef>
#include <cstdint>

#include "ckpt/format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using ballast::ckpt::ParseImage;
  for (bool exact : {true, false}) {
    ballast::ckpt::ParseOptions options;
    options.exact_size = exact;
    auto image = ParseImage(data, size, "fuzz input", options);
    if (!image.ok()) continue;
    // Touch every entry's bytes, so ASan catches a range the parser let through.
    volatile uint8_t sink = 0;
    for (const auto& e : image->entries) {
      for (uint64_t i = 0; i < e.nbytes; i += 4096) sink = sink + image->data[e.offset + i];
      if (e.nbytes > 0) sink = sink + image->data[e.offset + e.nbytes - 1];
    }
  }
  return 0;
}
