// Seeds for the libFuzzer targets (`make fuzz`): a fuzz replay test that
// builds a real input (a job's journal, a checkpoint image) writes it to
// $BALLAST_FUZZ_SEEDS/<target>/<name> when that variable is set, so the
// fuzzers start from inputs that pass the checksums. Tests only.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace ballast {

inline void WriteFuzzSeed(const std::string& target, const std::string& name, std::string_view bytes) {
  const char* root = std::getenv("BALLAST_FUZZ_SEEDS");
  if (root == nullptr || *root == '\0') return;
  const std::filesystem::path dir = std::filesystem::path(root) / target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace ballast
